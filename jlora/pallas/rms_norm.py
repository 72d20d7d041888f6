"""RMSNorm in one kernel per call, a program per token row.

XLA runs the model's norm as one fused kernel at most batch sizes, but as two (the sum of squares, then the
scaling) when the step has one token, and a decode step runs 65 norms in series between its GEMMs. Here each
program normalizes one row with the same operations whatever the number of rows, so a token's result does not
depend on the tokens beside it. The rounding is HF's: the row in f32 scaled by 1 / sqrt(mean(x²) + eps),
rounded to x's dtype, then times the weight in that dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["rms_norm", "rms_norm_supported"]


def rms_norm_supported(hidden: int) -> bool:
    """The kernel loads a whole row as one tile: hidden a power of two >= 16."""
    return hidden >= 16 and hidden & (hidden - 1) == 0


def _kernel(x_ref, w_ref, o_ref, *, eps: float):
    row = pl.ds(pl.program_id(0), 1)
    x = x_ref[row, :].astype(jnp.float32)  # [1, H]
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    o_ref[row, :] = w_ref[...][None, :] * y.astype(o_ref.dtype)


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
