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
    """Tiles of the expand kernel. Its grid is (segments, N / (block_n * group))."""

    block_n: int  # output columns per loop step
    group: int = 1  # column blocks per program (capped to a power of two dividing every slice's blocks)
    num_warps: int = 4
    num_stages: int = 2


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


_SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program, under Hopper's 227 KB per block
_NUM_SMS = 132  # H100 / H200


def shrink_config(num_tokens: int, k: int, width: int, block_m: int, itemsize: int = 2) -> ShrinkConfig:
    """Shrink tiles for T tokens, input width K, S·R output columns and row tile block_m.

    A shrink program streams [block_m, K] of x and [S·R, K] of A and does little arithmetic, so the kernel
    is bound by the bytes in flight. K is split over programs until about four programs per SM can run
    (the segments alone are few: 8 at decode with 8 adapters, 160 for T=8192 at block_m=64), keeping at
    least 512 columns per program. block_k is the largest power of two <= 256 dividing K whose pipelined
    tiles (num_stages x (block_m + S·R) x block_k) fit the shared-memory budget.
    """
    num_stages = 3 if num_tokens > 256 else 2
    block_k = pow2_divisor(k, 256)
    while block_k > 16 and num_stages * (block_m + width) * block_k * itemsize > _SMEM_BUDGET:
        block_k //= 2
    segments = -(-num_tokens // block_m)
    split = 1
    for cand in range(2, k // 512 + 1):
        if segments * split >= 4 * _NUM_SMS:
            break
        if k % (cand * block_k) == 0:
            split = cand
    return ShrinkConfig(block_k=block_k, k_splits=split, num_warps=4, num_stages=num_stages)


def expand_config(num_tokens: int, slice_sizes: tuple[int, ...]) -> ExpandConfig:
    """Expand tiles: block_n = 128 columns (capped by the slices' common power-of-two divisor).

    An expand program reads [block_m, R] of s, [block_n, R] of B and [block_m, block_n] of base, and writes
    the same; 128 columns of bf16 give 256-byte rows, enough for full-width loads, and keep the grid large.
    """
    block_n = min(pow2_divisor(n, 128) for n in slice_sizes)
    return ExpandConfig(block_n=block_n, num_warps=4, num_stages=2)
