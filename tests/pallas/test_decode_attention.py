"""The Pallas decode-attention kernels (interpret mode on CPU) against a plain masked-softmax reference, and
the paged one against a float64 oracle that gathers each position from its block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.pallas.decode_attention import decode_attention, decode_attention_supported, paged_decode_attention
from tests import oracle


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
    (0, 16, 4, None), (1, 32, 1, None), (2, 16, 7, 20), (3, 16, 8, 50), (4, 64, 4, None)])
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
