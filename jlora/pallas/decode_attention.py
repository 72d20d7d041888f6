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

Over a paged cache a key block is 64 positions gathered through the block table, from several pages or a part
of one: one small page per step waited on each load. While the grid leaves SMs to spare, a step loads two key
blocks before folding them in one after the other, which keeps the bits of one a step.

With `chunk`, each program also takes one chunk of that many positions (flash-decoding): at a small batch one
program per (request, KV head) leaves most of the GPU idle while each walks a long context in series. The
chunks are fixed position ranges whose partial softmax sums are combined in chunk order, element by element;
chunks past a request's position add exact zeros, so a request's result depends neither on the requests
beside it nor on the cache's size, as long as the chunk stays the same (`split_chunk`, an engine's choice).

Given a `NewToken` (the q|k|v projection's output) the kernel also does what ran between that projection and
attention: it rotates q and the token's key by RoPE (the operations and rounding of `jlora.models.llama`'s) and
writes the key and value to the cache at the query's position before it reads the cache. In XLA those were five
small kernels a layer in series, and a copy of each slice of q|k|v.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlora.pallas.common import dot_dim, dot_precision
from jlora.pallas.config import num_sms, pow2_divisor

__all__ = ["NewToken", "decode_attention", "decode_attention_supported", "paged_decode_attention", "split_chunk"]

_NEG = -1e30  # the running max's start: finite, so exp(start - max) is 0 rather than NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NewToken:
    """Each request's query token as the q|k|v projection gives it, for the kernel to rotate and write.

    Attributes:
      qkv: [B, H + 2·KV, D] its H query heads, KV key heads and KV value heads, before RoPE (the projection's
        output as it is: no slice of it is copied).
      cos, sin: [B, D] f32 its rotation: cos and sin of position x inverse frequency, the D/2 angles twice.
      write: [B] bool: False leaves the cache as it was (a padding request, which may share a real one's row).
    """

    qkv: jax.Array
    cos: jax.Array
    sin: jax.Array
    write: jax.Array


def _interpret() -> bool:
    """Pallas's interpret mode off a GPU (the tests on a CPU)."""
    return jax.default_backend() != "gpu"


def _block_t(max_seq: int) -> int:
    """Cache positions per loop step: up to 64, so three pipelined stages of K and V tiles (64 x 128 bf16
    each) take 96 KB of shared memory."""
    return pow2_divisor(max_seq, 64)


def _stages(programs: int) -> int:
    """Triton's pipeline stages for a grid of `programs`: three (K and V tiles of 64 positions in flight, 96 KB of
    shared memory) while the grid fits the GPU at once, two programs on each SM (132 on an H100 / H200); two
    past that, so three programs share an SM (bench/results/attention_tiles.json: at batch 64, 8 KV heads, 40
    against 44 µs over rows and 41 against 52 over pages; at 1-32 requests two stages are up to 1.56x slower).
    The stages only pipeline the loads: every setting computes the same operations in the same order."""
    return 3 if programs <= 2 * num_sms() else 2


def _warps(programs: int) -> int:
    """Triton's warps per program: four at every grid (bench/results/attention_tiles.json: eight won no case; two
    moved the 8B decode step by 0.4 % at most, either way, at batch 32 and 64)."""
    return 4


def _step_blocks(programs: int, tile_bytes: int) -> int:
    """Key blocks a loop step of the paged kernel loads: two while the grid leaves SMs to spare (at most one program
    on each SM), so more gathered loads are in flight, one past that
    (bench/results/attention_tiles.json: split at batch 1, 32 programs, 8.6 against 9.7 µs; paged at batch 16, 128
    programs, 19.2 against 19.6; over contiguous rows it gains nothing). Two only where a block's keys take at most
    `tile_bytes` 16 KB (64 positions of 128 bf16 values, the shape measured), so a step's tiles take no more shared
    memory than a measured one. The blocks are folded in one at a time either way: the same operations in the
    same order."""
    return 2 if programs <= num_sms() and tile_bytes <= 16 << 10 else 1


def split_chunk(max_seq: int, block_size: int = 0) -> int:
    """Positions per chunk of a split for contexts of up to `max_seq` positions over a cache of `block_size`
    blocks (0: contiguous, whose key blocks are at most 64): at least 256 (shorter chunks cost more in partial
    sums than they gain), at most 16 chunks (the combine reads every chunk's partial sums), a power of two and a
    multiple of the block."""
    return max(256, block_size, 1 << max(0, math.ceil(max_seq / 16) - 1).bit_length())


