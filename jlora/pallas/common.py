"""Pieces the kernels share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlora.precision import dot_precision

__all__ = ["dot_dim", "dot_precision", "segment_meta", "segment_rows"]


def dot_dim(n: int) -> int:
    """The smallest power of two >= max(n, 16): what a `dot` dimension must be under the Triton lowering."""
    return max(16, 1 << (n - 1).bit_length())


def segment_rows(idx_ref, seg_start_ref, seg_len_ref, seg, num_rows: int, first=0) -> jax.Array:
    """[num_rows] token rows of segment `seg` from its row `first` on. Positions past the segment's end
    repeat its last token, so loads stay in bounds and duplicate stores write identical values (vLLM does
    the same); callers skip a part that starts past the end. An unused segment (length 0) gives its first
    position's token, in bounds too, so the rows may be read before the caller's branch. (Wrapping the
    positions past the end around the segment instead was slower: docs/kernels.md.)"""
    pos = seg_start_ref[seg] + jnp.minimum(first + jnp.arange(num_rows), jnp.maximum(seg_len_ref[seg] - 1, 0))
    return idx_ref[pos]


def segment_meta(idx_ref, seg_start_ref, seg_len_ref, seg_slot_ref, seg, num_rows: int, first=0):
    """(length, slot, [num_rows] token rows from row `first` on) of segment `seg`, for every program.

    The kernels read these before branching on the length: inside the branch, each load waited for the one
    before it (length -> start -> token index -> x or base row, and slot -> rank), and the decode kernels
    are bound by that latency (docs/kernels.md). An unused segment's slot reads as 0, so slot lookups stay
    in bounds.
    """
    rows = segment_rows(idx_ref, seg_start_ref, seg_len_ref, seg, num_rows, first)
    return seg_len_ref[seg], jnp.maximum(seg_slot_ref[seg], 0), rows


