"""A projection and the residual add after it in one kernel: r + (x @ w), as the model rounds them.

At decode sizes XLA runs the o and down GEMMs split along K and sums the splits with the residual add in a
second kernel. Here each program computes one [T, 32] column block over the whole of K, four weight tiles in
flight (fewer where many rows fill the shared memory), and adds its block of the residual: one kernel, and at 32-64 rows (a weight read by 128 programs) faster
than XLA's pair (docs/performance.md § The model step, *The residual add in the o and down GEMMs*). The rounding
is the model's: the product summed in f32 and rounded to x's dtype, then added to r in f32 and rounded again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["matmul_add", "matmul_add_supported"]

BLOCK_N, BLOCK_K, STAGES = 32, 256, 4  # the best of 27 tilings at 32 and 64 rows (bench/studies/small_gemm.py)
SHARED_BYTES = 200 << 10  # of the 227 KB a Hopper program may hold: the x and w tiles of its stages in flight


def matmul_add_supported(dtype, k: int, n: int) -> bool:
    """Whether the kernel takes a [K, N] weight of `dtype`: a 16-bit float (a float32 product would run in TF32),
    K a multiple of its 256-column steps and N of its 32-column blocks."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and k % BLOCK_K == 0 \
        and n % BLOCK_N == 0


def _kernel(x_ref, w_ref, r_ref, o_ref):
    """Program n: columns [32n, 32n + 32) of r + x @ w."""
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * BLOCK_N, BLOCK_N), BLOCK_N)

    def step(j, acc):
        k = pl.ds(pl.multiple_of(j * BLOCK_K, BLOCK_K), BLOCK_K)
        return acc + pltriton.dot(x_ref[:, k], w_ref[k, cols])

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // BLOCK_K, step, jnp.zeros((x_ref.shape[0], BLOCK_N), jnp.float32))
    product = acc.astype(o_ref.dtype).astype(jnp.float32)
    o_ref[...] = (r_ref[:, cols].astype(jnp.float32) + product).astype(o_ref.dtype)


def matmul_add(x: jax.Array, w: jax.Array, r: jax.Array) -> jax.Array:
    """r + x @ w: x [T, K], w [K, N] and r [T, N] of one 16-bit dtype -> [T, N] (the product rounded to that
    dtype before the add, as `Linear` rounds it). Raises ValueError for what `matmul_add_supported` refuses."""
    (t, k), n = x.shape, w.shape[1]
    if not (x.dtype == w.dtype == r.dtype and matmul_add_supported(x.dtype, k, n)) or r.shape != (t, n) \
            or w.shape[0] != k:
        raise ValueError(f"matmul_add needs x [T, K], w [K, N] and r [T, N] of one 16-bit float dtype with K % "
                         f"{BLOCK_K} == 0 and N % {BLOCK_N} == 0, got {x.shape} {x.dtype}, {w.shape} {w.dtype}, "
                         f"{r.shape} {r.dtype}")
    tp = max(16, 1 << (t - 1).bit_length())  # Triton's tiles: a power of two, its dots at least 16 rows
    xp, rp = (jnp.pad(a, ((0, tp - t), (0, 0))) for a in (x, r))
    stage = (tp + BLOCK_N) * BLOCK_K * x.dtype.itemsize  # an x tile and a w tile
    stages = max(1, min(STAGES, SHARED_BYTES // stage))  # fewer for many rows: 2 at 128, 1 from 256
    out = pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct((tp, n), x.dtype),
        grid=(n // BLOCK_N,),
        in_specs=[pl.BlockSpec((tp, k), lambda j: (0, 0)), pl.BlockSpec((k, n), lambda j: (0, 0)),
                  pl.BlockSpec((tp, n), lambda j: (0, 0))],
        out_specs=pl.BlockSpec((tp, BLOCK_N), lambda j: (0, j)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=stages),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_matmul_add_{k}x{n}",
    )(xp, w, rp)
    return out[:t]
