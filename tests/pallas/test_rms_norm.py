"""The Pallas RMSNorm (interpret mode on CPU) against a float64 oracle of HF's Llama norm, XLA's form of it in
the model, and each row's bits alone; with the residual add in the kernel, against the add and the norm apart."""

import jax.numpy as jnp
import numpy as np
import pytest

from jlora.models.llama import RMSNorm
from jlora.pallas.rms_norm import add_rms_norm, rms_norm, rms_norm_supported
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seed, tokens, hidden", [(7, 1, 4096), (8, 5, 128), (9, 2, 16)])
def test_the_add_in_the_kernel_has_the_bits_of_the_add_then_the_norm(dtype, seed, tokens, hidden):
    """`add_rms_norm(x, h)`: the sum rounded to x's dtype as XLA's add rounds it, and the norm of that sum, bit for
    bit, and each row's alone; the sum's norm against the float64 oracle. x and h of very different magnitudes,
    so the sum's rounding decides bits."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 10.0 ** rng.uniform(-2, 2, (tokens, 1)), dtype)
    h = jnp.asarray(rng.standard_normal((tokens, hidden)) * 10.0 ** rng.uniform(-2, 2, (tokens, 1)), dtype)
    w = jnp.asarray(rng.standard_normal(hidden), dtype)
    s, normed = add_rms_norm(x, h, w, 1e-5)
    assert s.dtype == normed.dtype == dtype
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x + h, np.float32))
    np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(rms_norm(x + h, w, 1e-5), np.float32))
    assert oracle.worst_row_err(np.asarray(normed, np.float64), _oracle(x + h, w, 1e-5)) < (
        1e-6 if dtype == jnp.float32 else 1e-2)
    last = add_rms_norm(x[-1:], h[-1:], w, 1e-5)
    np.testing.assert_array_equal(np.asarray(last[1], np.float32), np.asarray(normed[-1:], np.float32))


def test_the_add_in_the_kernel_refuses_operands_it_cannot_add():
    x = jnp.zeros((2, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, jnp.zeros((2, 32), jnp.float32), jnp.ones(32, jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, jnp.zeros((1, 32), jnp.bfloat16), jnp.ones(32, jnp.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm needs a hidden size"):
        add_rms_norm(jnp.zeros((2, 48)), jnp.zeros((2, 48)), jnp.ones(48), 1e-6)
    s, normed = add_rms_norm(jnp.zeros((0, 32)), jnp.zeros((0, 32)), jnp.ones(32), 1e-6)
    assert s.shape == normed.shape == (0, 32)
