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

__all__ = ["ShrinkConfig", "ExpandConfig", "shrink_config", "expand_config", "pow2_divisor"]


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
_NUM_SMS = 132  # H100 / H200


def shrink_config(
    num_tokens: int, k: int, width: int, block_m: int, itemsize: int = 2, num_slices: int = 1
) -> ShrinkConfig:
    """Shrink tiles for T tokens, input width K, S·R output columns (S = num_slices) and row tile block_m.

    A shrink program streams [block_m, K] of x and [S·R, K] of A and does little arithmetic, so the kernel
    is bound by the bytes in flight. block_k is the largest power of two <= 128 dividing K (`_block`) whose
    pipelined tiles (num_stages x (block_m + S·R) x block_k) fit the shared memory.
    At decode sizes the segments are few (8 with 8 adapters), so K is split over programs until about four
    programs per SM can run, each walking 4 blocks (at most 32 splits) through 3 pipeline stages with one warp
    at r=16, and the slices of a fused projection get programs of their own (x is tiny there; more, shorter
    programs hide latency). H200, T=64 with 8 r=16 adapters, device µs per call, one process: shrink 2.86, down
    shrink 4.94, q|k|v lora_linear 7.51, against 2.95 / 5.33 / 7.63 with 2 blocks of 128 / 256 columns, 2 stages
    and 2 warps; 8 blocks per program lost (down shrink 5.24), and 2 warps were level or up to 0.1 µs slower.
    `bench/kernels.py --sweep shrink,linear --max-tokens 64` over these tiles afterwards: these tiles were the
    fastest or within 0.2 µs of it on every row it reached (T=64: shrink 2.9, down shrink 5.0, q|k|v linear 7.5;
    T=32 with 32 adapters: q|k|v 12.4 against 12.2, o 8.7, gate|up 23.3 against 23.1). Those rows have r=16; a
    program's dot grows with its slice's rank R, so it gets R / 16 warps, up to 4. H200, T=64, device µs per
    call, with 8 / 32 adapters: r=64 shrink 4.2 / 7.7, q|k|v shrink 7.4 / 16.6, down shrink 8.6 / 19.0 against
    6.2 / 8.0, 9.2 / 19.1, 9.8 / 21.1 with one warp (`--sweep shrink --rank 64`: the best tiles 4.1 / 7.6, 7.2 /
    16.1, 8.5 / 18.4); r=32 with 2 warps 3.3 / 5.6, 5.3 / 10.2, 6.5 / 12.3 against 4.2 / 5.8, 5.8 / 10.0, 6.8 /
    12.0 with one (other tiles as here).
    At prefill sizes one wave of programs is enough, and the f32 partial sums of a split must stay a
    small share of the traffic. Measured on an H200 (bench/kernels.py --sweep): T=8192 r=64 shrink 29.3 µs
    at k_splits=2, q|k|v shrink 44.6 µs at k_splits=1 (66.6 µs at 8 splits), down shrink 77.5 µs at 2
    (95.7 µs at 7).
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
    target = 4 * _NUM_SMS if decode else _NUM_SMS
    split = 1
    for cand in range(2, max_split + 1):
        if segments * split >= target:
            break
        if (k // block_k) % cand == 0:  # the splits share K's full blocks
            split = cand
    warps = min(4, max(1, width // num_slices // 16)) if decode else 4
    return ShrinkConfig(block_k=block_k, k_splits=split, split_slices=decode, num_warps=warps, num_stages=num_stages)


def expand_config(num_tokens: int, slice_sizes: tuple[int, ...], block_m: int, rank: int = 16) -> ExpandConfig:
    """Expand tiles for T tokens in segments of block_m rows and B of (padded) rank R: block_n = 128
    columns (capped by the slices' common power-of-two divisor).

    An expand program reads [block_rows, R] of s, [block_n, R] of B and [block_rows, block_n] of base, and
    writes the same; 128 columns of bf16 give 256-byte rows, enough for full-width loads, and keep the grid
    large. Slots at the full rank take the fast path (`full_rank_branch`). At decode sizes a program takes
    one column block of its whole segment, with 2 warps (H200, device time, one process, T=32 with 32
    r=16 adapters: expand 3.9 µs, q|k|v 5.4, gate|up 16.7, against 4.8 / 6.2 / 21.4 with 4 warps and the
    mask on every slot; T=64 with 8 adapters: expand 2.8 / 2.9, gate|up 7.6 / 8.4), and with 4 warps at
    R >= 32 (H200, T=64, `--sweep expand --rank 64`, with 8 / 32 adapters: expand 4.5 / 8.6, q|k|v 5.5 /
    11.1, gate|up 14.4 / 39.8 against 4.7 / 10.3, 5.7 / 13.0, 15.7 / 44.2 with 2; 4 warps were the
    fastest or within 0.1 µs of the best block_n and warps on all six rows; r=32: 3.2 / 5.6, 4.0 / 7.2,
    9.3 / 23.5 against 3.2 / 5.9, 4.0 / 7.7, 9.3 / 23.6 with 2). At prefill sizes it
    takes 32 rows and loops over up to 8 column blocks (3 pipeline stages) while at least 1024 programs
    (about 8 per SM) remain. Measured on an H200 at T=8192, r=64, 32 adapters (device time, one process,
    scratch A/Bs; N=4096 / q|k|v / gate|up): 47.5 / 68.6 / 293.5 µs, against 51.2 / 73.1 / 327.1 with
    64-row programs over 4 blocks and no identity dot, and 53.7 / 81.1 / 386.1 with one 64 x 128 block per
    program and the mask on every slot. 32-row programs beat 16 (52.7 / 77.3 / 341.3) and 64 (62.9 / 93.8 /
    414.3 over 4 blocks); 2 warps, 2 stages lose; a block_m of 32 for the whole batch would slow the prefill
    shrinks by 15-20 % (A re-read).
    The base's read-add-write bounds these rows: the same kernel without the LoRA product takes 37.1 µs
    for N=4096 and 246.6 for gate|up in those A/Bs (3.6 and 3.8 TB/s; bench/expand_limits.py times it).
    At prefill sizes the grid is launched as one axis with the column groups fastest (`segments_first`):
    H200, bench/kernels.py --profile, two runs against the two-axis grid in one device session (µs):
    N=4096 46.4 / 46.3 against 47.1, q|k|v 67.2 / 67.1 against 68.7, gate|up 282.8 / 281.8 against 294.4.
    At decode sizes it lost (gate|up 8.7 against 7.5 at T=64 with 8 adapters), as it did for the shrink
    kernel (decode shrink 3.3 against 2.9, T=8192 down shrink 74.4 / 74.7 against 72.7).
    """
    block_n = min(_block(n, 128) for n in slice_sizes)
    if num_tokens <= 256:
        return ExpandConfig(block_n=block_n, num_warps=4 if rank >= 32 else 2, num_stages=2)
    block_rows = min(32, block_m)
    blocks = -(-num_tokens // block_rows) * (sum(slice_sizes) // block_n)  # programs at one block each
    group = 1
    while group < 8 and blocks // (2 * group) >= 1024:
        group *= 2
    return ExpandConfig(block_n=block_n, group=group, block_rows=block_rows, segments_first=True, num_warps=4,
                        num_stages=3)
