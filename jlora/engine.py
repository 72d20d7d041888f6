"""`Engine`: a base model from a Hugging Face directory plus PEFT adapters in device slots.

The model runs as one jitted pure function of (graphdef, state, batch, cache, adapter weights); the batch's
`LoRABatchInfo` is built inside it from per-token slots, so changing the adapter mix or loading adapters
never recompiles. Prompt lengths and batch sizes are padded to power-of-two buckets, which bound the
compilations.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora.adapters import AdapterPool
from jlora.batch_info import LoRABatchInfo
from jlora.models.config import ModelConfig
from jlora.models.llama import KVCache, Transformer
from jlora.models.loading import load_model

__all__ = ["Engine", "bucket"]


def bucket(n: int, minimum: int = 1) -> int:
    """The power-of-two bucket (>= minimum) that holds n."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("graphdef", "block_m", "backend"), donate_argnames=("cache",))
def forward(graphdef, state, tokens, positions, cache, lora, token_slot, ranks, *, block_m: int, backend: str):
    """One jitted model call: tokens/positions [B, S], token_slot [B·S] -> (logits [B, S, V] f32, cache)."""
    model = nnx.merge(graphdef, state)
    info = LoRABatchInfo.build(token_slot, ranks, jnp.ones(ranks.shape, jnp.float32), block_m=block_m)
    return model(tokens, positions, cache, lora, info, backend=backend)


class Engine:
    """A base model and its adapter slots.

    Build with `Engine.from_pretrained(model_dir, max_loras=8, max_lora_rank=64, dtype="float32")`.
    """

    def __init__(self, model: Transformer, *, max_loras: int, max_lora_rank: int, dtype, backend: str = "auto",
                 evict: str = "lru"):
        self.config: ModelConfig = model.config
        self.dtype = dtype
        self.backend = backend
        self.graphdef, self.state = nnx.split(model)
        self.pool = AdapterPool(self.config, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype,
                                evict=evict)

    @classmethod
    def from_pretrained(cls, model_dir: str, *, max_loras: int = 8, max_lora_rank: int = 64,
                        dtype: str | None = None, backend: str = "auto", evict: str = "lru",
                        progress: bool = True) -> Engine:
        """Loads an HF checkpoint directory (config.json + safetensors).

        Args:
          model_dir: the HF model directory.
          max_loras: adapter slots on the device.
          max_lora_rank: the largest adapter rank accepted.
          dtype: "bfloat16", "float16" or "float32"; default bfloat16 on GPU, float32 elsewhere.
          backend: the LoRA ops' backend ("auto": pallas on GPU, reference elsewhere).
          evict: when the pool is full, "lru" evicts the least recently used idle adapter; "refuse" raises.
          progress: show a progress bar while loading.
        """
        dtype = jnp.dtype(dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
        model = load_model(model_dir, dtype, progress=progress)
        return cls(model, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, backend=backend,
                   evict=evict)

    def load_adapter(self, name: str, adapter_dir: str) -> None:
        """Loads a PEFT adapter directory under `name` (see `AdapterPool.load` for the errors)."""
        self.pool.load(name, adapter_dir)

    def unload_adapter(self, name: str) -> None:
        self.pool.unload(name)

    @property
    def adapters(self) -> list[str]:
        return self.pool.names

    def _slots(self, adapters: Sequence[str | None]) -> np.ndarray:
        unknown = sorted({a for a in adapters if a is not None and a not in self.pool.names})
        if unknown:
            raise KeyError(f"unknown adapter(s) {unknown}; loaded: {self.pool.names}")
        return np.array([-1 if a is None else self.pool.slot(a) for a in adapters], np.int32)

    def _check_prompts(self, prompts: Sequence[Sequence[int]], adapters: Sequence[str | None]) -> None:
        if len(prompts) != len(adapters):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters; give one per prompt (None: base)")
        if not prompts:
            raise ValueError("no prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.config.vocab_size}): {bad[:5]}")

    def run(self, tokens: np.ndarray, positions: np.ndarray, token_slot: np.ndarray, cache: KVCache):
        """One jitted model call on padded host arrays; returns (logits [B, S, V] f32, cache)."""
        block_m = 16 if tokens.size <= 256 else 64
        return forward(self.graphdef, self.state, jnp.asarray(tokens), jnp.asarray(positions), cache,
                       self.pool.weights, jnp.asarray(token_slot), jnp.asarray(self.pool.ranks),
                       block_m=block_m, backend=self.backend)

    def prefill_logits(self, prompts: Sequence[Sequence[int]], adapters: Sequence[str | None]) -> list[np.ndarray]:
        """Logits of every prompt position, each request with its own adapter (None: the base model).

        Args:
          prompts: token id lists.
          adapters: one adapter name or None per prompt.

        Returns:
          One float32 array [len(prompt), vocab] per prompt.
        """
        self._check_prompts(prompts, adapters)
        slots = self._slots(adapters)
        batch, seq = bucket(len(prompts)), bucket(max(len(p) for p in prompts), 16)
        tokens = np.zeros((batch, seq), np.int32)
        token_slot = np.full((batch, seq), -1, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            token_slot[i, : len(p)] = slots[i]
        positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
        cache = KVCache.zeros(self.config, batch, seq, self.dtype)
        logits, _ = self.run(tokens, positions, token_slot.reshape(-1), cache)
        logits = np.asarray(logits)
        return [logits[i, : len(p)] for i, p in enumerate(prompts)]
