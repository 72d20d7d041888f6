"""RMSNorm in one kernel per call, a program per token row.

XLA runs the model's norm as one fused kernel at most batch sizes, but as two (the sum of squares, then the
scaling) when the step has one token, and a decode step runs 65 norms in series between its GEMMs. Here each
program normalizes one row with the same operations whatever the number of rows, so a token's result does not
depend on the tokens beside it. The rounding is HF's: the row in f32 scaled by 1 / sqrt(mean(x²) + eps),
rounded to x's dtype, then times the weight in that dtype. A row wider than a tile (a hidden size that is not a
power of two, such as 3072 or 3584) is loaded as up to 16 equal power-of-two chunks, kept in registers for the scaling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jlora.pallas.config import pow2_divisor

__all__ = ["rms_norm", "rms_norm_supported"]


_MAX_CHUNKS = 16


def _chunk(hidden: int) -> int:
    """Columns per chunk of a row: the largest power of two dividing `hidden`."""
    return pow2_divisor(hidden, hidden)


def rms_norm_supported(hidden: int) -> bool:
    """The kernel walks a row in chunks of a power of two >= 16 columns, at most 16 of them: every power of two
    >= 16, and hidden sizes such as 896 (7 x 128), 2304 (9 x 256), 3072 (3 x 1024) or 3584 (7 x 512)."""
    c = _chunk(hidden) if hidden > 0 else 0
    return c >= 16 and hidden // c <= _MAX_CHUNKS


def _kernel(x_ref, w_ref, o_ref, *, eps: float, chunk: int):
    h = x_ref.shape[1]
    row = pl.ds(pl.program_id(0), 1)
    chunks = [pl.ds(j * chunk, chunk) for j in range(h // chunk)]
    xs = [x_ref[row, cols].astype(jnp.float32) for cols in chunks]  # [1, chunk] each, all loads issued at once
    squares = xs[0] * xs[0]
    for x in xs[1:]:  # the chunks' squares summed elementwise in chunk order
        squares += x * x
    scale = jax.lax.rsqrt(jnp.sum(squares, axis=1, keepdims=True) / h + eps)  # [1, 1]
    for x, cols in zip(xs, chunks):
        o_ref[row, cols] = w_ref[cols][None, :] * (x * scale).astype(o_ref.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight · (x / sqrt(mean(x²) + eps)) per row: x [T, H], weight [H] (x's dtype) -> [T, H]."""
    t, h = x.shape
    if not rms_norm_supported(h):
        raise ValueError(f"rms_norm needs a hidden size of at most {_MAX_CHUNKS} chunks of a power of two >= 16 "
                         f"columns, got {h}")
    if t == 0:  # an empty grid is no launch
        return x
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, chunk=_chunk(h)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(t,),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_rms_norm_{h}",
    )(x, weight.astype(x.dtype))
