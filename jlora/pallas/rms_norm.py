"""RMSNorm in one kernel per call, a program per token row.

XLA runs the model's norm as one fused kernel at most batch sizes, but as two (the sum of squares, then the
scaling) when the step has one token, and a decode step runs 65 norms in series between its GEMMs. Here each
program normalizes one row with the same operations whatever the number of rows, so a token's result does not
depend on the tokens beside it. The rounding is HF's: the row in f32 scaled by 1 / sqrt(mean(x²) + eps),
rounded to x's dtype, then times the weight in that dtype.

`residual_rms_norm` also takes in the residual add before the norm, from the split-K partial sums of the
projection that feeds it: XLA runs that add as one kernel with the GEMM's split-K sum and the norm as another,
and this is one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["residual_rms_norm", "rms_norm", "rms_norm_supported"]


def rms_norm_supported(hidden: int) -> bool:
    """The kernel loads a whole row as one tile: hidden a power of two >= 16."""
    return hidden >= 16 and hidden & (hidden - 1) == 0


def _normalize(x: jax.Array, w_ref, o_ref, row, eps: float) -> None:
    """Writes row `row` of o: the row x [1, H] f32 scaled, rounded to o's dtype, times the weight."""
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    o_ref[row, :] = w_ref[...][None, :] * y.astype(o_ref.dtype)


def _kernel(x_ref, w_ref, o_ref, *, eps: float):
    row = pl.ds(pl.program_id(0), 1)
    _normalize(x_ref[row, :].astype(jnp.float32), w_ref, o_ref, row, eps)


def _residual_kernel(p_ref, r_ref, w_ref, h_ref, o_ref, *, eps: float):
    row = pl.ds(pl.program_id(0), 1)
    y = p_ref[0, row, :]  # [1, H] f32: the split-K partial sums, added in split order
    for s in range(1, p_ref.shape[0]):
        y += p_ref[s, row, :]
    # The projection's output rounded to the activations' dtype, then the residual add in that dtype.
    h = (r_ref[row, :].astype(jnp.float32) + y.astype(h_ref.dtype).astype(jnp.float32)).astype(h_ref.dtype)
    h_ref[row, :] = h
    _normalize(h.astype(jnp.float32), w_ref, o_ref, row, eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight · (x / sqrt(mean(x²) + eps)) per row: x [T, H], weight [H] (x's dtype) -> [T, H]."""
    t, h = x.shape
    if not rms_norm_supported(h):
        raise ValueError(f"rms_norm needs a hidden size that is a power of two >= 16, got {h}")
    if t == 0:  # an empty grid is no launch
        return x
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(t,),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_rms_norm_{h}",
    )(x, weight.astype(x.dtype))


def residual_rms_norm(partials: jax.Array, residual: jax.Array, weight: jax.Array,
                      eps: float) -> tuple[jax.Array, jax.Array]:
    """(h, rms_norm(h)) with h = residual + the projection's output, rounded as the model rounds: partials
    [S, T, H] f32 (a projection's split-K partial sums, added in split order and rounded to residual's dtype),
    residual [T, H], weight [H] -> ([T, H], [T, H])."""
    _, t, h = partials.shape
    if not rms_norm_supported(h):
        raise ValueError(f"residual_rms_norm needs a hidden size that is a power of two >= 16, got {h}")
    if t == 0:
        return residual, residual
    out = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    return pl.pallas_call(
        functools.partial(_residual_kernel, eps=eps),
        out_shape=(out, out),
        grid=(t,),
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_residual_rms_norm_{h}",
    )(partials.astype(jnp.float32), residual, weight.astype(residual.dtype))
