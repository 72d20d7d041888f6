"""Decode attention (one query token per request) over the model's KV cache, reading only the positions
each request can see.

XLA's attention contracts every request's query against the whole cache, all `max_seq` positions, and
masks afterwards; a batched [G, D] x [D, max_seq] product per KV head is also a poor fit for its GEMMs.
Here one program per (request, KV head) walks the cache in blocks up to the request's position (from the
window start under sliding-window attention) with an online softmax, so the bytes read follow the
requests' context lengths, not the cache size. The G query heads sharing a KV head are the rows of the
products, gathered from q and scattered to the output with their row index clamped to the last head, so a
tile of a power of two >= 16 rows needs no padded copy of q or slice of the output (two fewer kernels per
layer; duplicate rows compute and write identical values).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlora.pallas.common import dot_dim, dot_precision
from jlora.pallas.config import pow2_divisor

__all__ = ["decode_attention", "decode_attention_supported", "paged_decode_attention"]

_NEG = -1e30  # the running max's start: finite, so exp(start - max) is 0 rather than NaN


def _block_t(max_seq: int) -> int:
    """Cache positions per loop step: up to 64, so three pipelined stages of K and V tiles (64 x 128 bf16
    each) take 96 KB of shared memory."""
    return pow2_divisor(max_seq, 64)


def decode_attention_supported(head_dim: int, max_seq: int) -> bool:
    """The kernel loads [block, head_dim] tiles: head_dim a power of two >= 16, max_seq a multiple of 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and _block_t(max_seq) >= 16


def _attend(q, load, pos, first, last, **options):
    """Attention of q [GP, D] over key blocks first..last-1 (`online_softmax`): [GP, D] f32."""
    _, l, acc = online_softmax(q, load, pos, first, last, **options)
    return acc / l


def online_softmax(q, load, pos, first, last, *, block_t: int, scale: float, window: int | None, precision):
    """Online softmax of q [GP, D] over key blocks first..last-1, `load(j)` giving block j's keys and values
    ([BT, D] each, positions j·BT...), the keys after `pos` (or outside the window) masked: the running max
    [GP, 1], the sum of exponentials [GP, 1] and the exponential-weighted values [GP, D], all f32 (zero blocks:
    max -1e30, sums 0)."""

    def step(j, carry):
        m, l, acc = carry  # [GP, 1] running max, [GP, 1] running sum, [GP, D] weighted values
        k, v = load(j)
        s = pltriton.dot(q, k, trans_b=True, precision=precision) * scale  # [GP, BT] f32
        key = j * block_t + jnp.arange(block_t)[None, :]  # [1, BT] positions of this block
        visible = key <= pos
        if window is not None:
            visible &= key > pos - window
        s = jnp.where(visible, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)  # [GP, BT]
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha + pltriton.dot(p.astype(v.dtype), v, precision=precision)
        return m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True), acc

    gp, d = q.shape
    init = (jnp.full((gp, 1), _NEG, jnp.float32), jnp.zeros((gp, 1), jnp.float32), jnp.zeros((gp, d), jnp.float32))
    return jax.lax.fori_loop(first, last, step, init)


def _heads(b, h, groups: int, tile: int):
    """[GP] the rows of q and the output that program (b, h) computes: its G heads, the last repeated."""
    return (b * pl.num_programs(1) + h) * groups + jnp.minimum(jnp.arange(tile), groups - 1)


def _first_block(pos, window: int | None, block_t: int):
    return 0 if window is None else jnp.maximum(pos - window + 1, 0) // block_t


def _kernel(
    pos_ref,  # [B] int32 query positions
    rows_ref,  # [B] int32 cache rows
    q_ref,  # [B·KV·G, D] queries, request-major then KV head, its G query heads consecutive
    k_ref,  # [R, KV, max_seq, D]
    v_ref,  # [R, KV, max_seq, D]
    o_ref,  # [B·KV·G, D]
    *,
    groups: int,
    tile: int,  # GP: the rows of the products, a power of two >= max(groups, 16)
    block_t: int,
    window: int | None,
    **options,
):
    b, h = pl.program_id(0), pl.program_id(1)
    pos, row = pos_ref[b], rows_ref[b]
    heads = _heads(b, h, groups, tile)

    def load(j):
        t = pl.ds(pl.multiple_of(j * block_t, block_t), block_t)
        return k_ref[row, h, t, :], v_ref[row, h, t, :]

    out = _attend(q_ref[heads, :], load, pos, _first_block(pos, window, block_t), pos // block_t + 1,
                  block_t=block_t, window=window, **options)
    o_ref[heads, :] = out.astype(o_ref.dtype)


