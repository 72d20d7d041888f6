"""`LoRABatchInfo`: the static-shape metadata every multi-LoRA op reads.

Adapters live in `L` device slots. Each token of a batch carries a slot id (`-1`: base model only). The
kernels want the tokens grouped by slot and cut into chunks ("segments") of at most `block_m` tokens of one
slot, so one program computes one segment against one slot's weights.

Every array here has a shape fixed by `(T, L, block_m)` alone, never by the mix of adapters in the batch, so
one compiled program serves every mix (JAX's counterpart of CUDA-graph capture in vLLM and SGLang).

How this differs from the peers:
- vLLM passes `token_indices_sorted_by_lora_ids`, `num_tokens_per_lora`, `lora_token_start_loc` and
  `active_lora_ids` and launches a grid of (max_loras + 1) x cdiv(T, BLOCK_M) programs, most of which exit
  early. We precompute the segment list instead, so the grid is min(T, cdiv(T, block_m) + L) programs at most.
- SGLang's chunked SGMV also uses a sorted permutation and fixed-size chunks, but builds them on the host;
  `build` here is pure jnp (argsort, cumsum, comparisons), so it runs inside the jitted step with no host
  round trip.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LoRABatchInfo", "num_segments", "token_slots_from_requests"]


def host_values(x: jax.Array) -> np.ndarray | None:
    """x's values as numpy, or None when x is traced. The value checks run on these: jnp on a concrete array
    that a jitted function closes over gives a tracer under the trace, so checks written in jnp failed there."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def num_segments(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound `S` on the segments of any batch of `num_tokens` tokens over `num_slots` slots.

    Slot `l` with `c_l` tokens needs `ceil(c_l / block_m)` segments, at most `c_l / block_m + 1` and at most
    `c_l`, and the counts sum to at most `T`, so `S = min(T, cdiv(T, block_m) + L)` always suffices (tokens of
    slot -1 get no segment). The Pallas kernels launch programs for all S, so the bound by T keeps a decode
    batch's grid from growing with the slots: at batch 32 over 128 slots, 32 segments instead of 130.
    """
    return min(num_tokens, -(-num_tokens // block_m) + num_slots)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "token_slot",
        "sorted_idx",
        "slot_counts",
        "seg_start",
        "seg_len",
        "seg_slot",
        "ranks",
        "scalings",
    ],
    meta_fields=["block_m"],
)
@dataclasses.dataclass(frozen=True)
class LoRABatchInfo:
    """Per-batch multi-LoRA metadata, a pytree of static-shape arrays (`T` tokens, `L` slots, `S` segments).

    Build it with `LoRABatchInfo.build` (token level) or `LoRABatchInfo.from_requests` (request level);
    both are jittable.
    """

    token_slot: jax.Array  # [T] int32: adapter slot of each token; -1 = no adapter (base model, padding)
    sorted_idx: jax.Array  # [T] int32: token indices grouped by slot in slot order (stable), slot -1 last
    slot_counts: jax.Array  # [L] int32: tokens per slot; sorted_idx[sum(counts[:l]):][:counts[l]] are slot l's
    seg_start: jax.Array  # [S] int32: first position in `sorted_idx` of each segment
    seg_len: jax.Array  # [S] int32: tokens in each segment, 1..block_m; 0 for unused (padding) segments
    seg_slot: jax.Array  # [S] int32: slot of each segment; -1 for unused segments
    ranks: jax.Array  # [L] int32: rank of the adapter in each slot (0 for an empty slot)
    scalings: jax.Array  # [L] float32: alpha / r (or alpha / sqrt(r) for rsLoRA) of each slot
    block_m: int  # static: maximum tokens per segment; the kernels' row tile

    @property
    def num_tokens(self) -> int:
        """`T`, the static token count."""
        return self.token_slot.shape[0]

    @property
    def num_slots(self) -> int:
        """`L`, the number of adapter slots."""
        return self.ranks.shape[0]

    @property
    def num_segments(self) -> int:
        """`S`, the static segment capacity."""
        return self.seg_start.shape[0]

    @staticmethod
    def build(
        token_slot: jax.Array, ranks: jax.Array, scalings: jax.Array, *, block_m: int = 16
    ) -> LoRABatchInfo:
        """Builds the metadata from per-token slot ids. Pure jnp: runs inside a jitted step.

        Args:
          token_slot: [T] int, slot of each token in [-1, L); -1 means no adapter. Concrete values outside
            [-1, L) raise ValueError; traced ones (inside jit, where nothing can be raised) count as -1.
          ranks: [L] int, rank of each slot's adapter (0 for an empty slot).
          scalings: [L] float, scaling of each slot's adapter.
          block_m: static, maximum tokens per segment (a power of two >= 16 for the Pallas kernels).

        Returns:
          The `LoRABatchInfo`; its shapes depend only on (T, L, block_m).
        """
        if not isinstance(block_m, int) or block_m < 1:
            raise ValueError(f"block_m must be a positive int, got {block_m!r}")
        token_slot = jnp.asarray(token_slot, jnp.int32)
        ranks = jnp.asarray(ranks, jnp.int32)
        scalings = jnp.asarray(scalings, jnp.float32)
        if token_slot.ndim != 1 or ranks.ndim != 1 or scalings.shape != ranks.shape:
            raise ValueError(
                "expected token_slot [T], ranks [L], scalings [L]; got shapes "
                f"{token_slot.shape}, {ranks.shape}, {scalings.shape}"
            )
        if ranks.shape[0] == 0:
            raise ValueError("need at least one adapter slot (ranks has shape [0])")
        if token_slot.shape[0] == 0:
            raise ValueError("need at least one token (token_slot has shape [0])")
        if (slots := host_values(token_slot)) is not None:
            bad = (slots < -1) | (slots >= ranks.shape[0])
            if bad.any():
                raise ValueError(
                    f"token_slot values must be in [-1, {ranks.shape[0]}) for {ranks.shape[0]} slots; got "
                    f"{sorted(set(slots[bad].tolist()))[:8]}"
                )
        return _build(token_slot, ranks, scalings, block_m=block_m)

    @staticmethod
    def from_requests(
        request_slot: jax.Array,
        request_len: jax.Array,
        ranks: jax.Array,
        scalings: jax.Array,
        *,
        num_tokens: int,
        block_m: int = 16,
    ) -> LoRABatchInfo:
        """Builds the metadata for requests laid out back to back in a padded token buffer.

        Args:
          request_slot: [B] int, slot of each request (-1: no adapter).
          request_len: [B] int, tokens of each request (0 for an unused request row).
          ranks, scalings: [L], as in `build`.
          num_tokens: static `T`, the padded token count; tokens past sum(request_len) get slot -1.
          block_m: static, as in `build`.
        """
        token_slot = token_slots_from_requests(request_slot, request_len, num_tokens=num_tokens)
        return LoRABatchInfo.build(token_slot, ranks, scalings, block_m=block_m)


def bin_index(edges: jax.Array, values: jax.Array) -> jax.Array:
    """[N] int32: for each of `values` [N], how many of the ascending `edges` [E] are <= it (searchsorted, side
    right). Every pair is compared at once, in one fused kernel of N·E comparisons (here at most T·(T/block_m + L)
    and T·B): jnp.searchsorted's default binary search is an XLA while loop, which on the GPU stands between two
    of the step's CUDA graphs, the host reading its predicate back at each of its log2(E) iterations
    (docs/performance.md § The model step, *The LoRA metadata without a while loop*)."""
    return jnp.searchsorted(edges, values, side="right", method="compare_all").astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_m",))
def _build(token_slot: jax.Array, ranks: jax.Array, scalings: jax.Array, *, block_m: int) -> LoRABatchInfo:
    """The jitted body of `LoRABatchInfo.build` (arguments already checked)."""
    num_tokens, num_slots = token_slot.shape[0], ranks.shape[0]
    num_segs = num_segments(num_tokens, num_slots, block_m)

    # Group tokens by slot; slot -1 (and any out-of-range id) sorts last under key L. Stable, so tokens
    # keep their order within a slot.
    key = jnp.where((token_slot < 0) | (token_slot >= num_slots), num_slots, token_slot)
    sorted_idx = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    slot_begin = jnp.cumsum(counts) - counts  # [L] first sorted position of each slot

    # Segment s belongs to the slot whose cumulative chunk range holds s.
    chunks = (counts + block_m - 1) // block_m  # [L]
    chunk_end = jnp.cumsum(chunks)  # [L] exclusive end of each slot's chunk range
    seg = jnp.arange(num_segs, dtype=jnp.int32)
    slot = bin_index(chunk_end, seg)  # [S], == L when unused
    used = slot < num_slots
    slot_c = jnp.minimum(slot, num_slots - 1)
    offset = (seg - (chunk_end[slot_c] - chunks[slot_c])) * block_m  # first token of s within its slot
    return LoRABatchInfo(
        token_slot=jnp.where(key == num_slots, -1, token_slot),
        sorted_idx=sorted_idx,
        slot_counts=counts,
        seg_start=jnp.where(used, slot_begin[slot_c] + offset, 0).astype(jnp.int32),
        seg_len=jnp.where(used, jnp.minimum(block_m, counts[slot_c] - offset), 0).astype(jnp.int32),
        seg_slot=jnp.where(used, slot, -1).astype(jnp.int32),
        ranks=ranks,
        scalings=scalings,
        block_m=block_m,
    )


def token_slots_from_requests(request_slot: jax.Array, request_len: jax.Array, *, num_tokens: int) -> jax.Array:
    """[B] slots and [B] lengths -> [num_tokens] int32 per-token slots, padding with -1.

    Request b owns tokens [sum(len[:b]), sum(len[:b+1])). Jittable: shapes depend on `num_tokens` only. Concrete
    lengths below 0 raise ValueError; traced ones (inside jit, where nothing can be raised) must not be.
    """
    request_slot = jnp.asarray(request_slot, jnp.int32)
    request_len = jnp.asarray(request_len, jnp.int32)
    if request_slot.shape != request_len.shape or request_slot.ndim != 1:
        raise ValueError(
            f"request_slot and request_len must both be [B]; got {request_slot.shape} and {request_len.shape}"
        )
    if (lengths := host_values(request_len)) is not None and (lengths < 0).any():
        raise ValueError(f"request_len must be >= 0; got {sorted(set(lengths[lengths < 0].tolist()))[:8]}")
    return _token_slots(request_slot, request_len, num_tokens=num_tokens)


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def _token_slots(request_slot: jax.Array, request_len: jax.Array, *, num_tokens: int) -> jax.Array:
    """The jitted body of `token_slots_from_requests` (arguments already checked)."""
    end = jnp.cumsum(request_len)  # [B]
    pos = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = bin_index(end, pos)  # [T] request of each token; B past the end
    valid = owner < request_slot.shape[0]
    return jnp.where(valid, request_slot[jnp.minimum(owner, request_slot.shape[0] - 1)], -1).astype(jnp.int32)
