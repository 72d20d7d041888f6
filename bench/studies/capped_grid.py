"""LoRA kernels on a capped grid beside the base GEMMs, for #39 (GPU only).

At decode the LoRA kernels run on side streams beside the base GEMMs, and the GEMMs slow beside them (3.95 ->
4.28 ms of GEMM a step at batch 32 with one r=16 adapter, whose weights are 0.4 % of the step's bytes): the
LoRA kernels' programs take SMs the GEMMs would use. The shipped decode tiles spread the Pallas shrink over
about four programs per SM (split-K) and the expand over one program per 128 output columns. Here the same
kernels run with their grids capped at about C programs that do work: the shrink's K split only as far as C
allows, the expand's column blocks grouped until C covers them, so the GEMMs keep the other SMs and the LoRA
kernels take longer beside them.

Model: the 8B-shaped step (`bench/model.py`'s model, random weights) over contiguous rows (context 1024, query
at 512), the adapters' slots shuffled over the rows, compiled with the gather backend, with the Pallas backend at
its shipped tiles, and with the Pallas backend at each cap of `--caps`; timed in alternating rounds, one process.
Each variant's logits are compared with the gather step's. With `--caps ''` it compares the two backends alone,
the evidence for where `auto` switches (docs/kernels.md). JSON: capped_grid.json.

  python bench/studies/capped_grid.py [--cases 32x16x1,32x16x32,64x16x32,64x64x32] [--caps 16,32,66,132]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import row_recorder, time_variants, variants_row  # noqa: E402
from model import SLOTS, llama3_8b, random_lora, random_model, shuffled_slots  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora import ops, pallas  # noqa: E402
from jlora.pallas.config import expand_config, pow2_divisor, shrink_config  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def capped_configs(x, b, info, slice_sizes: tuple[int, ...], used_slots: int, cap: int):
    """(shrink, expand) decode tiles whose grids have about `cap` programs with work: the shipped tiles with
    the shrink's K split and the expand's column groups chosen for the segments that `used_slots` slots fill."""
    num_tokens, k = x.shape
    rank, slices = b.shape[2], len(slice_sizes)
    used_segments = min(num_tokens, used_slots) + -(-num_tokens // info.block_m) - 1
    shipped = shrink_config(num_tokens, k, slices * rank, info.block_m, x.dtype.itemsize, slices)
    blocks_k = k // shipped.block_k
    split = max([s for s in range(1, min(32, blocks_k // 4) + 1)
                 if blocks_k % s == 0 and used_segments * slices * s <= cap] or [1])
    expand = expand_config(num_tokens, slice_sizes, info.block_m, rank, defer_add=True)
    blocks = [-(-n // expand.block_n) for n in slice_sizes]
    group, limit = 1, pow2_divisor(math.gcd(*blocks), 64)
    while group < limit and used_segments * sum(blocks) // group > cap:
        group *= 2
    return dataclasses.replace(shipped, k_splits=split), dataclasses.replace(expand, group=group)


def capped_linear(x, base, a, b, info, scale=None, shift=None, *, slice_sizes, backend, defer_add=False,
                  used_slots: int, cap: int):
    """`ops._linear` with the Pallas kernels' grids capped (`capped_configs`)."""
    assert backend == "pallas" and defer_add, backend
    shrink, expand = capped_configs(x, b, info, slice_sizes, used_slots, cap)
    return pallas.linear(x, base, a, b, info, slice_sizes=slice_sizes, scale=scale, shift=shift,
                         shrink_config=shrink, expand_config=expand, defer_add=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x16x1,32x16x32,64x16x32,64x64x32", help="batch x rank x adapters")
    parser.add_argument("--caps", default="16,32,66,132")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "capped_grid.json")
    print(f"# gather against the Pallas kernels, their grids capped at {args.caps or 'none'}", flush=True)
    config = llama3_8b(32)
    model_def, params = random_model(config)
    loras, caps = {}, [int(c) for c in args.caps.split(",") if c]
    for case in args.cases.split(","):
        batch, rank, used = map(int, case.split("x"))
        lora = loras.setdefault(rank, random_lora(config, rank))
        cache, call = base_decode(config, batch, 1024, 512, False)
        slots = shuffled_slots(batch, used)
        call = Call(call.batch, slots, jnp.full(SLOTS, rank, jnp.int32))
        pallas = StepOptions(16, "pallas")
        steps = {"gather": (model_def, StepOptions(16, "gather"), None), "pallas": (copy.copy(model_def), pallas, None)}
        for cap in caps:
            linear = jax.jit(functools.partial(capped_linear, used_slots=used, cap=cap),
                             static_argnames=("slice_sizes", "backend", "defer_add"))
            steps[f"cap{cap}"] = (copy.copy(model_def), pallas,
                                  functools.partial(mock.patch.object, ops, "_linear", linear))
        got, cache = time_variants(params, call, cache, lora, steps)
        record(variants_row(f"decode B={batch} r={rank} adapters={used}", got, batch=batch, rank=rank, adapters=used))


if __name__ == "__main__":
    main()
