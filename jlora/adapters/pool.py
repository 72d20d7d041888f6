"""The device slot pool: `max_loras` slots of fixed-shape stacked LoRA weights, loaded and evicted by name.

A load is two calls: `prepare` parses and validates the adapter on the host (`read_adapter`, in a child process
when the pool has a `ProcessReader`; from any thread), and `install` writes its slot with one jitted update of
fixed shapes, so a failed load leaves every slot as it was and a successful one recompiles the model only when
it is the first to target a part (`step_weights`).
`stage`, on any thread in between, copies the prepared adapter to the device in one transfer, so that the update
only writes device memory (`install` stages an adapter that was not). When the pool is full, `install` evicts the
least recently used adapter that no running request holds, or refuses (`evict="refuse"`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
from typing import Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jlora.adapters.config import AdapterError, check_adapter_name
from jlora.adapters.peft import BaseRows, HostAdapter, module_rows
from jlora.adapters.reader import ProcessReader, ReadRequest
from jlora.models.config import ModelConfig
from jlora.models.lora_weights import LayerLoRA, LoRAWeights, RowOverrides, module_shapes
from jlora.pallas import kernel_rank
from jlora.precision import dot_precision

__all__ = ["AdapterPool", "BaseWeights", "PoolFullError", "PreparedAdapter"]


class PoolFullError(RuntimeError):
    """Every slot holds an adapter in use (or eviction is off)."""


@dataclasses.dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read and converted on the host, ready for `AdapterPool.install` (in the pool's layout)."""

    host: HostAdapter
    scale: dict | None  # DoRA's column factors per (layer, group) key, [N] each, or None
    shift: dict | None  # the columns added after them (LoRA bias), or None

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays: A and B, and DoRA's and LoRA bias's columns."""
        return self.host.nbytes + sum(x.nbytes for part in (self.scale, self.shift) for x in (part or {}).values())

    @property
    def staged(self) -> bool:
        """Whether its A and B are on the device (`AdapterPool.stage`)."""
        return any(isinstance(x, jax.Array) for x in jax.tree.leaves((self.host.layers, self.host.embed,
                                                                      self.host.lm_head)))


class BaseWeights(Protocol):
    """What the pool reads of the base model: its embedding rows (host) and a linear group's weight and bias
    (device, in the model's layout) for DoRA's column norms."""

    rows: BaseRows

    def linear(self, layer: int | None, group: str) -> tuple[jax.Array, jax.Array | None]:
        """(weight [K, N], bias [N] or None) of a layer's fused group; layer None, group "lm_head": [H, V]."""


@functools.partial(jax.jit, donate_argnums=0, static_argnames="rank")
def _write_slot(stacks: list[jax.Array], slot: jax.Array, new: list, *, rank: int) -> list[jax.Array]:
    """`stacks` ([L, ...] each) with slot `slot` set to `new`'s values, their A and B zero-padded from the
    adapter's rank bucket to the slots' `rank`; a None in `new` (a module the adapter does not target) is zeroed
    on the device. One compilation per set of parts the pool holds and rank bucket."""
    return [w.at[slot].set(jnp.zeros(w.shape[1:], w.dtype) if n is None
                           else _at_rank(n.astype(w.dtype), w.shape[1:], rank)) for w, n in zip(stacks, new)]


def _avals(xs, placed: bool) -> tuple:
    """What a compiled slot write depends on of its arguments, and keys it by: (shape, dtype, sharding) of each
    (None kept), the sharding a device array's where `placed` (the pool's arrays are committed to a mesh), else
    None, so that the write's outputs stay uncommitted as the stacks are (a committed stack would compile the
    step again)."""
    return tuple(None if x is None else (x.shape, x.dtype, x.sharding if placed and isinstance(x, jax.Array) else None)
                 for x in xs)


def _at_rank(x: jax.Array, shape: tuple[int, ...], rank: int) -> jax.Array:
    """A slot's part `shape` of `x`: an A [S·r, K] or B [N, r] at rank r zero-padded to [S·R, K] or [N, R] (R =
    `rank`); any other part as it is."""
    if x.shape == shape:
        return x
    if x.shape[0] == shape[0]:  # B: the rank is its last axis
        return jnp.pad(x, ((0, 0), (0, rank - x.shape[1])))
    slices = shape[0] // rank  # A: S slices of r rows each
    a = x.reshape(slices, x.shape[0] // slices, x.shape[1])
    return jnp.pad(a, ((0, 0), (0, rank - a.shape[1]), (0, 0))).reshape(shape)


@functools.partial(jax.jit, static_argnames=("shapes", "rows", "dtype", "shardings"))
def _unpacked(flat: jax.Array, *, shapes, rows, dtype, shardings) -> list[jax.Array]:
    """The arrays of `shapes` in `dtype` from `flat` [n] (bits, as unsigned integers of `dtype`'s width), which
    holds of each array, end to end, its row ranges `rows` ((start, stop), ...), the other rows zero; each placed
    at its sharding over a mesh (a slice of `flat`, a copy on every device, on each device); on one device they
    stay where `flat` is, uncommitted as it is."""
    out, start = [], 0
    for shape, ranges, at in zip(shapes, rows, shardings):
        x = jnp.zeros(shape, dtype)
        for first, stop in ranges:
            size = (stop - first) * math.prod(shape[1:])
            x = x.at[first:stop].set(jax.lax.bitcast_convert_type(flat[start : start + size], dtype)
                                     .reshape(stop - first, *shape[1:]))
            start += size
        out.append(jax.lax.with_sharding_constraint(x, at) if isinstance(at, jax.sharding.NamedSharding) else x)
    return out


@functools.partial(jax.jit, static_argnames=("slice_sizes",))
def _dora_factor(w, a, b, magnitude, mask, *, slice_sizes):
    """[N] f32 of a fused group: magnitude / ‖column of W + (B A)ᵀ‖ where `mask`, else 1 (PEFT's DoRA: the norm
    of each output's weights over the inputs; W [K, N], A [S·R, K], B [N, R] with the scaling folded in)."""
    rank, norms, start = a.shape[0] // len(slice_sizes), [], 0
    for i, n in enumerate(slice_sizes):
        delta = jnp.dot(b[start : start + n], a[i * rank : (i + 1) * rank], precision=dot_precision(jnp.float32))
        norms.append(jnp.linalg.norm(w[:, start : start + n].astype(jnp.float32) + delta.T, axis=0))
        start += n
    return jnp.where(mask, magnitude / jnp.concatenate(norms), 1.0)


def _whole(x) -> tuple[tuple[int, ...], tuple[tuple[int, int]]]:
    """(shape, row ranges) of an array copied as it is (`AdapterPool._group_rows`)."""
    return x.shape, ((0, x.shape[0]),)


def _own(host: HostAdapter) -> HostAdapter:
    """The adapter with its small arrays (bias, magnitudes, rows) copied, so that neither the host tier nor the
    column factors keep a `ProcessReader`'s mapping alive once A and B are cast away from it (DoRA)."""
    own = lambda parts: {k: tuple(np.array(x) for x in v) if isinstance(v, tuple) else np.array(v)
                         for k, v in parts.items()}
    return dataclasses.replace(host, bias=own(host.bias), magnitude=own(host.magnitude),
                               embed_rows=own(host.embed_rows), lm_head_rows=own(host.lm_head_rows))


class AdapterPool:
    """Adapter slots on the device.

    Attributes:
      weights: the stacked `LoRAWeights` the model reads ([L, ...] per module, rank `rank`; under tensor
        parallelism in the `tp` layout and split over its mesh).
      ranks: [L] int32 host copy of each slot's rank (0 when empty).
    """

    def __init__(self, config: ModelConfig, *, max_loras: int, max_lora_rank: int, dtype,
                 evict: Literal["lru", "refuse"] = "lru", tp=None, max_extra_vocab: int = 256,
                 max_seq_len: int | None = None, reader: ProcessReader | None = None,
                 read_timeout: float | None = None):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1")
        if evict not in ("lru", "refuse"):
            raise ValueError(f"evict must be 'lru' or 'refuse', got {evict!r}")
        if max_extra_vocab < 0:
            raise ValueError(f"max_extra_vocab must be >= 0, got {max_extra_vocab}")
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.rank = kernel_rank(max_lora_rank)  # storage rank: the kernels need a power of two >= 16
        self.evict = evict
        self.max_extra_vocab = max_extra_vocab
        self.max_seq_len = max_seq_len
        self.reader = reader  # reads adapter files in child processes; None: on the calling thread
        self.read_timeout = read_timeout  # seconds a child may take to read one adapter (None: no limit)
        self.dtype = dtype
        self.tp = tp  # a jlora.parallel.TensorParallel: weights in its layout, split over its mesh
        self.layout = config if tp is None else tp.layout
        # Stacks of the groups (and embedding, lm_head) no adapter targets are not held: q_proj + v_proj adapters
        # of an 8B model take 75 MB a slot at rank 64, every part 369 MB (`_allocate`).
        self.weights = self._placed(LoRAWeights.zeros(self.layout, max_loras, self.rank, dtype, targets=()))
        self.nbytes = 0  # what the slots' stacks hold on the device(s), all shards together (`_allocate`)
        # where one slot's A and B go (`stage`), whether or not the pool holds their stacks yet: the stacks'
        # shardings without the slot axis (never split)
        if tp is None:
            here = jnp.zeros((), dtype).sharding
            at = jax.tree.map(lambda _: here, jax.eval_shape(lambda: LoRAWeights.zeros(self.layout, 1, 1, dtype)))
        else:
            at = jax.tree.map(lambda spec: jax.sharding.NamedSharding(tp.mesh, jax.sharding.PartitionSpec(*spec[1:])),
                              tp.lora_specs())
        self._slot_shardings = (tuple((layer.a, layer.b) for layer in at.layers), (at.embed_a, at.embed_b),
                                (at.lm_head_a, at.lm_head_b))
        # where `stage` sends an adapter's bytes before splitting them: every device of the mesh, or (None) the
        # default device uncommitted, as the slots' stacks are, so a write leaves the step's inputs as they were
        # (a committed stack among uncommitted ones would compile the step again)
        self._whole = None if tp is None else tp.replicated()
        self.base: BaseWeights | None = None  # set by the model runner that owns the base weights
        self._step_cache = None  # (weights, features in use, step_weights)
        self._staging = threading.Lock()  # held by the `stage` copying
        # (the stacks' abstract values, a slot's values', the slots' rank) -> `_write_slot` compiled for them:
        # `stage` compiles an adapter's write on its thread, so the engine loop's `install` only runs it
        self._writes: dict[tuple, jax.stages.Compiled] = {}
        self.ranks = np.zeros(max_loras, np.int32)
        self.added = np.zeros(max_loras, np.int32)  # tokens each slot's adapter adds past the base vocabulary
        self._features: list[frozenset[str]] = [frozenset()] * max_loras  # the optional parts each slot uses
        self._slots: collections.OrderedDict[str, int] = collections.OrderedDict()  # name -> slot, LRU first
        # name -> (the registration generation installed under it, the state of the files it was read from)
        self._installed: dict[str, tuple[int, str]] = {}
        self.evictions = 0  # adapters evicted to make room, so far
        self._in_use: collections.Counter[str] = collections.Counter()

    def _placed(self, weights: LoRAWeights) -> LoRAWeights:
        return weights if self.tp is None else self.tp.shard_lora(weights)

    @property
    def step_weights(self) -> LoRAWeights:
        """The weights a step takes: the optional parts that no loaded adapter uses left out (None), so a step
        without them compiles and runs as if they did not exist. (The groups, embedding and lm_head that no
        adapter installed so far targeted are not held at all: no LoRA op for them.) Built once per change of
        the weights or the loaded adapters' features, not on every step."""
        used = frozenset().union(*(self._features[s] for s in self._slots.values()))
        if self._step_cache is None or self._step_cache[0] is not self.weights or self._step_cache[1] != used:
            self._step_cache = (self.weights, used, self._without_unused(self.weights, used))
        return self._step_cache[2]

    @staticmethod
    def _without_unused(w: LoRAWeights, used: frozenset[str]) -> LoRAWeights:
        """`w` without the optional parts ("scale", "shift", "rows", "rope") not in `used`."""
        lm_head = w.lm_head_a is not None
        return dataclasses.replace(
            w,
            layers=tuple(dataclasses.replace(layer, scale=layer.scale if "scale" in used else None,
                                             shift=layer.shift if "shift" in used else None) for layer in w.layers),
            lm_head_scale=w.lm_head_scale if lm_head and "scale" in used else None,
            lm_head_shift=w.lm_head_shift if lm_head and "shift" in used else None,
            rows=w.rows if "rows" in used else None,
            rope_factor=w.rope_factor if "rope" in used else None,
        )

    def vocab_size(self, slot: int) -> int:
        """The token ids a request of `slot` (-1: the base model) may hold: the base's plus its adapter's added."""
        return self.config.vocab_size + (int(self.added[slot]) if slot >= 0 else 0)

    @property
    def num_slots(self) -> int:
        return len(self.ranks)

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def peek(self, name: str) -> int | None:
        """The slot of a loaded adapter, or None, without marking it used: safe from threads other than the
        one that loads and steps (a dict lookup)."""
        return self._slots.get(name)

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

    def prepare(self, adapter_dir: str, roots: tuple[str, ...] = ()) -> PreparedAdapter:
        """Reads, validates and converts an adapter on the host: everything a load does but the copy to the device
        and the slot write. It reads only the pool's fixed settings and the base weights, so it may run on
        another thread while steps run; `stage` or `install` then takes the result. With `roots` (a runtime
        load's) its files must resolve inside them.

        Raises:
          AdapterError: the adapter is invalid.
        """
        request = ReadRequest(adapter_dir, self.config, self.max_lora_rank, self.rank, self.max_extra_vocab,
                              self.max_seq_len, jnp.dtype(self.dtype).name, roots)
        base = None if self.base is None else self.base.rows
        host = _own(request.read(base) if self.reader is None else self.reader.read(request, base, self.read_timeout))
        if (host.lm_head_rows or host.added) and self.tp is not None and self.tp.vocab_parallel:
            raise AdapterError(f"{adapter_dir}: lm_head rows that differ from the base model's (or added tokens) "
                               "are not supported with a vocab-parallel lm_head (tensor_parallel > 1)")
        scale, shift = self._affine(adapter_dir, host)  # in the checkpoint's column order
        if self.tp is not None:
            host = self.tp.permute_adapter(host)
            scale, shift = (None if x is None else self.tp.permute_columns(x) for x in (scale, shift))
        return PreparedAdapter(host.with_dtype(self.dtype), scale, shift)

    def stage(self, prepared: PreparedAdapter) -> PreparedAdapter:
        """`prepared` with its A and B copied to the device(s), placed as a slot holds them, once the copy is
        done (as it is when staged already), and its slot write compiled for the pool's stacks as they are. It
        reads only the pool's fixed layout and its stacks' shapes, so a loader thread may run it while steps run;
        `install` then only writes device memory (the copy is the bulk of an install: tens of megabytes per
        adapter), without compiling on the engine loop's thread. The host tier keeps the host copy; a staged copy
        lives until it is installed (or in the device cache)."""
        staged = prepared if prepared.staged else self._copied(prepared)
        self._compiled_write(*self._write_args(staged))
        return staged

    def write_compiled(self, prepared: PreparedAdapter) -> bool:
        """Whether `prepared`'s slot write is compiled for the pool's stacks as they are (`stage` compiles it;
        new stacks for a part no adapter needed before drop every compiled write)."""
        return self._write_key(*self._write_args(prepared)) in self._writes

    def _copied(self, prepared: PreparedAdapter) -> PreparedAdapter:
        """`prepared` with its A and B on the device(s) (`stage`)."""
        host = prepared.host
        leaves, tree = jax.tree.flatten((host.layers, host.embed, host.lm_head))
        if not leaves:
            return prepared
        _, embed_at, lm_head_at = self._slot_shardings
        places = jax.tree.leaves((tuple(self.placement(i, layer) for i, layer in enumerate(host.layers)),
                                  embed_at if host.embed else None, lm_head_at if host.lm_head else None))
        # One transfer of the adapter's bytes laid end to end, split on the device by one jitted call, and one
        # adapter's copy at a time: a transfer per array (128 for q_proj + v_proj over 32 layers) held the
        # engine loop's dispatch for up to 8 ms per step, one transfer by about 1 ms (docs/performance.md,
        # § Tenancy).
        # The host arrays hold only the targeted modules' slices (`HostAdapter.slices`: q_proj + v_proj leave out
        # q|k|v's k rows, 28 % of the bytes); `_unpacked` places them in the group's arrays, the rest zero.
        placed = (tuple({g: self._group_rows(host, i, g, a, b) for g, (a, b) in layer.items()}
                        for i, layer in enumerate(host.layers)),
                  None if host.embed is None else tuple(_whole(x) for x in host.embed),
                  None if host.lm_head is None else tuple(_whole(x) for x in host.lm_head))
        shapes, rows = zip(*tree.flatten_up_to(placed))
        bits = np.dtype(f"u{np.dtype(self.dtype).itemsize}")
        # (`prepare` leaves A and B in the slots' dtype: the cast copies nothing, but keeps the bytes' count right)
        flat = np.concatenate([np.ravel(np.asarray(x, self.dtype)).view(bits) for x in leaves])
        with self._staging:
            arrays = _unpacked(jax.device_put(flat, self._whole), shapes=shapes, rows=rows,
                               dtype=jnp.dtype(self.dtype), shardings=tuple(places))
            arrays = jax.block_until_ready(arrays)
        layers, embed, lm_head = jax.tree.unflatten(tree, arrays)
        return dataclasses.replace(prepared, host=dataclasses.replace(host, layers=layers, embed=embed,
                                                                      lm_head=lm_head, slices={}))

    def _group_rows(self, host: HostAdapter, layer: int, group: str, a, b) -> tuple[tuple, tuple]:
        """((shape, row ranges), each for A and B) of a layer's fused group as a slot holds it: the host arrays'
        rows go to these ranges, in order (`_unpacked`). Under tensor parallelism B is whole already."""
        kept = host.slices.get((layer, group))
        if kept is None:
            return _whole(a), _whole(b)
        outs = module_shapes(self.config)[group][1]
        rows_a, rows_b = module_rows(outs, b.shape[1], kept)
        return (((len(outs) * b.shape[1], a.shape[1]), rows_a),
                _whole(b) if self.tp is not None else ((sum(n for _, n in outs), b.shape[1]), rows_b))

    def placement(self, layer: int, groups, memory_kind: str | None = None) -> dict:
        """{group: (sharding of A, sharding of B)} for layer `layer`'s `groups` as a slot holds them (`stage`'s
        copies), in `memory_kind` if given (a study's "pinned_host")."""
        a_at, b_at = self._slot_shardings[0][layer]
        at = lambda s: s if memory_kind is None else s.with_memory_kind(memory_kind)  # noqa: E731
        return {g: (at(a_at[g]), at(b_at[g])) for g in groups}

    def install(self, name: str, prepared: PreparedAdapter, generation: int = 0) -> int:
        """Writes a prepared adapter (staged here unless `stage` did) into a free (or evicted) slot under `name`,
        recording the registration `generation` it came from; returns the slot.

        Raises:
          ValueError: `name` is not a valid adapter name or is already loaded.
          PoolFullError: no free slot and nothing evictable.
        """
        self._check_new_name(name)
        prepared = prepared if prepared.staged else self._copied(prepared)  # its write compiled below if need be
        host, scale, shift = prepared.host, prepared.scale, prepared.shift
        features = frozenset(f for f, on in [("scale", scale), ("shift", shift),
                                             ("rows", host.embed_rows or host.lm_head_rows),
                                             ("rope", host.rope_factor != 1.0)] if on)
        targets = frozenset(g for layer in host.layers for g in layer) | frozenset(
            part for part, parts in [("embed", host.embed), ("lm_head", host.lm_head)] if parts is not None)
        self._allocate(features, targets)  # first: a failure (the device's memory) evicts no adapter
        slot = self._free_slot(name)
        stacks, values = self._write_args(prepared)
        written = self._compiled_write(stacks, values)(stacks, np.int32(slot), values)
        self.weights = jax.tree.unflatten(jax.tree.structure(self.weights), written)
        self.ranks[slot] = host.rank
        self.added[slot] = host.added
        self._features[slot] = features
        self._slots[name] = slot
        self._installed[name] = generation, host.files
        return slot

    def _write_args(self, prepared: PreparedAdapter) -> tuple[list, list]:
        """(the stacks, the slot's values) of a write of `prepared` into the pool's stacks as they are."""
        stacks, tree = jax.tree.flatten(self.weights)
        return stacks, tree.flatten_up_to(self._slot_values(prepared.host, prepared.scale, prepared.shift))

    def _compiled_write(self, stacks: list, values: list) -> jax.stages.Compiled:
        """`_write_slot` compiled for these stacks and values (their shapes, dtypes, shardings and which parts
        are None), once: by `stage` on a loader thread, or by `install` when the stacks changed in between."""
        key = self._write_key(stacks, values)
        write = self._writes.get(key)
        if write is None:
            abstract = lambda avals: [None if a is None else jax.ShapeDtypeStruct(*a[:2], sharding=a[2])  # noqa: E731
                                      for a in avals]
            write = self._writes[key] = _write_slot.lower(
                abstract(key[0]), jax.ShapeDtypeStruct((), jnp.int32), abstract(key[1]), rank=self.rank).compile()
        return write

    def _write_key(self, stacks: list, values: list) -> tuple:
        placed = self.tp is not None
        return _avals(stacks, placed), _avals(values, placed), self.rank

    def generation(self, name: str) -> int | None:
        """The registration generation of the adapter installed under `name`, or None when none is."""
        installed = self._installed.get(name)
        return None if installed is None else installed[0]

    def prefix_id(self, name: str) -> str:
        """What a prompt prefix cached under the adapter installed as `name` depends on beside its tokens: its
        registration (the name loaded again is another adapter) and the state of the files it was read from
        (files rewritten under one registration, read again after an eviction, are other weights)."""
        generation, files = self._installed[name]
        return f"adapter-{generation}@{files}"

    def in_use(self, name: str) -> bool:
        """Whether running (or admitted) requests hold the adapter."""
        return self._in_use[name] > 0

    def _check_new_name(self, name: str) -> None:
        check_adapter_name(name)
        if name in self._slots:
            raise ValueError(f"adapter {name!r} is already loaded; unload it first")

    def _affine(self, adapter_dir: str, host: HostAdapter):
        """(scale, shift): per (layer, group) key the [N] column factors of DoRA and the columns added after
        them (LoRA bias; DoRA keeps the base layer's bias out of its rescaling), or None when none."""
        if not host.magnitude and not host.bias:
            return None, None
        if host.magnitude and self.base is None:
            raise AdapterError(f"{adapter_dir}: DoRA needs the base model's weights, which are not at hand")
        scale, shift = {}, dict(host.bias)
        for key, (magnitude, mask) in host.magnitude.items():
            layer, group = key
            w, base_bias = self.base.linear(layer, group)
            index = None if self.tp is None else self.tp.checkpoint_columns(group)
            if index is not None:  # the base's columns back in the checkpoint's order, as the host adapter's
                w, base_bias = w[:, index], None if base_bias is None else base_bias[index]
            if group == "lm_head":
                a, b, slices = host.lm_head[0], host.lm_head[1], (self.config.vocab_size,)
            else:
                outs = module_shapes(self.config)[group][1]
                a, b = host.group(layer, group, outs)
                slices = tuple(n for _, n in outs)
            factor = np.asarray(_dora_factor(w, a, b, magnitude, mask, slice_sizes=slices))
            scale[key] = factor
            if base_bias is not None or key in shift:
                lora_bias = shift.get(key, np.zeros_like(factor))
                kept = 0.0 if base_bias is None else (1 - factor) * np.asarray(base_bias, np.float32)
                shift[key] = factor * lora_bias + kept
        return scale or None, shift or None

    def _allocate(self, features: frozenset[str], targets: frozenset[str]) -> None:
        """Adds what an adapter needs that the pool does not hold yet, zero (or neutral) in every slot: the stacks
        of the groups, embedding and lm_head in `targets`, and the optional parts `features` names. One
        recompilation of the steps, when an adapter is the first to need them; what no adapter needs takes no
        memory."""
        w, num, widths = self.weights, self.num_slots, self._widths()
        const = lambda value, *shape, dtype=self.dtype: jnp.full(shape, value, dtype)
        v, h, e = self.layout.vocab_size, self.layout.hidden_size, self.max_extra_vocab
        held = frozenset(w.layers[0].a if w.layers else ()) | frozenset(
            part for part, x in [("embed", w.embed_a), ("lm_head", w.lm_head_a)] if x is not None)
        new = {f for f in ("scale", "shift") if f in features and getattr(w, f"lm_head_{f}") is None}
        if targets <= held and not new and ("rows" not in features or w.rows is not None) and (
                "rope" not in features or w.rope_factor is not None):
            return
        added = LoRAWeights.zeros(self.layout, num, self.rank, self.dtype, targets=targets - held)

        def columns(parts: dict | None, f: str, groups) -> dict | None:  # a column affine over `groups`
            if parts is None and f not in new:
                return None
            value = 1.0 if f == "scale" else 0.0
            return {g: parts[g] if parts and g in parts else const(value, num, widths[g], dtype=jnp.float32)
                    for g in groups}

        layers = []
        for layer, extra in zip(w.layers, added.layers):
            a, b = {**layer.a, **extra.a}, {**layer.b, **extra.b}
            layers.append(LayerLoRA(a, b, columns(layer.scale, "scale", a), columns(layer.shift, "shift", a)))
        self.weights = self._placed(dataclasses.replace(
            w, layers=tuple(layers),
            embed_a=added.embed_a if w.embed_a is None else w.embed_a,
            embed_b=added.embed_b if w.embed_b is None else w.embed_b,
            lm_head_a=added.lm_head_a if w.lm_head_a is None else w.lm_head_a,
            lm_head_b=added.lm_head_b if w.lm_head_b is None else w.lm_head_b,
            lm_head_scale=const(1.0, num, v, dtype=jnp.float32) if "scale" in new else w.lm_head_scale,
            lm_head_shift=const(0.0, num, v, dtype=jnp.float32) if "shift" in new else w.lm_head_shift,
            rows=(RowOverrides(const(-1, num, e, dtype=jnp.int32), const(0, num, e, h), const(-1, num, e, dtype=jnp.int32),
                               const(0, num, e, h)) if "rows" in features and w.rows is None else w.rows),
            rope_factor=const(1.0, num, dtype=jnp.float32) if "rope" in features and w.rope_factor is None
            else w.rope_factor))
        self.nbytes = sum(x.nbytes for x in jax.tree.leaves(self.weights))
        self._writes.clear()  # compiled for the stacks before

    def _widths(self) -> dict[str, int]:
        """Each fused group's output columns N, in the pool's layout."""
        return {g: sum(n for _, n in outs) for g, (_, outs) in module_shapes(self.layout).items()}

    def _slot_values(self, host: HostAdapter, scale, shift) -> LoRAWeights:
        """One slot's values of every part the pool holds: neutral values for the column affine and row parts the
        adapter lacks, None for the A and B it does not target (zeroed by the write)."""
        w, widths = self.weights, self._widths()
        v, h, e = self.layout.vocab_size, self.layout.hidden_size, self.max_extra_vocab

        def column(values, key, width, neutral):
            return np.full(width, neutral, np.float32) if values is None or key not in values else values[key]

        layers = tuple(
            LayerLoRA(a={g: layer[g][0] if g in layer else None for g in held.a},
                      b={g: layer[g][1] if g in layer else None for g in held.a},
                      scale=None if held.scale is None else {g: column(scale, (i, g), widths[g], 1.0)
                                                             for g in held.scale},
                      shift=None if held.shift is None else {g: column(shift, (i, g), widths[g], 0.0)
                                                             for g in held.shift})
            for i, (layer, held) in enumerate(zip(host.layers, w.layers)))

        def overrides(rows: dict[int, np.ndarray]):
            ids, values = np.full(e, -1, np.int32), np.zeros((e, h), np.float32)
            for j, (token, row) in enumerate(sorted(rows.items())):
                ids[j], values[j] = token, row
            return ids, values

        rows = None
        if w.rows is not None:
            rows = RowOverrides(*overrides(host.embed_rows), *overrides(host.lm_head_rows))
        embed, lm_head = host.embed or (None, None), host.lm_head or (None, None)  # None where held: zeroed
        return LoRAWeights(
            layers=layers, embed_a=embed[0] if w.embed_a is not None else None,
            embed_b=embed[1] if w.embed_b is not None else None,
            lm_head_a=lm_head[0] if w.lm_head_a is not None else None,
            lm_head_b=lm_head[1] if w.lm_head_b is not None else None,
            lm_head_scale=None if w.lm_head_scale is None else column(scale, (None, "lm_head"), v, 1.0),
            lm_head_shift=None if w.lm_head_shift is None else column(shift, (None, "lm_head"), v, 0.0),
            rows=rows, rope_factor=None if w.rope_factor is None else np.float32(host.rope_factor))

    def unload(self, name: str) -> None:
        """Frees the adapter's slot (its weights stay until overwritten; rank 0 masks them meanwhile)."""
        if name not in self._slots:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {self.names})")
        if self._in_use[name]:
            raise RuntimeError(f"adapter {name!r} is used by running requests")
        slot = self._slots.pop(name)
        del self._installed[name]
        self.ranks[slot], self.added[slot], self._features[slot] = 0, 0, frozenset()

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
                    self.evictions += 1
                    return slot
        raise PoolFullError(
            f"cannot load {name!r}: all {self.num_slots} slots hold adapters "
            f"({'all in use' if self.evict == 'lru' else 'eviction is off'}): {self.names}"
        )


