"""Pieces the kernels share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dot_dim", "dot_precision", "segment_rows"]


def dot_dim(n: int) -> int:
    """The smallest power of two >= max(n, 16): what a `dot` dimension must be under the Triton lowering."""
    return max(16, 1 << (n - 1).bit_length())


def segment_rows(idx_ref, seg_start_ref, seg_len_ref, seg, num_rows: int, first=0) -> jax.Array:
    """[num_rows] token rows of segment `seg` from its row `first` on. Positions past the segment's end
    repeat its last token, so loads stay in bounds and duplicate stores write identical values (vLLM does
    the same); callers skip a part that starts past the end."""
    pos = seg_start_ref[seg] + jnp.minimum(first + jnp.arange(num_rows), seg_len_ref[seg] - 1)
    return idx_ref[pos]


def dot_precision(dtype) -> jax.lax.Precision:
    """f32 inputs get IEEE f32 products (no tf32), so f32 checks are exact; half types use the default."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
