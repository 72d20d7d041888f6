"""RMSNorm in one kernel per call, a program per token row.

XLA runs the model's norm as one fused kernel at most batch sizes, but as two (the sum of squares, then the
scaling) when the step has one token, and a decode step runs 65 norms in series between its GEMMs. Here each
program normalizes one row with the same operations whatever the number of rows, so a token's result does not
depend on the tokens beside it. The rounding is HF's: the row in f32 scaled by 1 / sqrt(mean(x²) + eps),
rounded to x's dtype, then times the weight in that dtype.

`add_rms_norm` takes the residual add before a norm into the same kernel: x + h rounded to x's dtype, as XLA's add
rounds it, then normalized. A decode step of one token, whose projections run as row reductions, otherwise runs
each add as a kernel of its own (XLA's GEMMs take it into their split-K sums, but its reductions do not).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["add_rms_norm", "rms_norm", "rms_norm_supported"]


def rms_norm_supported(hidden: int) -> bool:
    """The kernel loads a whole row as one tile: hidden a power of two >= 16."""
    return hidden >= 16 and hidden & (hidden - 1) == 0


def _kernel(*refs, eps: float, add: bool):
    """Program t normalizes row t of x (of x + h with `add`, the sum written too): refs are x, [h,] the weight,
    the output[, the sum]."""
    row = pl.ds(pl.program_id(0), 1)
    if add:
        x_ref, h_ref, w_ref, o_ref, s_ref = refs
        s = (x_ref[row, :].astype(jnp.float32) + h_ref[row, :].astype(jnp.float32)).astype(s_ref.dtype)
        s_ref[row, :] = s
    else:
        x_ref, w_ref, o_ref = refs
        s = x_ref[row, :]
    x = s.astype(jnp.float32)  # [1, H]
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    o_ref[row, :] = w_ref[...][None, :] * y.astype(o_ref.dtype)


def _call(inputs: tuple[jax.Array, ...], weight: jax.Array, eps: float, outputs: int, name: str):
    """The kernel over (x,) or (x, h), each [T, H]: its `outputs` arrays (the norm[, the sum]), each like x."""
    t, h = inputs[0].shape
    if not rms_norm_supported(h):
        raise ValueError(f"{name} needs a hidden size that is a power of two >= 16, got {h}")
    if t == 0:  # an empty grid is no launch
        return (inputs[0],) * outputs
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, add=len(inputs) == 2),
        out_shape=(jax.ShapeDtypeStruct(inputs[0].shape, inputs[0].dtype),) * outputs,
        grid=(t,),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=jax.default_backend() != "gpu",
        name=f"jlora_{name}_{h}",
    )(*inputs, weight.astype(inputs[0].dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight · (x / sqrt(mean(x²) + eps)) per row: x [T, H], weight [H] (x's dtype) -> [T, H]."""
    return _call((x,), weight, eps, 1, "rms_norm")[0]


def add_rms_norm(x: jax.Array, h: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(s, rms_norm(s)) for s = x + h rounded to x's dtype: x and h [T, H] of one dtype, weight [H]."""
    if h.dtype != x.dtype or h.shape != x.shape:
        raise ValueError(f"add_rms_norm needs x and h of one shape and dtype, got {x.shape} {x.dtype} and "
                         f"{h.shape} {h.dtype}")
    normed, s = _call((x, h), weight, eps, 2, "add_rms_norm")
    return s, normed
