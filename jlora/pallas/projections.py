"""A decode step's small projections in one kernel each, K unsplit: x @ w, or r + x @ w with the residual add
after it, as the model rounds them.

At decode sizes XLA runs the q|k|v, o and down GEMMs split along K and sums the splits in a second kernel (with
the residual add after o and down). Here each program computes one column block [T, BN] over the whole of K,
several weight tiles in flight, and writes it (adding its block of the residual): one kernel, and at 16-64 rows
faster than XLA's pair on an H100, at 64 on an H200 (docs/performance.md § The model step, *The small projections
in Pallas kernels*). The rounding is the model's: the product summed in f32 and rounded to x's dtype, then added
to r in f32 and rounded again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlora.pallas.config import num_sms

__all__ = ["matmul", "matmul_add", "matmul_supported"]

# (block N, block K, stages): the best of 27 tilings at 32 and 64 rows (bench/studies/small_gemm.py --residual):
# 32-column blocks where they fill at most one wave of programs (o, down: 128 of them), else 64 (q|k|v: 96).
TILINGS = ((32, 256, 4), (64, 128, 5))
SHARED_BYTES = 200 << 10  # of the 227 KB a Hopper program may hold: the x and w tiles of its stages in flight


def _tiling(n: int) -> tuple[int, int, int]:
    """(block N, block K, stages) for an output of N columns."""
    return next((t for t in TILINGS if n // t[0] <= num_sms()), TILINGS[-1])


def _fits(dtype, k: int, n: int, tiling: tuple[int, int, int]) -> bool:
    """A 16-bit float (a float32 product would run in TF32), K and N multiples of the tiling's steps and blocks."""
    block_n, block_k, _ = tiling
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and k % block_k == 0 \
        and n % block_n == 0


def matmul_supported(dtype, k: int, n: int) -> bool:
    """Whether the kernels take a [K, N] weight of `dtype` at the width's tiling (`_fits`)."""
    return _fits(dtype, k, n, _tiling(n))


def _kernel(*refs, block_k: int):
    """Program j: columns [j·BN, (j + 1)·BN) of x @ w (r + x @ w where refs hold r): refs are x, w[, r], out."""
    x_ref, w_ref, o_ref = refs[0], refs[1], refs[-1]
    block_n = o_ref.shape[1]
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)

    def step(j, acc):
        k = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        return acc + pltriton.dot(x_ref[:, k], w_ref[k, cols])

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    product = acc.astype(o_ref.dtype)
    if len(refs) == 4:
        product = (refs[2][:, cols].astype(jnp.float32) + product.astype(jnp.float32)).astype(o_ref.dtype)
    o_ref[...] = product


def _call(x: jax.Array, w: jax.Array, r: jax.Array | None, name: str,
          tiling: tuple[int, int, int] | None) -> jax.Array:
    (t, k), n = x.shape, w.shape[1]
    block_n, block_k, stages = tiling = tiling or _tiling(n)
    if x.dtype != w.dtype or not _fits(x.dtype, k, n, tiling) or w.shape[0] != k or (
            r is not None and (r.shape != (t, n) or r.dtype != x.dtype)):
        raise ValueError(f"{name} needs x [T, K], w [K, N]{' and r [T, N]' if r is not None else ''} of one 16-bit "
                         f"float dtype with K % {block_k} == 0 and N % {block_n} == 0, got {x.shape} {x.dtype}, "
                         f"{w.shape} {w.dtype}" + ("" if r is None else f", {r.shape} {r.dtype}"))
    tp = max(16, 1 << (t - 1).bit_length())  # Triton's tiles: a power of two, its dots at least 16 rows
    rows = [jnp.pad(a, ((0, tp - t), (0, 0))) for a in ((x,) if r is None else (x, r))]
    stage = (tp + block_n) * block_k * x.dtype.itemsize  # an x tile and a w tile
    stages = max(1, min(stages, SHARED_BYTES // stage))  # fewer where many rows fill the shared memory
    whole = lambda shape: pl.BlockSpec(shape, lambda j: (0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k),
        out_shape=jax.ShapeDtypeStruct((tp, n), x.dtype),
        grid=(n // block_n,),
        in_specs=[whole((tp, k)), whole((k, n))] + ([] if r is None else [whole((tp, n))]),
        out_specs=pl.BlockSpec((tp, block_n), lambda j: (0, j)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=stages),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_{name}_{k}x{n}",
    )(rows[0], w, *rows[1:])
    return out[:t]


def matmul(x: jax.Array, w: jax.Array, tiling: tuple[int, int, int] | None = None) -> jax.Array:
    """x @ w rounded to x's dtype: x [T, K] and w [K, N] of one 16-bit dtype -> [T, N]. `tiling`: (block N,
    block K, stages), default the width's (a study's sweep sets it). Raises ValueError for what `matmul_supported`
    refuses."""
    return _call(x, w, None, "matmul", tiling)


def matmul_add(x: jax.Array, w: jax.Array, r: jax.Array, tiling: tuple[int, int, int] | None = None) -> jax.Array:
    """r + x @ w: x [T, K], w [K, N] and r [T, N] of one 16-bit dtype -> [T, N] (the product rounded to that
    dtype before the add, as `Linear` rounds it); `tiling` as `matmul`'s. Raises ValueError for what
    `matmul_supported` refuses."""
    return _call(x, w, r, "matmul_add", tiling)