def decode_attention_supported(head_dim: int, max_seq: int) -> bool:
    """The kernel loads [block, head_dim] tiles: head_dim a power of two >= 16, max_seq a multiple of 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and _block_t(max_seq) >= 16


def _attend(q, load, pos, first, last, **options):
    """Attention of q [GP, D] over key blocks first..last-1 (`online_softmax`): [GP, D] f32."""
    _, l, acc = online_softmax(q, load, pos, first, last, **options)
    return acc / l


def online_softmax(q, load, pos, first, last, *, block_t: int, scale: float, window: int | None, precision,
                   step_blocks: int = 1):
    """Online softmax of q [GP, D] over key blocks first..last-1, `load(j)` giving block j's keys and values
    ([BT, D] each, positions j·BT...), the keys after `pos` (or outside the window) masked: the running max
    [GP, 1], the sum of exponentials [GP, 1] and the exponential-weighted values [GP, D], all f32 (zero blocks:
    max -1e30, sums 0). A loop step loads `step_blocks` key blocks before it folds them in one by one, so its
    loads are larger while the operations and their order stay those of one block a step (the same bits)."""

    def fold(j, k, v, carry):
        m, l, acc = carry  # [GP, 1] running max, [GP, 1] running sum, [GP, D] weighted values
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

    def step(i, carry):  # blocks first + i·n ... first + i·n + n - 1
        blocks = [first + i * step_blocks + u for u in range(step_blocks)]
        for j, (k, v) in zip(blocks, [load(j) for j in blocks]):
            carry = fold(j, k, v, carry)
        return carry

    gp, d = q.shape
    carry = (jnp.full((gp, 1), _NEG, jnp.float32), jnp.zeros((gp, 1), jnp.float32), jnp.zeros((gp, d), jnp.float32))
    if step_blocks > 1:  # whole steps, then the blocks left one at a time
        steps = (last - first) // step_blocks
        carry = jax.lax.fori_loop(0, steps, step, carry)
        first = first + steps * step_blocks
    return jax.lax.fori_loop(first, last, lambda j, c: fold(j, *load(j), c), carry)


def _heads(b, h, groups: int, tile: int, stride: int | None = None):
    """[GP] the rows of q (of `stride` rows a request; None: KV·G, the output's) that program (b, h) computes:
    its G heads, the last repeated."""
    stride = pl.num_programs(1) * groups if stride is None else stride
    return b * stride + h * groups + jnp.minimum(jnp.arange(tile), groups - 1)


def _first_block(pos, window: int | None, block_t: int):
    return 0 if window is None else jnp.maximum(pos - window + 1, 0) // block_t


def _rotated(ref, rows, cos, sin, dtype):
    """Rows [M] of ref [N, D] rotated as `jlora.models.llama` rotates them (x·cos + rotate_half(x)·sin in f32, cos
    and sin [M, D], rounded to `dtype`); rotate_half(x) = [-x[D/2:], x[:D/2]], loaded as such."""
    d = ref.shape[1]
    columns = jnp.arange(d)
    x = ref[rows[:, None], columns[None, :]].astype(jnp.float32)
    swapped = ref[rows[:, None], ((columns + d // 2) % d)[None, :]].astype(jnp.float32)
    rotated = jnp.where(columns[None, :] < d // 2, -swapped, swapped)
    return (x * cos + rotated * sin).astype(dtype)


def _new_token(token, qkv_ref, store, q_rows, tile: int, groups: int, writes):
    """Program (b, h)'s query heads (rows `q_rows` of qkv_ref [B·(H + 2·KV), D]) rotated, `token` the refs of cos,
    sin [B, D] and write [B]. Where `writes` and write[b], the token's rotated key and its value go to the cache
    through `store(k, v)` ([tile, D] each, identical rows), then a barrier, so the program's loads after it read
    them."""
    cos_ref, sin_ref, write_ref = token
    b, h, kv = pl.program_id(0), pl.program_id(1), pl.num_programs(1)
    at_b = jnp.minimum(jnp.arange(tile), 0) + b  # [tile] request b, repeated
    cos, sin = cos_ref[at_b, :], sin_ref[at_b, :]
    dtype = qkv_ref.dtype

    @pl.when(writes & (write_ref[b] != 0))
    def _():
        key = b * (kv * groups + 2 * kv) + kv * groups + h + jnp.minimum(jnp.arange(tile), 0)  # [tile] repeated
        store(_rotated(qkv_ref, key, cos, sin, dtype), qkv_ref[key + kv, :])

    if not _interpret():  # interpret mode runs a program's operations in order, and has no barrier
        pltriton.debug_barrier()
    return _rotated(qkv_ref, q_rows, cos, sin, dtype)


def _program(q_ref, load, pos, outs, *, groups: int, tile: int, block_t: int, window: int | None,
             chunk_blocks: int | None, token=None, store=None, **options) -> None:
    """Program (b, h[, c]): request b's KV head h over its visible key blocks (those of chunk c when split),
    `load(j)` giving block j's keys and values. Unsplit, `outs` is the output [B·KV·G, D]; split, the chunk's
    weighted values [C, B·KV·G, D], running max and sum of exponentials [C, B·KV·G] (f32; zeros and -1e30 for
    a chunk with no visible key). With `token` (`_new_token`'s refs) q_ref is the token's q|k|v, q is rotated,
    and the program whose key blocks hold the query's position writes its key and value through `store` first."""
    b, h = pl.program_id(0), pl.program_id(1)
    heads = _heads(b, h, groups, tile)
    first, last = _first_block(pos, window, block_t), pos // block_t + 1
    if token is None:
        q = q_ref[heads, :]
    else:
        holds_pos = True if chunk_blocks is None else pos // block_t // chunk_blocks == pl.program_id(2)
        q_rows = _heads(b, h, groups, tile, pl.num_programs(1) * (groups + 2))
        q = _new_token(token, q_ref, store, q_rows, tile, groups, holds_pos)
    options = dict(block_t=block_t, window=window, **options)
    if chunk_blocks is None:
        (o_ref,) = outs
        o_ref[heads, :] = _attend(q, load, pos, first, last, **options).astype(o_ref.dtype)
        return
    c = pl.program_id(2)
    start = jnp.maximum(first, c * chunk_blocks)
    m, l, acc = online_softmax(q, load, pos, start,
                               jnp.maximum(start, jnp.minimum(last, (c + 1) * chunk_blocks)), **options)
    acc_ref, m_ref, l_ref = outs
    acc_ref[c, heads, :] = acc
    m_ref[c, heads] = m[:, 0]
    l_ref[c, heads] = l[:, 0]


def _split_refs(refs, token: bool):
    """A kernel's refs after the cache's: (`_program`'s outs, the token's refs or None, the cache's refs to load
    from and store to). With a token the cache is also an output, the input's buffer (aliased), and the program
    reads it there, so its loads see its own store (in interpret mode too, where the output is a copy)."""
    if not token:
        return refs, None, None
    return refs[3:-2], refs[:3], refs[-2:]


def _kernel(
    pos_ref,  # [B] int32 query positions
    rows_ref,  # [B] int32 cache rows
    q_ref,  # [B·KV·G, D] queries, request-major then KV head, its G query heads consecutive; with a token, its
    # q|k|v [B·(KV·G + 2·KV), D]
    k_ref,  # [R, KV, max_seq, D]
    v_ref,  # [R, KV, max_seq, D]
    *refs,  # with a token, its cos, sin [B, D] and write [B] int32; then `_program`'s outs; then, with a token, the
    # cache as outputs
    block_t: int,
    tile: int,
    token: bool,
    **options,
):
    b, h = pl.program_id(0), pl.program_id(1)
    row, pos = rows_ref[b], pos_ref[b]
    outs, token_refs, cache = _split_refs(refs, token)
    k_ref, v_ref = cache or (k_ref, v_ref)

    def load(j):
        t = pl.ds(pl.multiple_of(j * block_t, block_t), block_t)
        return k_ref[row, h, t, :], v_ref[row, h, t, :]

    def store(k, v):  # [tile, D] each, the same row repeated, to the query's position
        at = jnp.minimum(jnp.arange(tile), 0) + pos
        k_ref[row, h, at, :] = k.astype(k_ref.dtype)
        v_ref[row, h, at, :] = v.astype(v_ref.dtype)

    _program(q_ref, load, pos, outs, block_t=block_t, tile=tile, token=token_refs, store=store, **options)


def _paged_kernel(
    pos_ref,  # [B] int32 query positions
    table_ref,  # [B, max_blocks] int32 each request's blocks, in position order
    q_ref,  # [B·KV·G, D], or a token's q|k|v (as `_kernel`'s)
    k_ref,  # [P·KV·S, D] the blocks [P, KV, S, D], flat
    v_ref,  # [P·KV·S, D]
    *refs,  # as `_kernel`'s
    page: int,  # S, the cache's block size
    block_t: int,  # positions per key block: several table entries, or a part of one
    tile: int,
    token: bool,
    **options,
):
    b, h = pl.program_id(0), pl.program_id(1)
    kv, max_blocks = pl.num_programs(1), table_ref.shape[1]
    t = jnp.arange(block_t)
    pos = pos_ref[b]
    outs, token_refs, cache = _split_refs(refs, token)
    k_ref, v_ref = cache or (k_ref, v_ref)

    def load(j):
        # Key block j's positions, through their blocks; table entries past the row's end are clamped, and the
        # values at positions past the query zeroed (their keys are masked), whatever those entries name.
        positions = j * block_t + t
        pages = table_ref[b, jnp.minimum(positions // page, max_blocks - 1)]
        rows = (pages * kv + h) * page + positions % page
        seen = positions <= pos
        return k_ref[rows, :], jnp.where(seen[:, None], v_ref[rows, :], 0)

    def store(k, v):  # [tile, D] each, the same row repeated, to the query's position
        at = jnp.minimum(jnp.arange(tile), 0) + (table_ref[b, pos // page] * kv + h) * page + pos % page
        k_ref[at, :] = k.astype(k_ref.dtype)
        v_ref[at, :] = v.astype(v_ref.dtype)

    _program(q_ref, load, pos, outs, block_t=block_t, tile=tile, token=token_refs, store=store, **options)


def decode_attention(
    q: jax.Array | NewToken,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    rows: jax.Array,
    *,
    window: int | None = None,
    chunk: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of one query per request over its cache row, keys at positions <= its own.

    Args:
      q: [B, KV, G, D] queries, the G heads of each KV head together; or a `NewToken`: the token's q|k|v before
        RoPE, which the kernel rotates, writing k and v to the cache before it reads it.
      k_cache, v_cache: [R, KV, max_seq, D]; request b reads row rows[b], positions 0..positions[b] (the
        query's own key and value there, or from the `NewToken`).
      positions: [B] int, each request's query position, in [0, max_seq).
      rows: [B] int cache row of each request.
      window: sliding window: keys at positions > position - window only.
      chunk: split into chunks of this many positions too (a power of two >= 64), combined after.

    Returns:
      [B, KV, G, D] in q's dtype (softmax with scale 1/sqrt(D), f32 accumulation); from a `NewToken`, (that,
      k_cache, v_cache), the caches with the token written (in place where XLA can donate them).
    """
    max_seq = k_cache.shape[2]
    return _call(_kernel, "decode_attention", q, jnp.clip(positions, 0, max_seq - 1), rows, k_cache, v_cache,
                 block_t=_block_t(max_seq), window=window, chunk=chunk, limit=max_seq, kv=k_cache.shape[1])


def paged_decode_attention(
    q: jax.Array | NewToken,
    k_pages: jax.Array,
    v_pages: jax.Array,
    positions: jax.Array,
    tables: jax.Array,
    *,
    window: int | None = None,
    chunk: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_attention` over a paged cache: request b's position p lives in block tables[b, p // S] at
    offset p % S (S the block size).

    Args:
      q: [B, KV, G, D] queries, or a `NewToken` (as `decode_attention`'s).
      k_pages, v_pages: [P, KV, S, D] the cache's blocks; S a power of two >= 16.
      positions: [B] int, each request's query position, < max_blocks · S.
      tables: [B, max_blocks] int, each request's blocks in position order (blocks may be shared between
        requests and appear in any order; entries past its position are valid block ids, masked if read).
      window: sliding window: keys at positions > position - window only.
      chunk: split into chunks of this many positions too (a power of two >= 64), combined
        after.

    Returns:
      [B, KV, G, D] in q's dtype; from a `NewToken`, (that, k_pages, v_pages).
    """
    num_blocks, kv, size, d = k_pages.shape
    limit = tables.shape[1] * size
    # Keys in blocks of 64 positions, as over rows, whatever the page: with one 16-position page a step, each waited
    # on its load, and pages of 128 or more as one key block would take more shared memory than a program has.
    kernel = functools.partial(_paged_kernel, page=size)
    got = _call(kernel, "paged_decode_attention", q, jnp.clip(positions, 0, limit - 1), tables,
                k_pages.reshape(num_blocks * kv * size, d), v_pages.reshape(num_blocks * kv * size, d),
                block_t=64, window=window, chunk=chunk, limit=limit, step_blocks=None, kv=kv)
    if not isinstance(q, NewToken):
        return got
    return got[0], got[1].reshape(k_pages.shape), got[2].reshape(v_pages.shape)


def _call(kernel, name: str, q, positions, where, k, v, *, block_t: int, window: int | None, chunk: int | None,
          limit: int, num_warps: int | None = None, num_stages: int | None = None, step_blocks: int | None = 1,
          kv: int | None = None):
    """`kernel` over q [B, KV, G, D] (or a `NewToken` of `kv` KV heads) and `limit` cache positions -> [B, KV, G,
    D] (from a `NewToken`, and the caches k and v as given, the token written): one program per (request, KV
    head), and per chunk of `chunk` positions when that is given (None: unsplit). `num_warps` and `num_stages`
    are Triton's (None: `_warps` and `_stages` of the grid), `step_blocks` the key blocks a loop step loads (None:
    `_step_blocks` of the grid, the paged kernel's rule); bench/studies/attention_tiles.py sweeps them with
    `block_t`."""
    token = q if isinstance(q, NewToken) else None
    if token is None:
        batch, kv, groups, d = q.shape
        flat = q.reshape(batch * kv * groups, d)
    else:
        batch, heads, d = token.qkv.shape
        if heads % kv or heads // kv < 3:
            raise ValueError(f"a NewToken's q|k|v has G + 2 heads per KV head of the cache ({kv}), got {heads}")
        groups = heads // kv - 2
        flat = token.qkv.reshape(batch * heads, d)
    n = batch * kv * groups
    if chunk is not None and (chunk % block_t or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of two and a multiple of the key block {block_t}, got {chunk}")
    if chunk is None:
        grid, out_shape = (batch, kv), (jax.ShapeDtypeStruct((n, d), flat.dtype),)
    else:
        chunks = -(-limit // chunk)
        grid = (batch, kv, chunks)
        out_shape = (jax.ShapeDtypeStruct((chunks, n, d), jnp.float32), jax.ShapeDtypeStruct((chunks, n), jnp.float32),
                     jax.ShapeDtypeStruct((chunks, n), jnp.float32))
        name = f"{name}_split{chunks}"
    inputs = [positions.astype(jnp.int32), where.astype(jnp.int32), flat, k, v]
    aliases = {}
    if token is not None:  # the caches (inputs 3 and 4) come back as the last two outputs, the same buffers
        inputs += [token.cos.astype(jnp.float32), token.sin.astype(jnp.float32), token.write.astype(jnp.int32)]
        aliases = {3: len(out_shape), 4: len(out_shape) + 1}
        out_shape += (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
        name = f"{name}_rope"
    programs = math.prod(grid)
    kernel = functools.partial(kernel, groups=groups, tile=dot_dim(groups), block_t=block_t, window=window,
                               chunk_blocks=None if chunk is None else chunk // block_t, scale=1 / math.sqrt(d),
                               precision=dot_precision(flat.dtype), token=token is not None,
                               step_blocks=step_blocks or _step_blocks(programs, block_t * d * k.dtype.itemsize))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or _warps(programs),
                                                num_stages=num_stages or _stages(programs)),
        interpret=_interpret(),
        name=f"jlora_{name}_{kv}x{groups}x{d}",
    )(*inputs)
    attention = (out[0] if chunk is None else _combine(*out[:3]).astype(flat.dtype)).reshape(batch, kv, groups, d)
    return attention if token is None else (attention, *out[-2:])


def _combine(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """The chunks' partial sums (acc [C, N, D], m and l [C, N]) as attention [N, D] f32, summed in chunk order
    element by element: the same operations for every row whatever the rows beside it. A chunk with no visible
    key weighs exp(-1e30 - max) = 0; every row has one with a key, its own position."""
    weight = jnp.exp(m - m.max(axis=0))  # [C, N]
    num, den = weight[0][:, None] * acc[0], weight[0] * l[0]
    for c in range(1, acc.shape[0]):
        num, den = num + weight[c][:, None] * acc[c], den + weight[c] * l[c]
    return num / den[:, None]
