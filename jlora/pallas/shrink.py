"""Segmented multi-LoRA shrink: y[t] = scaling · x[t] @ A[slot(t)]ᵀ, for 1..3 slices sharing x.

Each program takes one segment (<= block_m tokens of one slot, gathered through `sorted_idx`) and one
K-split, and writes f32 partial sums [k_splits, T, S·R]. The consumer adds the splits: `jlora.pallas.shrink`
for the public op, or the expand kernel directly inside `lora_linear`, so split-K costs no launch there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlora.batch_info import LoRABatchInfo
from jlora.pallas.common import dot_precision, segment_meta
from jlora.pallas.config import ShrinkConfig, shrink_config

__all__ = ["default_config", "shrink_partials"]


def _shrink_kernel(
    idx_ref,  # [T] int32 token indices sorted by slot
    seg_start_ref,  # [S] int32
    seg_len_ref,  # [S] int32
    seg_slot_ref,  # [S] int32
    ranks_ref,  # [L] int32
    scalings_ref,  # [L] f32
    x_ref,  # [T, K]
    a_ref,  # [L, num_slices * R, K]
    *refs,  # the output, after the buffer aliased to it when there is one; keyword-only parameters follow
    slices_per_program: int,
    rank: int,
    block_m: int,
    block_k: int,
    k_per_split: int,
    k_tail: int,
    precision,
):
    # Program (seg, split, part): segment `seg`, K range `split`, and slices part·spp .. part·spp + spp - 1
    # (spp = slices_per_program: all slices share one read of x, or one slice each for more programs).
    o_ref = refs[-1]  # [k_splits, T, num_slices * R] partial sums, f32 or the aliased buffer's dtype
    seg, split, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # The metadata is read ahead of the branch, so its loads issue together (see `segment_meta`).
    seg_len, slot, rows = segment_meta(idx_ref, seg_start_ref, seg_len_ref, seg_slot_ref, seg, block_m)
    slot_rank, scale = ranks_ref[slot], scalings_ref[slot]

    @pl.when(seg_len > 0)
    def _():
        in_rank = (jnp.arange(rank) < slot_rank)[:, None]  # [R, 1]: rows of A past the rank unread
        k_base = split * k_per_split
        # A rows (and output columns) of each slice this program computes.
        cols = [pl.ds(pl.multiple_of((part * slices_per_program + i) * rank, rank), rank)
                for i in range(slices_per_program)]

        def step(j, accs):
            k = pl.ds(pl.multiple_of(k_base + j * block_k, block_k), block_k)
            xb = x_ref[rows, k]  # [BM, BK]
            return tuple(
                acc
                + pltriton.dot(
                    xb,
                    pltriton.load(a_ref.at[slot, c, k], mask=in_rank, other=0),  # [R, BK]
                    trans_b=True,
                    precision=precision,
                )
                for c, acc in zip(cols, accs)
            )

        zeros = tuple(jnp.zeros((block_m, rank), jnp.float32) for _ in cols)
        accs = jax.lax.fori_loop(0, k_per_split // block_k, step, zeros)
        if k_tail:  # K's last k_tail columns, past the splits' full blocks, go to the last split: a block
            # ending at K (in bounds, overlapping the one before), with A's columns before the tail masked out
            k_dim = x_ref.shape[1]
            k = pl.ds(k_dim - block_k, block_k)
            tail = (jnp.arange(block_k) >= block_k - k_tail)[None, :] & (split == pl.num_programs(1) - 1)
            xb = x_ref[rows, k]
            accs = tuple(acc + pltriton.dot(xb, pltriton.load(a_ref.at[slot, c, k], mask=in_rank & tail, other=0),
                                            trans_b=True, precision=precision)
                         for c, acc in zip(cols, accs))
        for c, acc in zip(cols, accs):
            o_ref[split, rows, c] = (acc * scale).astype(o_ref.dtype)


def default_config(x: jax.Array, a: jax.Array, info: LoRABatchInfo, num_slices: int) -> ShrinkConfig:
    """`shrink_config` for these operands."""
    return shrink_config(x.shape[0], x.shape[1], a.shape[1], info.block_m, x.dtype.itemsize, num_slices)


def shrink_partials(
    x: jax.Array,
    a: jax.Array,
    info: LoRABatchInfo,
    *,
    num_slices: int,
    config: ShrinkConfig | None = None,
    out: jax.Array | None = None,
) -> jax.Array:
    """[P, T, S·R] f32 split-K partial sums of the shrink; rows of slot -1 tokens are left unwritten.

    Args:
      x: [T, K]; a: [L, S·R, K] with R a power of two >= 16 and K >= config.block_k.
      info: the batch's metadata; info.block_m is the row tile.
      num_slices: S.
      config: tiles; default from `default_config`.
      out: a [P, T, S·R] buffer to write the sums into instead (aliased: rows of slot -1 tokens keep its
        values), in its own dtype; with P = 1 that is the finished shrink, without a pass over the partials.
    """
    num_tokens, k = x.shape
    rank = a.shape[1] // num_slices
    config = config or default_config(x, a, info, num_slices)
    k_tail = k % config.block_k  # columns past the last full block
    k_per_split = (k - k_tail) // config.k_splits
    if k < config.block_k or k_per_split * config.k_splits != k - k_tail or k_per_split % config.block_k:
        raise ValueError(f"{config} does not tile K={k}")
    slices_per_program = 1 if config.split_slices else num_slices
    kernel = functools.partial(
        _shrink_kernel,
        slices_per_program=slices_per_program,
        rank=rank,
        block_m=info.block_m,
        block_k=config.block_k,
        k_per_split=k_per_split,
        k_tail=k_tail,
        precision=dot_precision(x.dtype),
    )
    shape = (config.k_splits, num_tokens, num_slices * rank)
    if out is not None and out.shape != shape:
        raise ValueError(f"out {out.shape} must be {shape} under {config}")
    operands = (info.sorted_idx, info.seg_start, info.seg_len, info.seg_slot, info.ranks, info.scalings, x, a)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(shape, jnp.float32 if out is None else out.dtype),
        grid=(info.num_segments, config.k_splits, num_slices // slices_per_program),
        input_output_aliases={} if out is None else {len(operands): 0},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_shrink_{k}x{num_slices}x{rank}",  # shapes in the name: readable profiles
    )(*operands, *(() if out is None else (out,)))
