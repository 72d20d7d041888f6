"""The Pallas RMSNorm (interpret mode on CPU) against a float64 oracle of HF's Llama norm, XLA's form of it in
the model, and each row's bits alone."""

import jax.numpy as jnp
import numpy as np
import pytest

from jlora.models.llama import RMSNorm
from jlora.pallas.rms_norm import residual_rms_norm, rms_norm, rms_norm_supported
from tests import oracle


def _oracle(x, w, eps):
    """float64 of HF's LlamaRMSNorm: the row scaled in high precision, rounded to x's dtype (the one rounding
    the kernel must share), times the weight."""
    x64 = np.asarray(x, np.float64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return np.asarray(w, np.float64) * np.asarray(jnp.asarray(y, x.dtype), np.float64)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("seed, tokens, hidden", [(0, 1, 64), (1, 7, 256), (2, 33, 128), (3, 2, 16)])
def test_matches_the_float64_oracle(dtype, tol, seed, tokens, hidden):
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 3, (tokens, 1))  # rows of very different magnitudes
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * scale, dtype)
    w = jnp.asarray(rng.standard_normal(hidden), dtype)
    out = np.asarray(rms_norm(x, w, 1e-5), np.float64)
    want = _oracle(x, w, 1e-5)
    assert oracle.worst_row_err(out, want) < tol


def test_equals_the_model_norm_in_xla_and_keeps_each_rows_bits_alone():
    rng = np.random.default_rng(4)
    norm = RMSNorm(256, 1e-6, dtype=jnp.bfloat16, rngs=None)
    norm.weight[...] = jnp.asarray(rng.standard_normal(256), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((9, 256)) * 3, jnp.bfloat16)
    out = np.asarray(norm(x, kernel=True).astype(jnp.float32))
    np.testing.assert_allclose(out, np.asarray(norm(x).astype(jnp.float32)), rtol=1e-2, atol=0)
    for t in (0, 4, 8):
        np.testing.assert_array_equal(np.asarray(norm(x[t:t + 1], kernel=True).astype(jnp.float32))[0], out[t])


def test_a_zero_row_stays_zero_no_rows_are_no_rows_and_sizes_it_cannot_tile_are_refused():
    out = rms_norm(jnp.zeros((2, 32), jnp.float32), jnp.ones(32, jnp.float32), 1e-6)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert rms_norm(jnp.zeros((0, 32), jnp.bfloat16), jnp.ones(32, jnp.bfloat16), 1e-6).shape == (0, 32)
    assert rms_norm_supported(4096) and not rms_norm_supported(3584) and not rms_norm_supported(8)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm(jnp.zeros((2, 48), jnp.float32), jnp.ones(48, jnp.float32), 1e-6)


def test_rounds_where_hf_rounds():
    """bf16: the scaled row is rounded before the weight multiplies it (HF's `weight * hidden.to(dtype)`); a kernel
    that multiplied the f32 row would differ in the last bit of many elements, past what the order of the mean's
    sum can change (a rare element at a rounding boundary)."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((16, 512)) * 5, jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 2.0, 512), jnp.bfloat16)
    x32 = np.asarray(x, np.float32)
    y = jnp.asarray(x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(1e-5)), jnp.bfloat16)
    want = np.asarray((np.asarray(w, np.float32) * np.asarray(y, np.float32)).astype(jnp.bfloat16), np.float32)
    out = np.asarray(rms_norm(x, w, 1e-5), np.float32)
    assert np.mean(out == want) > 0.999


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("seed, splits, tokens, hidden", [(0, 8, 1, 64), (1, 8, 5, 256), (2, 2, 33, 128)])
def test_residual_norm_matches_the_float64_oracle(dtype, tol, seed, splits, tokens, hidden):
    rng = np.random.default_rng(seed)
    partials = jnp.asarray(rng.standard_normal((splits, tokens, hidden)), jnp.float32)
    residual = jnp.asarray(rng.standard_normal((tokens, hidden)) * 4, dtype)
    w = jnp.asarray(rng.standard_normal(hidden), dtype)
    h, normed = residual_rms_norm(partials, residual, w, 1e-5)
    assert h.dtype == normed.dtype == dtype and h.shape == normed.shape == residual.shape
    # the model's rounding: the projection's output in the activations' dtype, then the add in that dtype
    y = jnp.asarray(np.sum(np.asarray(partials, np.float64), axis=0), dtype)
    want_h = jnp.asarray(np.asarray(residual, np.float64) + np.asarray(y, np.float64), dtype)
    assert oracle.worst_row_err(np.asarray(h, np.float64), np.asarray(want_h, np.float64)) < tol
    assert oracle.worst_row_err(np.asarray(normed, np.float64), _oracle(want_h, w, 1e-5)) < tol


def test_residual_norm_equals_the_models_xla_form_and_keeps_each_rows_bits_alone():
    rng = np.random.default_rng(7)
    norm = RMSNorm(128, 1e-6, dtype=jnp.bfloat16, rngs=None)
    norm.weight[...] = jnp.asarray(rng.standard_normal(128), jnp.bfloat16)
    partials = jnp.asarray(rng.standard_normal((8, 9, 128)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((9, 128)) * 3, jnp.bfloat16)
    h, normed = residual_rms_norm(partials, x, norm.weight[...], norm.eps)
    want_h = x + partials.sum(0).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(norm(want_h), np.float32), rtol=2e-2,
                               atol=2e-2)
    for t in (0, 4, 8):
        alone = residual_rms_norm(partials[:, t:t + 1], x[t:t + 1], norm.weight[...], norm.eps)
        np.testing.assert_array_equal(np.asarray(alone[0], np.float32)[0], np.asarray(h, np.float32)[t])
        np.testing.assert_array_equal(np.asarray(alone[1], np.float32)[0], np.asarray(normed, np.float32)[t])
    empty = jnp.zeros((0, 128), jnp.bfloat16)
    assert [a.shape for a in residual_rms_norm(jnp.zeros((8, 0, 128)), empty, norm.weight[...], 1e-6)] == [(0, 128)] * 2
    with pytest.raises(ValueError, match="power of two"):
        residual_rms_norm(jnp.zeros((8, 2, 48)), jnp.zeros((2, 48)), jnp.ones(48), 1e-6)


def test_residual_norm_rounds_the_projection_before_the_add():
    """bf16: the split sums are rounded to bf16 (the projection's output) before the residual add, itself rounded;
    adding the f32 sum to the residual directly would differ in many elements. The partials are multiples of 1/64
    whose sums f32 holds exactly, so every element must match."""
    rng = np.random.default_rng(8)
    partials = jnp.asarray(rng.integers(-1000, 1000, (8, 4, 256)) / 64, jnp.float32)
    residual = jnp.asarray(rng.standard_normal((4, 256)) * 100, jnp.bfloat16)
    h, _ = residual_rms_norm(partials, residual, jnp.ones(256, jnp.bfloat16), 1e-5)
    y = np.asarray(jnp.asarray(np.asarray(partials).sum(0), jnp.bfloat16), np.float32)
    want = np.asarray(jnp.asarray(np.asarray(residual, np.float32) + y, jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(h, np.float32), want)
