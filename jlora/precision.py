"""The precision of every matrix product: float32 operands get full float32 products (no TF32 on GPUs), so
`dtype="float32"` means float32 everywhere; half-precision operands use the hardware's default."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dot_precision"]


def dot_precision(dtype) -> jax.lax.Precision:
    """HIGHEST for float32 operands, DEFAULT for bf16 / fp16."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT
