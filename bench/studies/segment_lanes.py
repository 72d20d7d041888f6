"""The segmented Pallas LoRA kernels over segment lanes against a program per segment, for #39.

The shrink and expand grids hold a program per segment a batch may have, cdiv(T, block_m) + L (L the slots); at
batch 32 with 32 slots and one adapter 32 of every 34 find no segment and exit, and the step is 2.8 % slower
than over 4 slots (`bench/studies/slot_count.py`). With `lanes` (`ShrinkConfig` / `ExpandConfig`) a kernel
holds that many programs along the segments, each looping over every lanes-th segment in use
(`jlora.pallas.common.for_segments`). Here lanes = c x cdiv(T, block_m) for each c of `--per-tile`: with c = 1
one adapter's segments get a program each and 32 adapters' 16 each loop in series.

Model: the 8B-shaped decode step (`bench/model.py`'s model and adapters, 32 slots; each batch as `bench/model.py`
runs it), the slots shuffled over the rows, on the Pallas LoRA backend at its shipped tiles and with lanes;
timed in alternating rounds, one process; each variant's logits compared with the shipped step's. JSON:
segment_lanes.json.

  python bench/studies/segment_lanes.py [--cases 32x16x1,32x16x32,64x16x32,32x64x1] [--per-tile 1,2,4]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import count_and_time, row_recorder  # noqa: E402
from model import SLOTS, engine_config, engine_layout, llama3_8b, random_lora, random_model  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora import ops, pallas  # noqa: E402
from jlora.pallas.config import expand_config, shrink_config  # noqa: E402
from jlora.runner import forward  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def lanes_linear(x, base, a, b, info, scale=None, shift=None, *, slice_sizes, backend, defer_add=False,
                 per_tile: int):
    """`ops._linear` on the Pallas kernels at their shipped tiles with lanes = per_tile x cdiv(T, block_m)."""
    if backend != "pallas":
        return ops._linear.__wrapped__(x, base, a, b, info, scale, shift, slice_sizes=slice_sizes, backend=backend,
                                       defer_add=defer_add)
    num_tokens, k = x.shape
    lanes = per_tile * -(-num_tokens // info.block_m)
    rank, slices = b.shape[2], len(slice_sizes)
    shrink = shrink_config(num_tokens, k, slices * rank, info.block_m, x.dtype.itemsize, slices)
    expand = expand_config(num_tokens, slice_sizes, info.block_m, rank, defer_add)
    return pallas.linear(x, base, a, b, info, slice_sizes=slice_sizes, scale=scale, shift=shift,
                         shrink_config=dataclasses.replace(shrink, lanes=lanes),
                         expand_config=dataclasses.replace(expand, lanes=lanes), defer_add=defer_add)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x16x1,32x16x32,64x16x32,32x64x1", help="batch x rank x adapters")
    parser.add_argument("--per-tile", default="1,2,4", help="lanes per row tile of the batch")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "segment_lanes.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    loras = {}
    for case in args.cases.split(","):
        batch, rank, used = map(int, case.split("x"))
        lora = loras.setdefault(rank, random_lora(config, rank))
        stored_def, stored = engine_layout(model_def, params, batch)
        cache, call = base_decode(config, batch, 1024, 512, False)
        slots = jnp.asarray(np.random.default_rng(0).permutation(np.arange(batch) % used), jnp.int32)
        call = Call(call.batch, slots, jnp.full(SLOTS, rank, jnp.int32))
        options = StepOptions(16, "pallas", attention_chunk=engine_config(batch).attention_chunk(config.num_kv_heads))
        variants = {"shipped": (stored_def, None)}
        variants |= {f"lanes {c}x": (copy.copy(stored_def), int(c)) for c in args.per_tile.split(",")}
        logits, runs = {}, {}
        for name, (mdef, per_tile) in variants.items():
            linear = ops._linear if per_tile is None else jax.jit(
                functools.partial(lanes_linear, per_tile=per_tile), static_argnames=("slice_sizes", "backend",
                                                                                     "defer_add"))
            with mock.patch.object(ops, "_linear", linear):  # the copy's step traces with it
                logits[name], cache = forward(mdef, stored, call, cache, lora, options)
            runs[name] = lambda c, mdef=mdef: forward(mdef, stored, call, c, lora, options)
        got, cache = count_and_time(runs, cache)
        ms, kernels = got["ms"], got["kernels"]
        row = dict(batch=batch, rank=rank, adapters=used, ms=ms, kernels=kernels,
                   logits_equal={n: bool(jnp.array_equal(v, logits["shipped"])) for n, v in logits.items()})
        print(f"decode B={batch} r={rank} adapters={used}: " + ", ".join(
            f"{n} {t:.3f} ms ({t / ms['shipped']:.3f}x, {kernels[n]} kernels, same logits {row['logits_equal'][n]})"
            for n, t in ms.items()), flush=True)
        record(row)


if __name__ == "__main__":
    main()
