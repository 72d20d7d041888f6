"""Plain-jnp backends: `reference` (contractions over slots), `ragged` (`jax.lax.ragged_dot`) and `gather`.

All compute exactly the semantics of `jlora.ops` and are what a JAX user would write without custom
kernels. The reference contracts every token with every slot's weights and keeps each token's own slot's
part, instead of gathering one weight matrix per token: a materialized gather would be [T, R, K] (13 GB for
T=8192, R=192, K=4096 in bf16), while the contraction reads each slot's weights once and costs only
arithmetic. Every backend selects (`jnp.where`) rather than multiplies by zero, so a slot's weights reach
only its own tokens and only up to its rank, whatever values (NaN, inf) the rest holds.
`gather` is Punica's BGMV for few tokens: every token reads its own slot's weights, written as
an elementwise product and a sum, so XLA fuses the gather into the reduction and nothing [T, R, K] is
materialized; it reads T copies of the weights (from L2 where tokens share a slot), so it suits decode.
Arguments arrive checked by `jlora.ops`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlora.batch_info import LoRABatchInfo
from jlora.precision import dot_precision

__all__ = ["add_deltas", "own_rows", "column_scale", "scale_rows", "shrink_reference", "expand_reference",
           "shrink_ragged", "expand_ragged", "shrink_gather", "expand_gather"]

_F32 = jnp.float32


def column_scale(info: LoRABatchInfo, rank: int, num_slices: int, *, scaled: bool) -> jax.Array:
    """[T, num_slices * rank] f32: per token and LoRA column, its slot's scaling (or 1 when not `scaled`)
    where the column index within its slice is below the slot's rank, else 0; rows of slot -1 are 0."""
    slot = jnp.maximum(info.token_slot, 0)
    keep = (info.token_slot >= 0)[:, None] & (jnp.arange(rank)[None, :] < info.ranks[slot][:, None])
    factor = info.scalings[slot][:, None] if scaled else jnp.ones((), _F32)
    return jnp.tile(jnp.where(keep, factor, 0.0), (1, num_slices))


def _own_slot(info: LoRABatchInfo) -> jax.Array:
    """[T, L] bool: True at each token's slot (none for slot -1)."""
    return info.token_slot[:, None] == jnp.arange(info.num_slots)[None, :]


def _in_rank(ranks: jax.Array, rank: int) -> jax.Array:
    """[L, R] bool: the columns (A's rows, B's columns) below each slot's rank."""
    return jnp.arange(rank)[None, :] < ranks[:, None]


