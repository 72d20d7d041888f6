"""The Pallas decode-attention kernels (interpret mode on CPU) against a plain masked-softmax reference, and
the paged one against a float64 oracle that gathers each position from its block; split over chunks of
positions, the same, and each request's result bit for bit what it is alone; with the token's RoPE and cache
write in the kernel, what the model's own rotation and write give."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.pallas.decode_attention import (_stages, decode_attention, decode_attention_supported,
                                           paged_decode_attention, split_chunk)
from jlora.models import llama
from jlora.pallas.config import num_sms
from tests import oracle

attention = importlib.import_module("jlora.pallas.decode_attention")  # the module: jlora.pallas names the function


def _reference(q, k, v, positions, rows, window):
    """[B, KV, G, D] f32: softmax over each request's visible cache positions, every position scored."""
    keys, values = k[rows].astype(jnp.float32), v[rows].astype(jnp.float32)
    exact = jax.lax.Precision.HIGHEST  # float32 products, also on a GPU (no TF32)
    scores = jnp.einsum("bkgd,bktd->bkgt", q.astype(jnp.float32), keys, precision=exact) / np.sqrt(q.shape[-1])
    key = jnp.arange(k.shape[2])[None, :]
    visible = key <= positions[:, None]
    if window is not None:
        visible &= key > positions[:, None] - window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    return jnp.einsum("bkgt,bktd->bkgd", jax.nn.softmax(scores, axis=-1), values, precision=exact)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("groups, window", [(4, None), (1, None), (4, 20), (8, 64), (7, None), (32, 20)])
def test_matches_reference(dtype, tol, groups, window):
    rng = np.random.default_rng(groups)
    batch, kv, d, cache_rows, max_seq = 4, 2, 32, 6, 128
    q = jnp.asarray(rng.standard_normal((batch, kv, groups, d)), dtype)
    k = jnp.asarray(rng.standard_normal((cache_rows, kv, max_seq, d)), dtype)
    v = jnp.asarray(rng.standard_normal((cache_rows, kv, max_seq, d)), dtype)
    positions = jnp.array([0, 70, max_seq - 1, 63])  # first position, mid-block, last, a block's end
    rows = jnp.array([5, 0, 2, 3])  # requests read their own cache rows
    out = decode_attention(q, k, v, positions, rows, window=window)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _reference(q, k, v, positions, rows, window)
    err = jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    assert err < tol


def test_masks_and_skips_invisible_positions():
    # Garbage past each request's position inside its last block must be masked out; NaN in the blocks
    # past it and in other requests' rows must not be read at all.
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 1, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 1, 128, 16)), jnp.float32)  # 128 positions: blocks of 64
    v = jnp.asarray(rng.standard_normal((3, 1, 128, 16)), jnp.float32)
    positions, rows = jnp.array([5, 40]), jnp.array([2, 0])
    ref = _reference(q, k, v, positions, rows, None)

    def poison(c):
        c = c.at[2, :, 6:64].set(1e4).at[0, :, 41:64].set(-1e4)  # same block as the query: masked
        return c.at[1].set(jnp.nan).at[:, :, 64:].set(jnp.nan)  # never read

    out = decode_attention(q, poison(k), poison(v), positions, rows)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_supported_shapes():
    assert decode_attention_supported(128, 1024) and decode_attention_supported(64, 48)
    assert not decode_attention_supported(96, 1024)  # head_dim not a power of two
    assert not decode_attention_supported(128, 100)  # max_seq not a multiple of 16


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("seed, block_size, groups, window", [
    (0, 16, 4, None), (1, 32, 1, None), (2, 16, 7, 20), (3, 16, 8, 50), (4, 64, 4, None), (5, 128, 4, None),
    (6, 256, 2, 300)])
