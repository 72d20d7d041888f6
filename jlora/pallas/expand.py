"""Segmented multi-LoRA expand: out[t, slice_i] = base[t, slice_i] + s_i[t] @ B[slot(t), slice_i, :rank]ᵀ.

One launch covers every slice (q 4096 | k 1024 | v 1024): the grid's column axis enumerates the blocks of
all slices, and each program finds its slice from static block offsets. B is read only up to each slot's
rank, in 16-column chunks (masked loads fetch nothing). The sum is written into `base`'s buffer
(`input_output_aliases`), so rows of slot -1 tokens are never touched and there is no extra pass over [T, N].
A slice whose width is no multiple of the column block ends with a block that overlaps the one before; such
calls read `base` and write a copy of it (one extra pass), so overlapping blocks write identical values.
A program may take a part of its segment's rows (`block_rows`), for more and smaller programs than the
shrink's row tile gives. With `ExpandConfig.delta` (decode steps that defer the add) the kernel reads no base
and writes each token's delta alone; XLA then adds it, so the kernel need not wait for the base's GEMM.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlora.batch_info import LoRABatchInfo
from jlora.pallas.common import dot_precision, segment_meta
from jlora.pallas.config import ExpandConfig, expand_config, pow2_divisor
from jlora.reference import add_deltas, own_rows

__all__ = ["expand"]


def _expand_kernel(
    idx_ref,  # [T] int32 token indices sorted by slot
    seg_start_ref,  # [S] int32
    seg_len_ref,  # [S] int32
    seg_slot_ref,  # [S] int32
    ranks_ref,  # [L] int32
    s_ref,  # [P, T, num_slices * R] shrink output as P partial sums (P = 1 for a finished s)
    b_ref,  # [L, N, R]
    *refs,  # scale [L, N] with `has_scale`, shift [L, N] with `has_shift`; base [T, N] with `has_base` (the
    #         same buffer as o_ref; with `tail` read only, and then a copy of base aliased to o_ref); o_ref [T, N]
    has_base: bool,
    has_scale: bool,
    has_shift: bool,
    slice_start: tuple[int, ...],  # first column of each slice
    slice_end: tuple[int, ...],  # end column of each slice
    tail: bool,  # some slice's width is no multiple of block_n: its last block ends at the slice's end
    group_start: tuple[int, ...],  # first column group of each slice
    num_groups: int,  # column groups of all slices
    rank: int,
    parts: int,  # programs per segment along the rows: block_m // block_rows
    block_rows: int,
    block_n: int,
    group: int,
    full_rank_branch: bool,
    segments_first: bool,
    precision,
    base_precision,
):
    scale_ref = refs[0] if has_scale else None
    shift_ref = refs[int(has_scale)] if has_shift else None
    base_ref = refs[int(has_scale) + int(has_shift)] if has_base else None
    o_ref = refs[-1]
    # Program (p, g) covers rows h·block_rows ... (h + 1)·block_rows - 1 of segment `seg` (p = seg·parts + h)
    # and `group` consecutive column blocks of one slice: the rows, s and rank mask are loaded once, and the
    # loop over blocks lets the compiler pipeline loads.
    if segments_first:  # one grid axis, column groups fastest: the used segments' programs launch first
        p, g = pl.program_id(0) // num_groups, pl.program_id(0) % num_groups
    else:  # CUDA launches the first axis fastest: used and unused segments' programs interleave
        p, g = pl.program_id(0), pl.program_id(1)
    seg, h = p // parts, p % parts
    # The metadata is read ahead of the branch, so its loads issue together (see `segment_meta`).
    seg_len, slot, rows = segment_meta(idx_ref, seg_start_ref, seg_len_ref, seg_slot_ref, seg, block_rows,
                                       h * block_rows)  # rows: [BR]
    slot_rank = ranks_ref[slot]

    @pl.when(seg_len > h * block_rows)
    def _():
        # The slice of group g: the last whose first group is <= g (static offsets). Integer steps
        # (0 or 1) instead of booleans: the Triton lowering mistypes bool -> int converts.
        sl, col0, end, g0 = 0, slice_start[0], slice_end[0], group_start[0]
        for i in range(1, len(slice_start)):
            step = jnp.clip(g - group_start[i] + 1, 0, 1)  # 1 once g reaches slice i
            sl += step
            col0 += step * (slice_start[i] - slice_start[i - 1])
            end += step * (slice_end[i] - slice_end[i - 1])
            g0 += step * (group_start[i] - group_start[i - 1])
        first_col = col0 + (g - g0) * (group * block_n)
        r = pl.ds(sl * rank if len(slice_start) == 1 else pl.multiple_of(sl * rank, rank), rank)

        s = s_ref[0, rows, r]  # [BM, R]
        for p in range(1, s_ref.shape[0]):  # split-K partials of the shrink
            s += s_ref[p, rows, r]
        col = jnp.arange(rank)[None, :]  # [1, R]
        s = jnp.where(col < slot_rank, s, 0).astype(b_ref.dtype)  # columns past the rank contribute nothing
        # B is read in 16-column chunks up to the rank: a mask constant over 16 contiguous columns keeps
        # the loads vectorized (a per-column mask makes them scalar), and chunks past the rank are not read.
        # The masked loads are slower than plain ones, so with `full_rank_branch` slots at the full rank R
        # take a fast path: B read unmasked, and the base added through a `dot` with the identity, which
        # makes Triton stream the base tiles into shared memory ahead of use as it does a dot's operands
        # (exact: one 1 per row, f32 accumulation). Slots below the full rank keep the plain add.
        # So a rank that is no multiple of 16 reads its last chunk whole: B's columns there past the rank
        # multiply zeros of s and must be finite (the pool stores zeros); selecting them out cost 7 %.
        # Figures: docs/kernels.md, "The full-rank fast path".
        in_rank = col // 16 * 16 < slot_rank  # [1, R]
        eye = (jnp.arange(block_rows)[:, None] == jnp.arange(block_rows)[None, :]).astype(o_ref.dtype)

        def columns(full_rank: bool):
            def block(j, carry):
                if tail:  # a block past the slice's end moves back to end there
                    cols = pl.ds(jnp.minimum(first_col + j * block_n, end - block_n), block_n)
                else:
                    cols = pl.ds(pl.multiple_of(first_col + j * block_n, block_n), block_n)
                base = base_ref[rows, cols] if has_base else None  # [BR, BN]
                if full_rank:
                    b = b_ref[slot, cols, :]  # [BN, R]
                    out = pltriton.dot(eye, base, precision=base_precision) if has_base else None  # = base
                else:
                    b = pltriton.load(b_ref.at[slot, cols, :], mask=in_rank, other=0)
                    out = base.astype(jnp.float32) if has_base else None
                delta = pltriton.dot(s, b, trans_b=True, precision=precision)  # [BR, BN] f32
                out = delta if out is None else out + delta
                if has_scale:  # the slot's column affine (DoRA's magnitude over the column norm)
                    out *= scale_ref[slot, cols].astype(jnp.float32)[None, :]
                if has_shift:  # (a LoRA bias)
                    out += shift_ref[slot, cols].astype(jnp.float32)[None, :]
                o_ref[rows, cols] = out.astype(o_ref.dtype)
                return carry

            jax.lax.fori_loop(0, group, block, 0)

        if full_rank_branch:
            pl.when(slot_rank >= rank)(lambda: columns(True))
            pl.when(slot_rank < rank)(lambda: columns(False))
        else:
            columns(False)


def expand(
    s: jax.Array,
    b: jax.Array,
    info: LoRABatchInfo,
    base: jax.Array,
    *,
    slice_sizes: tuple[int, ...],
    config: ExpandConfig | None = None,
    scale: jax.Array | None = None,
    shift: jax.Array | None = None,
    defer_add: bool = False,
) -> jax.Array:
    """[T, N] `base` plus the expand of `s`, computed in place in base's buffer, or with `config.delta` as a
    delta of its own that XLA adds.

    Args:
      s: [P, T, S·R] shrink output as P partial sums to add (P = 1 for a finished s).
      b: [L, N, R] with R a power of two >= 16.
      info: the batch's metadata.
      base: [T, N].
      slice_sizes: static widths of the S slices; each >= config.block_n.
      config: tiles; default from `expand_config`.
      scale, shift: optional [L, N] per-slot column affine: a token's row becomes
        `scale[slot] * (base + delta) + shift[slot]`. Without them the kernel has no such operand.
      defer_add: the caller lets the default config write the delta alone (`jlora.lora_linear`).
    """
    num_tokens, rank = base.shape[0], b.shape[2]
    config = config or expand_config(num_tokens, slice_sizes, info.block_m, rank, defer_add)
    if min(slice_sizes) < config.block_n:
        raise ValueError(f"{config} does not tile slice_sizes={slice_sizes}")
    tail = any(n % config.block_n for n in slice_sizes)
    block_rows = config.block_rows or info.block_m
    if block_rows < 16 or info.block_m % block_rows or block_rows & (block_rows - 1):
        raise ValueError(f"{config}: block_rows must be a power of two >= 16 dividing block_m={info.block_m}")
    blocks = [-(-n // config.block_n) for n in slice_sizes]
    group = pow2_divisor(math.gcd(*blocks), config.group)  # column blocks per program, within one slice
    bounds = tuple(itertools.accumulate(slice_sizes, initial=0))
    group_start = tuple(itertools.accumulate((n // group for n in blocks), initial=0))
    delta = config.delta
    affine = () if delta else tuple(x for x in (scale, shift) if x is not None)
    kernel = functools.partial(
        _expand_kernel,
        has_base=not delta,
        has_scale=scale is not None and not delta,
        has_shift=shift is not None and not delta,
        slice_start=bounds[:-1],
        slice_end=bounds[1:],
        tail=tail,
        group_start=group_start[:-1],
        num_groups=group_start[-1],
        rank=rank,
        parts=info.block_m // block_rows,
        block_rows=block_rows,
        block_n=config.block_n,
        group=group,
        full_rank_branch=config.full_rank_branch,
        segments_first=config.segments_first,
        precision=dot_precision(b.dtype),
        base_precision=dot_precision(base.dtype),
    )
    grid = (info.num_segments * (info.block_m // block_rows), group_start[-1])
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype),
        grid=(grid[0] * grid[1],) if config.segments_first else grid,
        input_output_aliases={} if delta else {7 + len(affine) + int(tail): 0},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_expand_{len(slice_sizes)}x{rank}x{base.shape[1]}",  # shapes: readable profiles
    )(info.sorted_idx, info.seg_start, info.seg_len, info.seg_slot, info.ranks, s, b, *affine,
      *(() if delta else (base,) * (1 + int(tail))))
    if not delta:
        return out
    # The kernel wrote the tokens' deltas only (slot -1 rows are unwritten): selected, rounded to base's dtype
    # as PEFT rounds its LoRA output, and added by XLA, which fuses the add into the kernel that reads the sum.
    return add_deltas(base, [own_rows(out, info)], info, scale, shift)
