"""The Pallas kernels at real sizes on a GPU (skipped elsewhere), against float64 NumPy oracles.

Every check draws fresh random inputs, leaves about a tenth of the tokens without an adapter (their rows
must come back bit-identical to `base`) and uses heterogeneous ranks with non-zero weights past each rank.
Every used row is compared on its own (`worst_row_err`), so one unwritten row fails: it would hold `base`
(expand), zeros or uninitialized memory (shrink); the shrink kernel also writes into a NaN-poisoned buffer.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jlora
from jlora import LoRABatchInfo
from jlora.pallas.shrink import default_config
from tests.oracle import expand_np, rel_err, shrink_np, worst_row_err

pytestmark = pytest.mark.gpu

L = 32
ROW_TOL = 2e-2  # bf16 per row: rounding alone gives about 3e-3


def case(rng, t, k, slice_sizes, rank, block_m, dtype=jnp.bfloat16):
    slots = rng.integers(0, L, t)
    slots[rng.random(t) < 0.1] = -1
    ranks = rng.integers(1, rank + 1, L)
    scal = rng.uniform(0.5, 2, L).astype(np.float32)
    info = LoRABatchInfo.build(slots, ranks, scal, block_m=block_m)
    f = lambda shape, s: jnp.asarray(rng.standard_normal(shape) * s, dtype)
    x = f((t, k), 1)
    a = f((L, len(slice_sizes) * rank, k), 1 / np.sqrt(k))
    b = f((L, sum(slice_sizes), rank), 1 / np.sqrt(rank))
    base = f((t, sum(slice_sizes)), 0.5)
    np32 = lambda v: np.asarray(v.astype(jnp.float32))
    return slots, ranks, scal, info, (x, a, b, base), tuple(map(np32, (x, a, b, base)))


@pytest.mark.parametrize(
    "t, k, slice_sizes, rank, block_m",
    [
        (8192, 4096, (4096, 1024, 1024), 64, 64),  # prefill qkv
        (2049, 4096, (14336, 14336), 16, 32),  # gate_up, T not a power of two
        (64, 14336, (4096,), 16, 16),  # decode down_proj: split-K over K=14336
        (1, 4096, (4096, 1024, 1024), 16, 16),  # one decode token
        (256, 4096, (2 * 14336,), 64, 16),
    ],
)
def test_linear_shrink_expand_real_sizes(t, k, slice_sizes, rank, block_m):
    rng = np.random.default_rng(t + k)
    slots, ranks, scal, info, (x, a, b, base), (xn, an, bn, basen) = case(rng, t, k, slice_sizes, rank, block_m)
    y_ref = shrink_np(xn, an, slots, ranks, scal, len(slice_sizes))
    out_ref = expand_np(y_ref, bn, slots, ranks, basen, slice_sizes)
    none = slots < 0

    y = np.asarray(jlora.lora_shrink(x, a, info, num_slices=len(slice_sizes), backend="pallas").astype(jnp.float32))
    assert rel_err(y, y_ref) < 1e-2 and worst_row_err(y[~none], y_ref[~none]) < ROW_TOL and (y[none] == 0).all()

    # The kernel itself into a NaN-poisoned buffer: every used row written (its split-K sums), slot -1 rows not.
    config = default_config(x, a, info, len(slice_sizes))
    poisoned = jnp.full((config.k_splits, *y.shape), jnp.nan, jnp.float32)
    partials = np.asarray(jlora.pallas.shrink_partials(x, a, info, num_slices=len(slice_sizes), out=poisoned))
    assert np.isnan(partials[:, none]).all() and worst_row_err(partials[:, ~none].sum(0), y_ref[~none]) < ROW_TOL

    out = jlora.lora_linear(x, base, a, b, info, slice_sizes=slice_sizes, backend="pallas")
    out = np.asarray(out.astype(jnp.float32))
    assert rel_err(out, out_ref) < 1e-2 and worst_row_err(out[~none], out_ref[~none]) < ROW_TOL
    np.testing.assert_array_equal(out[none], basen[none])

    s = jnp.asarray(rng.standard_normal(y.shape), jnp.bfloat16)
    out = jlora.lora_expand(s, b, info, base, slice_sizes=slice_sizes, backend="pallas")
    ref = expand_np(np.asarray(s.astype(jnp.float32)), bn, slots, ranks, basen, slice_sizes)
    out = np.asarray(out.astype(jnp.float32))
    assert rel_err(out, ref) < 1e-2 and worst_row_err(out[~none], ref[~none]) < ROW_TOL
    np.testing.assert_array_equal(out[none], basen[none])


@pytest.mark.parametrize("dtype, tol", [(jnp.float16, 1e-2), (jnp.float32, 1e-5)])
def test_half_and_full_precision(dtype, tol):
    rng = np.random.default_rng(7)
    slice_sizes = (1024, 256, 256)
    slots, ranks, scal, info, (x, a, b, base), (xn, an, bn, basen) = case(rng, 300, 1024, slice_sizes, 32, 16, dtype)
    out = jlora.lora_linear(x, base, a, b, info, slice_sizes=slice_sizes, backend="pallas")
    ref = expand_np(shrink_np(xn, an, slots, ranks, scal, 3), bn, slots, ranks, basen, slice_sizes)
    assert out.dtype == dtype and rel_err(np.asarray(out.astype(jnp.float32)), ref) < tol


def test_embedding_real_vocab():
    rng = np.random.default_rng(9)
    t, vocab, hidden, rank = 512, 128256, 4096, 16
    slots = rng.integers(-1, L, t)
    ranks = rng.integers(1, rank + 1, L)
    info = LoRABatchInfo.build(slots, ranks, np.ones(L), block_m=16)
    tokens = rng.integers(0, vocab, t)
    a_emb = jnp.asarray(rng.standard_normal((L, rank, vocab)), jnp.bfloat16)
    b_emb = jnp.asarray(rng.standard_normal((L, hidden, rank)) / 4, jnp.bfloat16)
    base = jnp.asarray(rng.standard_normal((t, hidden)), jnp.bfloat16)
    out = jlora.lora_embedding(jnp.asarray(tokens), a_emb, b_emb, info, base, backend="pallas")
    an, bn = np.asarray(a_emb.astype(jnp.float32)), np.asarray(b_emb.astype(jnp.float32))
    ref = np.asarray(base.astype(jnp.float32), np.float64)
    for i, s in enumerate(slots):
        if s >= 0:
            ref[i] += bn[s, :, : ranks[s]] @ an[s, : ranks[s], tokens[i]]
    assert rel_err(np.asarray(out.astype(jnp.float32)), ref) < 1e-2
