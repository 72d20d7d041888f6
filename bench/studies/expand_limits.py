"""What bounds the prefill expand (GPU only): T=8192 tokens, 32 adapters of rank 64, N=4096 and gate|up.

Times, the way bench/kernels.py does (device time, 32 calls), variants of the expand kernel's inner step
next to jlora's own kernel and XLA's plain read-add-write of the base:
  rmw     the base read, add 0, write; no LoRA product (the memory traffic alone)
  bare    the LoRA product without the rank masks (every slot read to the full R)
  masked  the rank masks on every slot (s columns and B loads past the rank), as jlora's kernel has them at
          decode sizes and, at prefill sizes, for slots below the full rank
  chunks  B read in 16-column chunks up to the rank by a loop, instead of a masked load

  python bench/studies/expand_limits.py
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import jlora
from jlora.pallas.common import segment_rows
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from kernels import CALLS, STACKS, device_time_per_call, make_info, make_inputs  # noqa: E402

BLOCK_M, BLOCK_N = 64, 128


def _kernel(idx_ref, start_ref, len_ref, slot_ref, ranks_ref, s_ref, b_ref, base_ref, o_ref, *, variant):
    seg, g = pl.program_id(0), pl.program_id(1)

    @pl.when(len_ref[seg] > 0)
    def _():
        slot, rank = slot_ref[seg], b_ref.shape[2]
        rows = segment_rows(idx_ref, start_ref, len_ref, seg, BLOCK_M)
        cols = pl.ds(pl.multiple_of(g * BLOCK_N, BLOCK_N), BLOCK_N)
        col, slot_rank = jnp.arange(rank)[None, :], ranks_ref[slot]
        r = pl.ds(0, rank)  # the first slice's s for every column: the real kernel's work, not its values
        acc = base_ref[rows, cols].astype(jnp.float32)  # [BM, BN]
        if variant == "chunks":
            def chunk(c, acc):
                rc = pl.ds(pl.multiple_of(c * 16, 16), 16)
                s = jnp.where(c * 16 + jnp.arange(16)[None, :] < slot_rank, s_ref[rows, rc], 0)
                return acc + pltriton.dot(s.astype(b_ref.dtype), b_ref[slot, cols, rc], trans_b=True)
            acc = jax.lax.fori_loop(0, (slot_rank + 15) // 16, chunk, acc)
        elif variant == "masked":
            s = jnp.where(col < slot_rank, s_ref[rows, r], 0).astype(b_ref.dtype)
            b = pltriton.load(b_ref.at[slot, cols, :], mask=col // 16 * 16 < slot_rank, other=0)
            acc += pltriton.dot(s, b, trans_b=True)
        elif variant == "bare":
            acc += pltriton.dot(s_ref[rows, r].astype(b_ref.dtype), b_ref[slot, cols, :], trans_b=True)
        o_ref[rows, cols] = acc.astype(o_ref.dtype)


def _expand(s, b, info, base, variant):
    return pl.pallas_call(
        functools.partial(_kernel, variant=variant),
        out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype),
        grid=(info.num_segments, base.shape[1] // BLOCK_N),
        input_output_aliases={7: 0},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name=f"expand_{variant}",
    )(info.sorted_idx, info.seg_start, info.seg_len, info.seg_slot, info.ranks, s, b, base)


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"# {jax.devices()[0].device_kind}: T=8192, 32 adapters, r=64, block_m={BLOCK_M}, block_n={BLOCK_N}")
    for op in ("expand", "gate_up_expand"):
        _, slices, slots, (ss, bs, y), _ = make_inputs(op, 8192, 32, 64, rng)
        info = make_info(slots, 64, BLOCK_M)
        for variant in ("rmw", "bare", "masked", "chunks", "jlora"):
            def fn(info, ss, bs, y):
                for i, s in enumerate(ss):
                    y = (jlora.pallas.expand(s, bs[i % STACKS], info, y, slice_sizes=slices) if variant == "jlora"
                         else _expand(s, bs[i % STACKS], info, y, variant))
                return y
            sec, _ = device_time_per_call(jax.jit(fn), info, ss, bs, y)
            print(f"{op:15s} {variant:7s} {sec * 1e6:7.1f} µs  base read+write {2 * y.nbytes / sec / 1e12:.2f} TB/s",
                  flush=True)
        sec, _ = device_time_per_call(jax.jit(lambda ys: [v + 1 for v in ys]), [y + i for i in range(CALLS)])
        print(f"{op:15s} {'XLA +1':7s} {sec * 1e6:7.1f} µs  base read+write {2 * y.nbytes / sec / 1e12:.2f} TB/s")
        del ss, bs, y


if __name__ == "__main__":
    main()
