"""The Pallas decode-attention kernel (interpret mode on CPU) against a plain masked-softmax reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.pallas.decode_attention import decode_attention, decode_attention_supported


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
