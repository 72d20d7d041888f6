"""Tile settings of the Pallas kernels and the heuristics that pick them.

Rules the Triton lowering imposes: every loaded or stored block is a power of two in each dimension, and
every `dot` dimension is >= 16. So the row tile (`LoRABatchInfo.block_m`), the rank R, `block_k` and
`block_n` are powers of two >= 16. Where they divide K and the output slices, every block is aligned; where
not, the kernels add one last block that ends at the edge and overlaps the one before (masked loads of
gathered rows do not run in interpret mode, so no block reaches past the edge): K >= block_k and every
slice >= block_n.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TypeVar

import jax

T = TypeVar("T")

__all__ = ["ShrinkConfig", "ExpandConfig", "shrink_config", "expand_config", "delta_expand", "pow2_divisor",
           "num_sms", "by_device"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShrinkConfig:
    """Tiles of the shrink kernel. Its grid is (segments, k_splits, 1 or slices); each program walks
    K / k_splits."""

    block_k: int  # K columns per step of a program's loop
    k_splits: int  # programs sharing one segment's K (split-K); partial sums are added by the consumer
    split_slices: bool = False  # one program per slice (more programs) instead of all slices sharing x
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpandConfig:
    """Tiles of the expand kernel. Its grid is (segments x block_m / block_rows, N / (block_n * group)), or
    their product as one axis with `segments_first`."""

    block_n: int  # output columns per loop step
    group: int = 1  # column blocks per program (capped to a power of two dividing every slice's blocks)
    block_rows: int | None = None  # rows per program: block_m (None) or a power-of-two part of it, >= 16
    full_rank_branch: bool = True  # slots at the full rank R take a fast path (see jlora.pallas.expand)
    segments_first: bool = False  # launch the grid as one axis, the used segments' programs first
    delta: bool = False  # write the delta alone, added to the base by XLA, instead of into the base's buffer
    num_warps: int = 4
    num_stages: int = 2


def _block(n: int, cap: int) -> int:
    """A power-of-two tile >= 16 for a dimension of n >= 16: the largest dividing n, up to cap, else the
    largest <= min(n, cap) (then a last overlapping block covers the rest)."""
    d = pow2_divisor(n, cap)
    return d if d >= 16 else 1 << (min(n, cap).bit_length() - 1)


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles per program, under Hopper's 227 KB per block


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the default device, which the grid rules scale with: 132 where the device
    does not say (the H100 / H200 the rules were measured on; interpret mode on the CPU)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) if device.platform == "gpu" else None) or 132


def by_device(table: dict[str, T], default: T) -> T:
    """The value of the first entry of `table` whose name is whole words of the default device's kind ("H200" for
    an "NVIDIA H200" or "NVIDIA H200 NVL", not an "NVIDIA GH200 480GB"), else `default`: a rule measured on one
    card that another card's measurements did not bear."""
    kind = f" {jax.devices()[0].device_kind} "
    return next((value for name, value in table.items() if f" {name} " in kind), default)


def shrink_config(
    num_tokens: int, k: int, width: int, block_m: int, itemsize: int = 2, num_slices: int = 1
) -> ShrinkConfig:
    """Shrink tiles for T tokens, input width K, S·R output columns (S = num_slices) and row tile block_m.

    A shrink program streams [block_m, K] of x and [S·R, K] of A and does little arithmetic, so the kernel is
    bound by the bytes in flight and, at decode sizes, by the latency of its loads. block_k is the largest
    power of two <= 128 dividing K (`_block`) whose pipelined tiles fit the shared memory. At decode sizes the
    segments are few, so K is split over programs until about four per SM can run, each walking 4 blocks
    through 3 stages; a fused projection's slices get programs of their own, and a program gets R/16 warps
    (up to 4). At prefill sizes one wave of programs is enough, and the splits' f32 partial sums must stay a
    small share of the traffic. The sweeps behind these rules: docs/kernels.md, "Tiles and why".
    """
    decode = num_tokens <= 256
    num_stages = 3
    block_k = _block(k, 128)
    while block_k > 16 and num_stages * (block_m + width) * block_k * itemsize > SMEM_BUDGET:
        block_k //= 2
    segments = -(-num_tokens // block_m) * (num_slices if decode else 1)  # programs per K split
    # At prefill sizes the f32 partial sums (k_splits x T x S·R x 4 bytes, written and read back) must stay
    # small next to x (T x K x 2 bytes): at most a tenth of it.
    max_split = min(32, k // (4 * block_k)) if decode else max(1, k // (20 * width))
    target = 4 * num_sms() if decode else num_sms()
    split = 1
    for cand in range(2, max_split + 1):
        if segments * split >= target:
            break
        if (k // block_k) % cand == 0:  # the splits share K's full blocks
            split = cand
    warps = min(4, max(1, width // num_slices // 16)) if decode else 4
    return ShrinkConfig(block_k=block_k, k_splits=split, split_slices=decode, num_warps=warps, num_stages=num_stages)


def delta_expand(num_tokens: int, defer_add: bool) -> bool:
    """Whether an expand of T tokens writes its delta to a buffer of its own, added to the base by XLA, rather
    than adding it into the base's buffer: where the caller defers the add (a model step, whose next kernel
    takes the add in) and at decode sizes (T <= 256). The expand then no longer waits for the base GEMM and runs
    beside it: 4.6-8.4 % off the 8B decode steps with r=64 adapters at batch 32 and 64; the prefill steps were
    level (docs/kernels.md, "The deferred add")."""
    return defer_add and num_tokens <= 256


def expand_config(num_tokens: int, slice_sizes: tuple[int, ...], block_m: int, rank: int = 16,
                  defer_add: bool = False) -> ExpandConfig:
    """Expand tiles for T tokens in segments of block_m rows and B of (padded) rank R.

    An expand program reads [block_rows, R] of s, [block_n, R] of B and [block_rows, block_n] of base, and
    writes the same. block_n is 128 columns (256-byte bf16 rows: full-width loads and a large grid), capped
    by the slices' common power-of-two divisor. At decode sizes a program takes one column block of its whole
    segment with 2 warps (4 at R >= 32). At prefill sizes, where the base's read-add-write bounds the kernel,
    a program takes 32 rows and loops over up to 8 column blocks through 3 stages while about 8 programs per
    SM remain, and the grid runs as one axis with the used segments' programs first (`segments_first`).
    With `defer_add`, `delta_expand` decides whether the kernel writes the delta alone.
    Evidence: docs/kernels.md, "Tiles and why".
    """
    block_n, delta = min(_block(n, 128) for n in slice_sizes), delta_expand(num_tokens, defer_add)
    if num_tokens <= 256:
        return ExpandConfig(block_n=block_n, num_warps=4 if rank >= 32 else 2, num_stages=2, delta=delta)
    block_rows = min(32, block_m)
    blocks = -(-num_tokens // block_rows) * (sum(slice_sizes) // block_n)  # programs at one block each
    group = 1
    while group < 8 and blocks // (2 * group) >= 1024:
        group *= 2
    return ExpandConfig(block_n=block_n, group=group, block_rows=block_rows, segments_first=True, num_warps=4,
                        num_stages=3, delta=delta)
