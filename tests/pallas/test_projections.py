"""The decode step's projection kernels (`matmul`, and `matmul_add` with the residual add; interpret mode on CPU)
against a float64 oracle of the model's rounding, over row counts that are and are not powers of two, both
tilings and every column block; what they refuse, they name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.pallas import projections as kernels
from jlora.pallas.projections import matmul, matmul_add, matmul_supported
from tests import oracle


def _oracle(x, w, r=None):
    """float64 of `Linear` (then the residual add): the product rounded to x's dtype (added to r)."""
    product = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    rounded = np.asarray(jnp.asarray(product, x.dtype), np.float64)
    return rounded if r is None else np.asarray(r, np.float64) + rounded


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("seed, tokens, k, n", [(0, 32, 256, 64), (1, 33, 512, 96), (2, 1, 256, 32),
                                                (3, 64, 768, 160), (4, 7, 256, 32),
                                                (5, 20, 256, 4480)])  # 140 blocks of 32: the 64-column tiling
def test_matches_the_float64_oracle_in_every_column_block(dtype, residual, seed, tokens, k, n):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    r = jnp.asarray(rng.standard_normal((tokens, n)) * 4, dtype) if residual else None  # larger than the product
    out = matmul_add(x, w, r) if residual else matmul(x, w)
    assert out.shape == (tokens, n) and out.dtype == dtype
    want = _oracle(x, w, r)
    got = np.asarray(out, np.float64)
    assert oracle.worst_row_err(got, want) < 1e-2
    block_n = kernels._tiling(n)[0]
    for block in range(n // block_n):  # each program's columns written (an unwritten block would read 0 or garbage)
        cols = slice(block_n * block, block_n * (block + 1))
        assert np.linalg.norm(got[:, cols] - want[:, cols]) <= 1e-2 * np.linalg.norm(want[:, cols])


@pytest.mark.parametrize("tokens", [1, 7, 20, 32])
def test_a_larger_tile_masks_the_rows_it_does_not_hold(monkeypatch, tokens):
    """With the fewest rows a tile holds raised to 64 (`add_in_gemm.py --min-rows`), 1-32 rows are masked in a
    tile of 64: each of the T rows still the oracle's."""
    monkeypatch.setattr(kernels, "MIN_ROWS", 64)
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((tokens, 64)), jnp.bfloat16)
    for got, want in ((matmul_add(x, w, r), _oracle(x, w, r)), (matmul(x, w), _oracle(x, w))):
        assert got.shape == (tokens, 64)
        assert oracle.worst_row_err(np.asarray(got, np.float64), want) < 1e-2


def test_the_tiling_follows_the_width():
    """32-column blocks while they make at most one program per SM (o and down of an 8B layer: 128), else 64
    (q|k|v: 6144 columns, 96 programs)."""
    assert kernels._tiling(4096)[0] == 32 and kernels._tiling(6144)[0] == 64


def test_each_rows_result_is_its_own():
    """A row's output does not depend on the rows beside it (the padding to a power of two and the batch's other
    tokens): the same bits alone and among 40."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 64)) / 16, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
    together, plain = (np.asarray(a.astype(jnp.float32)) for a in (matmul_add(x, w, r), matmul(x, w)))
    for t in (0, 17, 39):
        np.testing.assert_array_equal(np.asarray(matmul_add(x[t:t + 1], w, r[t:t + 1]).astype(jnp.float32))[0],
                                      together[t])
        np.testing.assert_array_equal(np.asarray(matmul(x[t:t + 1], w).astype(jnp.float32))[0], plain[t])


def test_what_the_kernels_refuse_they_name():
    assert matmul_supported(jnp.bfloat16, 4096, 4096) and matmul_supported(jnp.float16, 14336, 4096)
    assert matmul_supported(jnp.bfloat16, 4096, 6144)
    assert not matmul_supported(jnp.float32, 4096, 4096)  # Triton's f32 dot would run in TF32
    assert not matmul_supported(jnp.bfloat16, 4000, 4096) and not matmul_supported(jnp.bfloat16, 256, 48)
    x, w, r = jnp.zeros((4, 256), jnp.bfloat16), jnp.zeros((256, 32), jnp.bfloat16), jnp.zeros((4, 32), jnp.bfloat16)
    for args in ((x.astype(jnp.float32), w.astype(jnp.float32), r.astype(jnp.float32)),  # float32
                 (x, w, r.astype(jnp.float16)),  # mixed dtypes
                 (x, w, r[:3]),  # residual rows
                 (x[:, :128], w[:128], r)):  # K of 128
        with pytest.raises(ValueError, match="matmul_add needs x"):
            matmul_add(*args)
    with pytest.raises(ValueError, match=r"matmul needs x \[T, K\], w \[K, N\] of one 16-bit float dtype"):
        matmul(x, w.astype(jnp.float16))
    with pytest.raises(ValueError, match="K % 512 == 0"):  # K 256 in blocks of 512
        matmul(x, w, (32, 512, 3))
    jax.block_until_ready((matmul_add(x, w, r), matmul(x, w)))  # the shapes above, right: accepted