def test_paged_matches_the_float64_oracle_on_random_tables(dtype, tol, seed, block_size, groups, window):
    """Random block tables out of order, blocks shared by several requests (a common prefix), positions at a
    block's first and last offsets; every block no request may read is NaN."""
    rng = np.random.default_rng(seed)
    batch, kv, d, num_blocks, max_blocks = 5, 2, 32, 24, 6
    q = rng.standard_normal((batch, kv, groups, d))
    k = rng.standard_normal((num_blocks, kv, block_size, d))
    v = rng.standard_normal((num_blocks, kv, block_size, d))
    order = rng.permutation(num_blocks)
    shared = order[:2]  # the first two blocks of requests 0-2: a shared prefix
    tables = np.zeros((batch, max_blocks), np.int32)
    tables[:, :] = -1  # never read: an out-of-range block id would fault
    positions = np.array([2 * block_size, 2 * block_size - 1, 3 * block_size + 5, 0, max_blocks * block_size - 1])
    rest = iter(order[2:])
    for b, pos in enumerate(positions):
        used = pos // block_size + 1
        own = [next(rest) for _ in range(used)]
        tables[b, :used] = np.concatenate([shared, own[2:]]) if b < 3 and used >= 2 else own
    tables = np.where(tables < 0, num_blocks - 1, tables)  # a real block id, NaN below, if it were read
    read = {int(tables[b, j]) for b, pos in enumerate(positions) for j in range(pos // block_size + 1)}
    unread = [i for i in range(num_blocks) if i not in read]
    assert unread
    want = oracle.paged_attention_np(q, k, v, positions, tables, window)
    k[unread], v[unread] = np.nan, np.nan
    out = paged_decode_attention(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                 jnp.asarray(positions), jnp.asarray(tables), window=window)
    assert out.shape == q.shape and out.dtype == dtype
    err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
    assert err < tol


def test_paged_masks_the_rest_of_the_last_block():
    """Positions past the query's in its own last block hold garbage; they are masked, not read as keys."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 1, 2, 16))
    k, v = rng.standard_normal((3, 1, 16, 16)), rng.standard_normal((3, 1, 16, 16))
    tables, positions = np.array([[2, 0]]), np.array([20])
    want = oracle.paged_attention_np(q, k, v, positions, tables)
    k[0, :, 5:], v[0, :, 5:] = 1e4, -1e4
    k[1], v[1] = np.nan, np.nan
    out = paged_decode_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(positions),
                                 jnp.asarray(tables))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_split_chunk():
    assert [split_chunk(n) for n in (128, 1024, 4096, 4100, 8192, 32768)] == [256, 256, 256, 512, 512, 2048]
    assert split_chunk(4096, 512) == 512  # never less than a block
    with pytest.raises(ValueError, match="chunk must be a power of two and a multiple of the key block 64"):
        paged_decode_attention(jnp.zeros((1, 1, 1, 16)), jnp.zeros((4, 1, 32, 16)), jnp.zeros((4, 1, 32, 16)),
                               jnp.array([3]), jnp.zeros((1, 4), jnp.int32), chunk=48)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [None, 300])
def test_split_matches_reference_and_reads_only_visible_positions(dtype, tol, window):
    """Four chunks of 256 positions; queries at a chunk's first and last positions, mid-chunk and the cache's
    end; NaN in other requests' rows, past each query and (windowed) before its window: never read."""
    rng = np.random.default_rng(11)
    batch, kv, groups, d, max_seq = 5, 2, 4, 32, 1024
    q = jnp.asarray(rng.standard_normal((batch, kv, groups, d)), dtype)
    k = jnp.asarray(rng.standard_normal((batch + 1, kv, max_seq, d)), dtype)
    v = jnp.asarray(rng.standard_normal((batch + 1, kv, max_seq, d)), dtype)
    positions, rows = jnp.array([0, 255, 256, 700, max_seq - 1]), jnp.array([1, 2, 3, 4, 5])
    ref = _reference(q, k, v, positions, rows, window)

    def poison(c):
        c = c.at[0].set(jnp.nan)
        for b, (pos, row) in enumerate(zip(positions.tolist(), rows.tolist())):
            c = c.at[row, :, -(-(pos + 1) // 64) * 64:].set(jnp.nan)  # the blocks past its own
            if window is not None and pos - window + 1 > 0:
                c = c.at[row, :, : (pos - window + 1) // 64 * 64].set(jnp.nan)  # the blocks before its window
        return c

    out = decode_attention(q, poison(k), poison(v), positions, rows, window=window, chunk=256)
    assert out.shape == q.shape and out.dtype == dtype
    err = jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    assert err < tol


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_split_paged_matches_the_float64_oracle(dtype, tol):
    """Blocks of 16 out of order, 4 chunks of 256 positions, a block shared by two requests; unread blocks NaN."""
    rng = np.random.default_rng(5)
    batch, kv, groups, d, size, max_blocks = 3, 2, 4, 32, 16, 64
    positions = np.array([17, 511, max_blocks * size - 1])
    used = positions // size + 1
    num_blocks = int(used.sum()) + 4
    q, k, v = (rng.standard_normal(s) for s in [(batch, kv, groups, d)] + [(num_blocks, kv, size, d)] * 2)
    order = iter(rng.permutation(num_blocks - 1))
    tables = np.full((batch, max_blocks), num_blocks - 1, np.int32)  # past a request's position: a NaN block
    for b in range(batch):
        tables[b, : used[b]] = [next(order) for _ in range(used[b])]
    tables[1, 0] = tables[0, 0]  # a shared first block
    want = oracle.paged_attention_np(q, k, v, positions, tables)
    read = set(tables[b, j] for b in range(batch) for j in range(used[b]))
    unread = [i for i in range(num_blocks) if i not in read]
    k[unread], v[unread] = np.nan, np.nan
    out = paged_decode_attention(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                 jnp.asarray(positions), jnp.asarray(tables), chunk=256)
    err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
    assert err < tol


@pytest.mark.parametrize("paged", [False, True])
def test_split_gives_each_request_its_bits_alone(paged):
    """Batch invariance: a request's split result depends neither on the requests beside it, nor on its row,
    nor on the cache's size (alone, a cache or table cut short: fewer chunks)."""
    rng = np.random.default_rng(3)
    batch, kv, groups, d = 4, 2, 4, 32
    q = jnp.asarray(rng.standard_normal((batch, kv, groups, d)), jnp.bfloat16)
    positions = jnp.array([900, 3, 600, 257])
    if paged:
        k, v = (jnp.asarray(rng.standard_normal((256, kv, 16, d)), jnp.bfloat16) for _ in range(2))
        tables = jnp.asarray(rng.permutation(256)[: batch * 64].reshape(batch, 64), jnp.int32)
        together = paged_decode_attention(q, k, v, positions, tables, chunk=256)
    else:
        k, v = (jnp.asarray(rng.standard_normal((batch, kv, 1024, d)), jnp.bfloat16) for _ in range(2))
        rows = jnp.array([2, 0, 3, 1])
        together = decode_attention(q, k, v, positions, rows, chunk=256)
    for b in range(batch):
        pick = jnp.array([b, (b + 1) % batch]) if b % 2 else jnp.array([b])  # alone, or first of two
        if paged:  # only the blocks the picked requests need: 2-4 chunks where the batch had 4
            blocks = int(positions[pick].max()) // 16 + 1
            alone = paged_decode_attention(q[pick], k, v, positions[pick], tables[pick, :blocks], chunk=256)
        else:  # a cache of 960 positions
            alone = decode_attention(q[pick], k[:, :, :960], v[:, :, :960], positions[pick], rows[pick], chunk=256)
        np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(together)[b])


@pytest.mark.parametrize("window", [None, 100, 300])
@pytest.mark.parametrize("chunk", [None, 256])
def test_paged_with_a_window_and_a_table_of_no_whole_key_blocks(window, chunk):
    """63 table entries (the key block reads 4 at a time): a query in the last, partial group reads clamped
    entries; windows start mid-chunk; every block no request may read is NaN."""
    rng = np.random.default_rng(9)
    batch, kv, groups, d, size, max_blocks = 3, 2, 3, 32, 16, 63
    positions = np.array([max_blocks * size - 1, 300, 700])
    used = positions // size + 1
    num_blocks = int(used.sum()) + 2
    q, k, v = (rng.standard_normal(s) for s in [(batch, kv, groups, d)] + [(num_blocks, kv, size, d)] * 2)
    order = iter(rng.permutation(num_blocks - 1))
    tables = np.full((batch, max_blocks), num_blocks - 1, np.int32)
    for b in range(batch):
        tables[b, : used[b]] = [next(order) for _ in range(used[b])]
    want = oracle.paged_attention_np(q, k, v, positions, tables, window)
    read = {tables[b, j] for b in range(batch) for j in range(used[b])}
    unread = [i for i in range(num_blocks) if i not in read]
    k[unread], v[unread] = np.nan, np.nan
    out = paged_decode_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(positions),
                                 jnp.asarray(tables), window=window, chunk=chunk)
    err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-5


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("paged", [False, True])
def test_a_request_has_its_bits_alone_and_in_a_batch_past_one_wave(paged, chunk):
    """Batch invariance across the grid's rules (`_stages` and, over pages, `_step_blocks`; only a GPU compiles the
    stages): alone, a request's grid of 8 programs (32 split) takes three stages and two key blocks a step; in a
    batch of 40 requests of 8 KV heads (320 programs, 1280 split), two stages and one block."""
    rng = np.random.default_rng(4)
    batch, kv, groups, d, max_seq = 40, 8, 2, 64, 256
    chunks = 1 if chunk is None else max_seq // chunk
    assert _stages(kv * chunks) != _stages(batch * kv * chunks)
    tile = 64 * d * 2  # a key block of bf16 keys
    assert attention._step_blocks(kv * chunks, tile) != attention._step_blocks(batch * kv * chunks, tile)
    q = jnp.asarray(rng.standard_normal((batch, kv, groups, d)), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, max_seq, batch), jnp.int32)
    if paged:
        k, v = (jnp.asarray(rng.standard_normal((batch * max_seq // 16, kv, 16, d)), jnp.bfloat16) for _ in range(2))
        where = jnp.asarray(rng.permutation(batch * max_seq // 16).reshape(batch, -1), jnp.int32)
        attend = paged_decode_attention
    else:
        k, v = (jnp.asarray(rng.standard_normal((batch, kv, max_seq, d)), jnp.bfloat16) for _ in range(2))
        where = jnp.asarray(rng.permutation(batch), jnp.int32)
        attend = decode_attention
    together = np.asarray(attend(q, k, v, positions, where, chunk=chunk))
    for b in (0, 17, 39):
        alone = attend(q[b:b + 1], k, v, positions[b:b + 1], where[b:b + 1], chunk=chunk)
        np.testing.assert_array_equal(np.asarray(alone)[0], together[b])


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("chunk", [None, 256])
@pytest.mark.parametrize("paged", [False, True])
def test_loading_several_key_blocks_a_step_keeps_the_bits(paged, chunk, window):
    """A loop step that loads 2 or 3 key blocks before it folds them in (`step_blocks`) computes what one block a
    step computes, bit for bit: whole steps and the blocks left over, from a window's first block or a chunk's."""
    rng = np.random.default_rng(5)
    batch, kv, groups, d, max_seq = 4, 2, 4, 64, 1024
    q = jnp.asarray(rng.standard_normal((batch, kv, groups, d)), jnp.bfloat16)
    positions = jnp.array([1023, 5, 700, 191], jnp.int32)
    if paged:
        k, v = (jnp.asarray(rng.standard_normal((batch * max_seq // 16, kv, 16, d)), jnp.bfloat16) for _ in range(2))
        where = jnp.asarray(rng.permutation(batch * max_seq // 16).reshape(batch, -1), jnp.int32)
        kernel, k, v = functools.partial(attention._paged_kernel, page=16), k.reshape(-1, d), v.reshape(-1, d)
    else:
        k, v = (jnp.asarray(rng.standard_normal((batch, kv, max_seq, d)), jnp.bfloat16) for _ in range(2))
        where, kernel = jnp.asarray(rng.permutation(batch), jnp.int32), attention._kernel
    outs = [np.asarray(attention._call(kernel, "attention", q, positions, where, k, v, block_t=64, window=window,
                                       chunk=chunk, limit=max_seq, step_blocks=n)) for n in (1, 2, 3)]
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])


def test_the_grid_rules_follow_the_sms_and_two_key_blocks_a_step_only_the_measured_tile():
    bf16_keys = 64 * 128 * 2  # a key block of the 8B shape: the tile the rule was measured on
    sms = num_sms()  # 132 here and on an H100 / H200
    assert attention._step_blocks(sms, bf16_keys) == 2 and attention._step_blocks(sms + 1, bf16_keys) == 1
    assert _stages(2 * sms) == 3 and _stages(2 * sms + 1) == 2
    assert attention._step_blocks(8, 64 * 128 * 4) == 1  # float32 keys: twice the shared memory a step
    assert attention._step_blocks(8, 64 * 256 * 2) == 1  # head_dim 256


def _rotated(x, cos, sin):
    """x [B, H, D] rotated as the model rotates it outside the kernel (`llama._rope`), cos and sin [B, D]."""
    return llama._rope(x[:, None], cos[:, None], sin[:, None])[:, 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("paged, chunk, window, groups", [(False, None, None, 4), (False, 256, 300, 1),
                                                          (True, None, 100, 7), (True, 256, None, 4)])
def test_a_new_token_is_rotated_written_and_read_as_the_model_does_it_apart(dtype, paged, chunk, window, groups):
    """With a `NewToken` the kernel rotates q and k by RoPE (LongLoRA's fractional positions too) and writes k and v
    at each query's position, then attends: the cache and the output are those of the model's own rotation and
    write followed by the kernel without a token (bit for bit in interpret mode; the rotation within an ulp on a
    GPU), for 1, 4 and 7 query heads a KV head. A padding request (write False) on a real request's row leaves the
    cache as it was; every position no query writes keeps its bits."""
    rng = np.random.default_rng(11)
    batch, kv, d, max_seq = 4, 2, 32, 1024
    positions = jnp.array([1023, 0, 700, 300], jnp.int32)  # the last, the first, mid-chunk, a padding request's
    write = jnp.array([True, True, True, False])
    rope_positions = positions.astype(jnp.float32) / jnp.array([1.0, 1.0, 4.0, 1.0])  # one LongLoRA factor
    inv_freq = 1.0 / (10000 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    cos, sin = (x[:, 0] for x in llama._rotation(rope_positions[:, None], inv_freq))
    q = jnp.asarray(rng.standard_normal((batch, kv, groups, d)), dtype)
    new_k, new_v = (jnp.asarray(rng.standard_normal((batch, kv, d)), dtype) for _ in range(2))
    if paged:  # request 3 (padding) shares request 0's blocks
        size = 16
        k, v = (jnp.asarray(rng.standard_normal((256, kv, size, d)), dtype) for _ in range(2))
        tables = jnp.asarray(rng.permutation(256)[: 3 * 64].reshape(3, 64), jnp.int32)
        where = jnp.concatenate([tables, tables[:1]])
        block = where[jnp.arange(batch), positions // size]
        at = (block, slice(None), positions % size)
        attend = functools.partial(paged_decode_attention, tables=where)
    else:
        k, v = (jnp.asarray(rng.standard_normal((3, kv, max_seq, d)), dtype) for _ in range(2))
        where = jnp.array([2, 0, 1, 2], jnp.int32)  # request 3 (padding) on request 0's row
        at = (where, slice(None), positions)
        attend = functools.partial(decode_attention, rows=where)
    kept = np.asarray(write)
    want_k = k.at[tuple(i[kept] if not isinstance(i, slice) else i for i in at)].set(_rotated(new_k, cos, sin)[kept])
    want_v = v.at[tuple(i[kept] if not isinstance(i, slice) else i for i in at)].set(new_v[kept])
    q_rotated = _rotated(q.reshape(batch, kv * groups, d), cos, sin).reshape(q.shape)
    want = attend(q_rotated, want_k, want_v, positions, window=window, chunk=chunk)
    qkv = jnp.concatenate([q.reshape(batch, kv * groups, d), new_k, new_v], axis=1)  # [B, H + 2·KV, D]
    out, got_k, got_v = attend(attention.NewToken(qkv, cos, sin, write), k, v, positions, window=window, chunk=chunk)
    assert got_k.shape == k.shape and got_k.dtype == k.dtype and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    if jax.default_backend() == "gpu":  # the rotation's mul-adds may contract otherwise than XLA's
        ulp = float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32), rtol=ulp, atol=ulp)
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        err = jnp.linalg.norm((out - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32))
        assert err < tol
    else:
        np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_a_new_token_of_the_wrong_heads_is_refused():
    cache = jnp.zeros((2, 2, 64, 16))
    token = attention.NewToken(jnp.zeros((1, 5, 16)), jnp.zeros((1, 16)), jnp.zeros((1, 16)), jnp.ones(1, bool))
    with pytest.raises(ValueError, match="G \\+ 2 heads per KV head of the cache \\(2\\), got 5"):
        decode_attention(token, cache, cache, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
