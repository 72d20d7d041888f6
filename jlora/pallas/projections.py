"""A decode step's small projections in one kernel each: x @ w, or r + x @ w with the residual add after it, as
the model rounds them.

At decode sizes XLA runs the q|k|v, o and down GEMMs split along K and sums the splits in a second kernel (with
the residual add after o and down). Here program j computes column block j [T, BN] over all of K, several
weight tiles in flight, the T rows in a tile of a power of two with the rows past T masked (no padded copies),
and writes its block (adding its block of the residual): one kernel, and at 16-64 rows faster than XLA's pair on
an H100, at 36-64 on an H200 (docs/performance.md § The model step, *The small projections in Pallas kernels*).
A K split summed in the kernel was slower in the model's step on both cards (docs/performance.md, *K split in
the kernel, not adopted*). The rounding is the model's: the product summed in f32 and rounded to x's dtype, then
added to r in f32 and rounded again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlora.pallas.config import num_sms

__all__ = ["matmul", "matmul_add", "matmul_supported"]

Tiling = tuple[int, int, int]  # (block N, block K, stages)

# The best of 27 tilings at 32 and 64 rows (bench/studies/small_gemm.py --residual): 32-column blocks where they
# fill at most one wave of programs (o, down: 128 of them), else 64 (q|k|v: 96).
TILINGS: tuple[Tiling, ...] = ((32, 256, 4), (64, 128, 5))
MIN_ROWS = 16  # the fewest rows a tile holds: Triton's dots take at least 16
SHARED_BYTES = 200 << 10  # of the 227 KB a Hopper program may hold: the x and w tiles of its stages in flight


def _tiling(n: int) -> Tiling:
    """The tiling for an output of N columns."""
    return next((t for t in TILINGS if n // t[0] <= num_sms()), TILINGS[-1])


def _fits(dtype, k: int, n: int, tiling: Tiling) -> bool:
    """A 16-bit float (a float32 product would run in TF32), K a multiple of block K, N of block N."""
    block_n, block_k, _ = tiling
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and k % block_k == 0 \
        and n % block_n == 0


def matmul_supported(dtype, k: int, n: int) -> bool:
    """Whether the kernels take a [K, N] weight of `dtype` at the width's tiling (`_fits`)."""
    return _fits(dtype, k, n, _tiling(n))


def _rows(ref, index, mask: jax.Array | None) -> jax.Array:
    """ref[index] with the rows past the array's T (where `mask` [Tp, 1] is False) read as zeros, not loaded."""
    return ref[index] if mask is None else pltriton.load(ref.at[index], mask=mask, other=0)


def _kernel(*refs, block_k: int, residual: bool, tokens: int):
    """Program j: columns [j·BN, (j + 1)·BN) of x @ w (r + x @ w with `residual`), for the `tokens` rows of x
    [T, K] in a tile of Tp (a power of two: the rows past T masked, neither loaded nor stored). refs: x, w[, r],
    out. The product is summed in f32 and rounded to the output's dtype (then added to r's block in f32 and
    rounded again)."""
    x_ref, w_ref = refs[:2]
    r_ref = refs[2] if residual else None
    o_ref = refs[-1]
    tile, block_n = o_ref.shape
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    mask = None if tokens == tile else jax.lax.broadcasted_iota(jnp.int32, (tile, 1), 0) < tokens

    def step(i, acc):
        k = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + pltriton.dot(_rows(x_ref, (slice(None), k), mask), w_ref[k, cols])

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, jnp.zeros((tile, block_n), jnp.float32))
    product = acc.astype(o_ref.dtype)
    if r_ref is not None:
        residual = _rows(r_ref, (slice(None), cols), mask)
        product = (residual.astype(jnp.float32) + product.astype(jnp.float32)).astype(o_ref.dtype)
    if mask is None:
        o_ref[...] = product
    else:
        pltriton.store(o_ref, product, mask=mask)


def _call(x: jax.Array, w: jax.Array, r: jax.Array | None, name: str, tiling: Tiling | None) -> jax.Array:
    (t, k), n = x.shape, w.shape[1]
    block_n, block_k, stages = tiling = tiling or _tiling(n)
    if x.dtype != w.dtype or not _fits(x.dtype, k, n, tiling) or w.shape[0] != k or (
            r is not None and (r.shape != (t, n) or r.dtype != x.dtype)):
        raise ValueError(f"{name} needs x [T, K], w [K, N]{' and r [T, N]' if r is not None else ''} of one 16-bit "
                         f"float dtype with K % {block_k} == 0 and N % {block_n} == 0, got {x.shape} "
                         f"{x.dtype}, {w.shape} {w.dtype}" + ("" if r is None else f", {r.shape} {r.dtype}"))
    tp = max(MIN_ROWS, 1 << (t - 1).bit_length())  # Triton's tiles: a power of two
    stage = (tp + block_n) * block_k * x.dtype.itemsize  # an x tile and a w tile
    stages = max(1, min(stages, SHARED_BYTES // stage))  # fewer where many rows fill the shared memory
    whole = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))
    # x and r [T, *] in tiles of Tp rows, the rows past T masked (no padded copies); the output [T, N] alike
    inputs = [x, w] + [r] * (r is not None)
    return pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, residual=r is not None, tokens=t),
        out_shape=jax.ShapeDtypeStruct((t, n), x.dtype),
        grid=(n // block_n,),
        in_specs=[whole((tp, k)), whole((k, n))] + [whole((tp, n))] * (r is not None),
        out_specs=pl.BlockSpec((tp, block_n), lambda j: (0, j)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=stages),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_{name}_{k}x{n}",
    )(*inputs)


def matmul(x: jax.Array, w: jax.Array, tiling: Tiling | None = None) -> jax.Array:
    """x @ w rounded to x's dtype: x [T, K] and w [K, N] of one 16-bit dtype -> [T, N]. `tiling`: (block N,
    block K, stages), default the width's (a study's sweep sets it). Raises ValueError for what
    `matmul_supported` refuses."""
    return _call(x, w, None, "matmul", tiling)


def matmul_add(x: jax.Array, w: jax.Array, r: jax.Array, tiling: Tiling | None = None) -> jax.Array:
    """r + x @ w: x [T, K], w [K, N] and r [T, N] of one 16-bit dtype -> [T, N] (the product rounded to that
    dtype before the add, as `Linear` rounds it); `tiling` as `matmul`'s. Raises ValueError for what
    `matmul_supported` refuses."""
    return _call(x, w, r, "matmul_add", tiling)