def _a_in_rank(a: jax.Array, info: LoRABatchInfo, num_slices: int) -> jax.Array:
    """A [L, S·R, K] with each slot's rows past its rank selected out (0, whatever they held)."""
    in_rank = jnp.tile(_in_rank(info.ranks, a.shape[1] // num_slices), (1, num_slices))
    return jnp.where(in_rank[:, :, None], a, 0)


def scale_rows(y: jax.Array, info: LoRABatchInfo, rank: int, num_slices: int) -> jax.Array:
    """y [T, S·R] f32 times each token's slot scaling, columns past its rank and slot -1 rows selected to 0."""
    scale = column_scale(info, rank, num_slices, scaled=True)
    return jnp.where(scale != 0, y * scale, 0.0)


def own_rows(delta: jax.Array, info: LoRABatchInfo) -> jax.Array:
    """delta [T, N] with the rows of slot -1 tokens set to -0.0, which added leaves every base value as it is
    (+0.0 would turn a base -0.0 into +0.0), and keeps out of them the NaN of slot 0's weights they read."""
    return jnp.where((info.token_slot >= 0)[:, None], delta, -0.0)


def add_deltas(base: jax.Array, deltas: list[jax.Array], info: LoRABatchInfo, scale: jax.Array | None = None,
               shift: jax.Array | None = None) -> jax.Array:
    """base [T, N] plus the slices' deltas, in f32, then each token's slot's column affine
    `scale[slot] * (base + delta) + shift[slot]` ([L, N] each, None: 1 / 0); rows of slot -1 keep base."""
    out = base.astype(_F32) + jnp.concatenate(deltas, axis=1)
    if scale is None and shift is None:
        return out.astype(base.dtype)
    slot = jnp.maximum(info.token_slot, 0)
    if scale is not None:
        out = out * scale[slot].astype(_F32)
    if shift is not None:
        out = out + shift[slot].astype(_F32)
    return jnp.where((info.token_slot >= 0)[:, None], out.astype(base.dtype), base)  # slot -1 read slot 0's row


def _slice_bounds(slice_sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """[(start, stop)] of each output slice in the fused N dimension."""
    bounds, start = [], 0
    for n in slice_sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def shrink_reference(x: jax.Array, a: jax.Array, info: LoRABatchInfo, *, num_slices: int) -> jax.Array:
    """x [T, K] @ A[slot]ᵀ -> [T, S·R] in x.dtype: every slot's product [T, L, S·R], each token's own selected."""
    a = _a_in_rank(a, info, num_slices)
    y = jnp.einsum("tk,lrk->tlr", x, a, preferred_element_type=_F32, precision=dot_precision(x.dtype))
    y = jnp.sum(jnp.where(_own_slot(info)[:, :, None], y, 0.0), axis=1)
    return scale_rows(y, info, a.shape[1] // num_slices, num_slices).astype(x.dtype)


def expand_reference(
    s: jax.Array, b: jax.Array, info: LoRABatchInfo, base: jax.Array, *, slice_sizes: tuple[int, ...],
    scale: jax.Array | None = None, shift: jax.Array | None = None,
) -> jax.Array:
    """base [T, N] + per slice s_i [T, R] @ B[slot, slice_i]ᵀ (then `add_deltas`' column affine), through a
    contraction over slots of s placed in each token's own slot ([T, L, R], zeros elsewhere). That contraction
    multiplies the zeros by every slot's B, so B's non-finite values and its columns past each rank are read as
    0 here: they reach no token (other backends pass a slot's NaN or inf on to its own tokens; the adapter pool
    refuses such weights)."""
    rank = b.shape[2]
    s = jnp.where(column_scale(info, rank, len(slice_sizes), scaled=False) != 0, s.astype(_F32), 0.0)
    b = jnp.where(_in_rank(info.ranks, rank)[:, None, :] & jnp.isfinite(b), b, 0)
    own = _own_slot(info)[:, :, None]  # [T, L, 1]
    deltas = []
    for i, (start, stop) in enumerate(_slice_bounds(slice_sizes)):
        s_slot = jnp.where(own, s[:, None, i * rank : (i + 1) * rank], 0.0)  # [T, L, R]
        deltas.append(own_rows(jnp.einsum("tlr,lnr->tn", s_slot, b[:, start:stop, :], preferred_element_type=_F32,
                                          precision=dot_precision(_F32)), info))
    return add_deltas(base, deltas, info, scale, shift)


def _ragged(lhs_sorted: jax.Array, rhs: jax.Array, info: LoRABatchInfo) -> jax.Array:
    """Sorted rows [T, K] times per-slot rhs [L, K, N] -> [T, N] f32 in token order, slot -1 rows 0.

    Rows past sum(slot_counts) belong to no group; they are zeroed by the final mask. Slots without tokens
    are zeroed first: XLA's CPU ragged_dot multiplies every group's weights by masked (zero) rows, so their
    NaN or inf would reach every token.
    """
    rhs = jnp.where((info.slot_counts > 0)[:, None, None], rhs, 0)
    y = jax.lax.ragged_dot(lhs_sorted, rhs, info.slot_counts, preferred_element_type=_F32,
                           precision=dot_precision(lhs_sorted.dtype))
    y = jnp.zeros_like(y).at[info.sorted_idx].set(y)
    return jnp.where((info.token_slot >= 0)[:, None], y, 0.0)


def shrink_ragged(x: jax.Array, a: jax.Array, info: LoRABatchInfo, *, num_slices: int) -> jax.Array:
    """`shrink_reference` through `jax.lax.ragged_dot` on tokens sorted by slot."""
    y = _ragged(x[info.sorted_idx], jnp.swapaxes(_a_in_rank(a, info, num_slices), 1, 2), info)
    return scale_rows(y, info, a.shape[1] // num_slices, num_slices).astype(x.dtype)


def expand_ragged(
    s: jax.Array, b: jax.Array, info: LoRABatchInfo, base: jax.Array, *, slice_sizes: tuple[int, ...],
    scale: jax.Array | None = None, shift: jax.Array | None = None,
) -> jax.Array:
    """`expand_reference` through one `jax.lax.ragged_dot` per slice on tokens sorted by slot."""
    rank = b.shape[2]
    s = jnp.where(column_scale(info, rank, len(slice_sizes), scaled=False) != 0, s, 0)
    s_sorted = s[info.sorted_idx]
    b = jnp.where(_in_rank(info.ranks, rank)[:, None, :], b, 0)  # columns past each slot's rank: 0
    deltas = [
        own_rows(_ragged(s_sorted[:, i * rank : (i + 1) * rank], jnp.swapaxes(b[:, start:stop, :], 1, 2), info), info)
        for i, (start, stop) in enumerate(_slice_bounds(slice_sizes))
    ]
    return add_deltas(base, deltas, info, scale, shift)


def shrink_gather(x: jax.Array, a: jax.Array, info: LoRABatchInfo, *, num_slices: int) -> jax.Array:
    """`shrink_reference` as a batched gather-matvec: row t of [T, S·R] is x[t] @ A[slot(t)]ᵀ."""
    slot = jnp.maximum(info.token_slot, 0)
    y = jnp.sum(x.astype(_F32)[:, None, :] * a[slot].astype(_F32), axis=-1)  # [T, S·R]; a[slot] stays fused
    return scale_rows(y, info, a.shape[1] // num_slices, num_slices).astype(x.dtype)


def expand_gather(
    s: jax.Array, b: jax.Array, info: LoRABatchInfo, base: jax.Array, *, slice_sizes: tuple[int, ...],
    scale: jax.Array | None = None, shift: jax.Array | None = None,
) -> jax.Array:
    """`expand_reference` as a batched gather-matvec: row t gets s_i[t] @ B[slot(t), slice_i]ᵀ per slice.

    Each slice's delta is rounded to base.dtype before the add, as PEFT adds its LoRA output to the base
    layer's; in the model XLA fuses the add into the delta's consumer, so the delta crosses memory in
    base.dtype instead of f32. A slice's rows are one gather, B[slot, slice_i], and the masks act on s and on
    each delta's rows, not on the products: slicing B first made XLA copy each slice of the stack, and a mask
    on the products sat inside the reductions, which XLA merged across calls into slow multi-output fusions
    (docs/kernels.md, "The gather backend's form"). The row mask keeps NaN in an unused slot out of slot -1
    rows.
    """
    rank = b.shape[2]
    keep = column_scale(info, rank, len(slice_sizes), scaled=False) != 0  # [T, S·R]
    s = jnp.where(keep, s.astype(_F32), 0.0)
    slot = jnp.maximum(info.token_slot, 0)
    in_rank = keep[:, None, :rank]  # [T, 1, R]: B's columns past the slot's rank are selected out
    deltas = []
    for i, (start, stop) in enumerate(_slice_bounds(slice_sizes)):  # one fused reduction per slice
        b_rows = jnp.where(in_rank, b[slot, start:stop, :].astype(_F32), 0.0)  # [T, n_i, R], fused into the sum
        delta = jnp.sum(s[:, None, i * rank : (i + 1) * rank] * b_rows, axis=-1)
        deltas.append(own_rows(delta, info).astype(base.dtype))  # slot -1 rows read slot 0's B
    return add_deltas(base, deltas, info, scale, shift)
