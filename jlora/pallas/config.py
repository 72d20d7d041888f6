"""Tile settings of the Pallas kernels and the heuristics that pick them.

Rules the Triton lowering imposes: every loaded or stored block is a power of two in each dimension, and
every `dot` dimension is >= 16. So the row tile (`LoRABatchInfo.block_m`), the rank R, `block_k` and
`block_n` are powers of two >= 16; `block_k` divides K and `block_n` divides every output slice, so no
column mask is needed on gathered rows (masked gathers do not run in interpret mode).
"""

from __future__ import annotations

import dataclasses

__all__ = ["ShrinkConfig", "ExpandConfig", "shrink_config", "expand_config", "pow2_divisor"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShrinkConfig:
    """Tiles of the shrink kernel. Its grid is (segments, k_splits); each program walks K / k_splits."""

    block_k: int  # K columns per step of a program's loop
    k_splits: int  # programs sharing one segment's K (split-K); partial sums are added by the consumer
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpandConfig:
    """Tiles of the expand kernel. Its grid is (segments, N / block_n)."""

    block_n: int  # output columns per program
    num_warps: int = 4
    num_stages: int = 2


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def shrink_config(num_tokens: int, k: int) -> ShrinkConfig:
    """Shrink tiles for T tokens and input width K.

    A shrink program reads [block_m, K] of x and [R, K] of A per slice and does little arithmetic, so the
    kernel is bound by how many bytes are in flight. At prefill sizes the segments alone fill the GPU (T=8192
    gives >= 128 segments at block_m=64), so each program walks all of K. At decode sizes there are only a
    few segments, so K is split over programs of 512 columns each (8 for K=4096, 28 for K=14336): one
    program per SM or more, each streaming its share of A.
    """
    block_k = pow2_divisor(k, 256 if num_tokens > 256 else 128)
    if num_tokens > 256:
        return ShrinkConfig(block_k=block_k, k_splits=1, num_warps=8, num_stages=3)
    split = max(1, k // 512) if k % 512 == 0 else 1
    return ShrinkConfig(block_k=block_k, k_splits=split, num_warps=4, num_stages=2)


def expand_config(num_tokens: int, slice_sizes: tuple[int, ...]) -> ExpandConfig:
    """Expand tiles: block_n = 128 columns (capped by the slices' common power-of-two divisor).

    An expand program reads [block_m, R] of s, [block_n, R] of B and [block_m, block_n] of base, and writes
    the same; 128 columns of bf16 give 256-byte rows, enough for full-width loads, and keep the grid large.
    """
    cap = 256 if num_tokens > 256 else 128
    block_n = min(pow2_divisor(n, cap) for n in slice_sizes)
    return ExpandConfig(block_n=block_n, num_warps=4, num_stages=2)
