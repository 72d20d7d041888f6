"""The o and down projections' kernel with the residual add (`matmul_add`; interpret mode on CPU) against a
float64 oracle of the model's rounding, over row counts that are and are not multiples of 16 and every column
block; what it refuses, it names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.pallas.matmul_add import matmul_add, matmul_add_supported
from tests import oracle


def _oracle(x, w, r):
    """float64 of `Linear` then the residual add: the product rounded to x's dtype, added to r."""
    product = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    rounded = np.asarray(jnp.asarray(product, x.dtype), np.float64)
    return np.asarray(r, np.float64) + rounded


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("seed, tokens, k, n", [(0, 32, 256, 64), (1, 33, 512, 96), (2, 1, 256, 32),
                                                (3, 64, 768, 160), (4, 7, 256, 32)])
def test_matches_the_float64_oracle_in_every_column_block(dtype, seed, tokens, k, n):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    r = jnp.asarray(rng.standard_normal((tokens, n)) * 4, dtype)  # the residual larger than the product, as in a model
    out = matmul_add(x, w, r)
    assert out.shape == (tokens, n) and out.dtype == dtype
    want = _oracle(x, w, r)
    got = np.asarray(out, np.float64)
    assert oracle.worst_row_err(got, want) < 1e-2
    for block in range(n // 32):  # each program's columns written (an unwritten block would read 0 or garbage)
        cols = slice(32 * block, 32 * block + 32)
        assert np.linalg.norm(got[:, cols] - want[:, cols]) <= 1e-2 * np.linalg.norm(want[:, cols])


def test_each_rows_result_is_its_own():
    """A row's output does not depend on the rows beside it (the padding to a power of two and the batch's other
    tokens): the same bits alone and among 40."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
    together = np.asarray(matmul_add(x, w, r).astype(jnp.float32))
    for t in (0, 17, 39):
        alone = np.asarray(matmul_add(x[t:t + 1], w, r[t:t + 1]).astype(jnp.float32))
        np.testing.assert_array_equal(alone[0], together[t])


def test_what_the_kernel_refuses_it_names():
    assert matmul_add_supported(jnp.bfloat16, 4096, 4096) and matmul_add_supported(jnp.float16, 14336, 4096)
    assert not matmul_add_supported(jnp.float32, 4096, 4096)  # Triton's f32 dot would run in TF32
    assert not matmul_add_supported(jnp.bfloat16, 4000, 4096) and not matmul_add_supported(jnp.bfloat16, 256, 48)
    x, w, r = jnp.zeros((4, 256), jnp.bfloat16), jnp.zeros((256, 32), jnp.bfloat16), jnp.zeros((4, 32), jnp.bfloat16)
    for args in ((x.astype(jnp.float32), w.astype(jnp.float32), r.astype(jnp.float32)),  # float32
                 (x, w, r.astype(jnp.float16)),  # mixed dtypes
                 (x, w, r[:3]),  # residual rows
                 (x[:, :128], w[:128], r)):  # K of 128
        with pytest.raises(ValueError, match="matmul_add needs x"):
            matmul_add(*args)
    jax.block_until_ready(matmul_add(x, w, r))  # the shapes above, right: accepted