def _paged_kernel(
    pos_ref,  # [B] int32 query positions
    table_ref,  # [B, max_blocks] int32 each request's blocks, in position order
    q_ref,  # [B·KV·G, D]
    k_ref,  # [P, KV, block_size, D]
    v_ref,  # [P, KV, block_size, D]
    o_ref,  # [B·KV·G, D]
    *,
    groups: int,
    tile: int,
    block_t: int,  # the block size
    window: int | None,
    **options,
):
    b, h = pl.program_id(0), pl.program_id(1)
    pos = pos_ref[b]
    heads = _heads(b, h, groups, tile)

    def load(j):
        page = table_ref[b, j]
        return k_ref[page, h, :, :], v_ref[page, h, :, :]

    out = _attend(q_ref[heads, :], load, pos, _first_block(pos, window, block_t), pos // block_t + 1,
                  block_t=block_t, window=window, **options)
    o_ref[heads, :] = out.astype(o_ref.dtype)


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    rows: jax.Array,
    *,
    window: int | None = None,
) -> jax.Array:
    """Attention of one query per request over its cache row, keys at positions <= its own.

    Args:
      q: [B, KV, G, D] queries, the G heads of each KV head together.
      k_cache, v_cache: [R, KV, max_seq, D]; request b reads row rows[b], positions 0..positions[b] (the
        query's own key and value already written there).
      positions: [B] int, each request's query position, in [0, max_seq).
      rows: [B] int cache row of each request.
      window: sliding window: keys at positions > position - window only.

    Returns:
      [B, KV, G, D] in q's dtype (softmax with scale 1/sqrt(D), f32 accumulation).
    """
    max_seq = k_cache.shape[2]
    return _call(_kernel, "decode_attention", q, jnp.clip(positions, 0, max_seq - 1), rows, k_cache, v_cache,
                 block_t=_block_t(max_seq), window=window)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    tables: jax.Array,
    *,
    window: int | None = None,
) -> jax.Array:
    """`decode_attention` over a paged cache: request b's position p lives in block tables[b, p // S] at
    offset p % S (S the block size).

    Args:
      q: [B, KV, G, D] queries.
      k_pages, v_pages: [P, KV, S, D] the cache's blocks; S a power of two >= 16.
      positions: [B] int, each request's query position, < max_blocks · S.
      tables: [B, max_blocks] int, each request's blocks in position order (entries past its position are
        not read; blocks may be shared between requests and appear in any order).
      window: sliding window: keys at positions > position - window only.

    Returns:
      [B, KV, G, D] in q's dtype.
    """
    limit = tables.shape[1] * k_pages.shape[2]
    return _call(_paged_kernel, "paged_decode_attention", q, jnp.clip(positions, 0, limit - 1), tables, k_pages,
                 v_pages, block_t=k_pages.shape[2], window=window)


def _call(kernel, name: str, q, positions, where, k, v, *, block_t: int, window: int | None) -> jax.Array:
    """One program per (request, KV head) of `kernel` over q [B, KV, G, D] -> [B, KV, G, D]."""
    batch, kv, groups, d = q.shape
    kernel = functools.partial(kernel, groups=groups, tile=dot_dim(groups), block_t=block_t, window=window,
                               scale=1 / math.sqrt(d), precision=dot_precision(q.dtype))
    flat = q.reshape(batch * kv * groups, d)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(flat.shape, q.dtype),
        grid=(batch, kv),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_{name}_{kv}x{groups}x{d}",
    )(positions.astype(jnp.int32), where.astype(jnp.int32), flat, k, v)
    return out.reshape(q.shape)
