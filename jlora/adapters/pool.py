"""The device slot pool: `max_loras` slots of fixed-shape stacked LoRA weights, loaded and evicted by name.

A load parses and validates the adapter on the host first (`read_adapter`) and only then writes its slot
with one jitted update of fixed shapes, so a failed load leaves every slot as it was and a successful one
never recompiles the model. When the pool is full, a load evicts the least recently used adapter that no
running request holds, or refuses (`evict="refuse"`).
"""

from __future__ import annotations

import collections
import functools
from typing import Literal

import jax
import numpy as np

from jlora.adapters.peft import read_adapter
from jlora.models.config import ModelConfig
from jlora.models.lora_weights import LayerLoRA, LoRAWeights
from jlora.pallas import kernel_rank

__all__ = ["AdapterPool", "PoolFullError"]


class PoolFullError(RuntimeError):
    """Every slot holds an adapter in use (or eviction is off)."""


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(weights: LoRAWeights, slot: jax.Array, new: LoRAWeights) -> LoRAWeights:
    return jax.tree.map(lambda w, n: w.at[slot].set(n.astype(w.dtype)), weights, new)


class AdapterPool:
    """Adapter slots on the device.

    Attributes:
      weights: the stacked `LoRAWeights` the model reads ([L, ...] per module, rank `rank`; under tensor
        parallelism in the `tp` layout and split over its mesh).
      ranks: [L] int32 host copy of each slot's rank (0 when empty).
    """

    def __init__(self, config: ModelConfig, *, max_loras: int, max_lora_rank: int, dtype,
                 evict: Literal["lru", "refuse"] = "lru", tp=None):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1")
        if evict not in ("lru", "refuse"):
            raise ValueError(f"evict must be 'lru' or 'refuse', got {evict!r}")
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.rank = kernel_rank(max_lora_rank)  # storage rank: the kernels need a power of two >= 16
        self.evict = evict
        self.tp = tp  # a jlora.parallel.TensorParallel: weights in its layout, split over its mesh
        if tp is None:
            self.weights = LoRAWeights.zeros(config, max_loras, self.rank, dtype)
        else:
            self.weights = tp.shard_lora(LoRAWeights.zeros(tp.layout, max_loras, self.rank, dtype))
        self.ranks = np.zeros(max_loras, np.int32)
        self._slots: collections.OrderedDict[str, int] = collections.OrderedDict()  # name -> slot, LRU first
        self._paths: dict[str, str] = {}
        self._in_use: collections.Counter[str] = collections.Counter()

    @property
    def num_slots(self) -> int:
        return len(self.ranks)

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def slot(self, name: str) -> int:
        """The slot of a loaded adapter (and marks it recently used)."""
        if name not in self._slots:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {self.names})")
        self._slots.move_to_end(name)
        return self._slots[name]

    def hold(self, names) -> None:
        """Marks adapters as used by running requests: they are not evicted until `release`."""
        for n in names:
            self.slot(n)
            self._in_use[n] += 1

    def release(self, names) -> None:
        for n in names:
            self._in_use[n] -= 1
            if self._in_use[n] <= 0:
                del self._in_use[n]

    def load(self, name: str, adapter_dir: str) -> int:
        """Loads a PEFT adapter into a slot; returns the slot.

        Raises:
          AdapterError: the adapter is invalid (nothing changes).
          ValueError: `name` is already loaded.
          PoolFullError: no free slot and nothing evictable.
        """
        if name in self._slots:
            raise ValueError(f"adapter {name!r} is already loaded from {self._paths[name]}; unload it first")
        host = read_adapter(adapter_dir, self.config, self.max_lora_rank, self.rank)
        if self.tp is not None:
            host = self.tp.permute_adapter(host)
        slot = self._free_slot(name)
        new = LoRAWeights(
            layers=tuple(LayerLoRA(a={g: a for g, (a, _) in layer.items()}, b={g: b for g, (_, b) in layer.items()})
                         for layer in host.layers),
            embed_a=host.embed[0], embed_b=host.embed[1], lm_head_a=host.lm_head[0], lm_head_b=host.lm_head[1],
        )
        self.weights = _write_slot(self.weights, np.int32(slot), new)
        self.ranks[slot] = host.rank
        self._slots[name] = slot
        self._paths[name] = adapter_dir
        return slot

    def unload(self, name: str) -> None:
        """Frees the adapter's slot (its weights stay until overwritten; rank 0 masks them meanwhile)."""
        if name not in self._slots:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {self.names})")
        if self._in_use[name]:
            raise RuntimeError(f"adapter {name!r} is used by running requests")
        self.ranks[self._slots.pop(name)] = 0
        del self._paths[name]

    def _free_slot(self, name: str) -> int:
        used = set(self._slots.values())
        for slot in range(self.num_slots):
            if slot not in used:
                return slot
        if self.evict == "lru":
            for victim in self._slots:  # least recently used first
                if not self._in_use[victim]:
                    slot = self._slots[victim]
                    self.unload(victim)
                    return slot
        raise PoolFullError(
            f"cannot load {name!r}: all {self.num_slots} slots hold adapters "
            f"({'all in use' if self.evict == 'lru' else 'eviction is off'}): {self.names}"
        )


