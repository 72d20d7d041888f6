"""The decode step against the number of adapter slots the GPU holds, with the same adapters in use, for #39.

The segmented Pallas kernels' grids have a program per segment a batch may hold, min(T, cdiv(T, block_m) + L)
(L the slots), whatever the batch holds: at batch 32 with 32 slots the expand of gate|up runs 32 x 224 programs,
and with one adapter in use 30 of every 32 find no segment and exit (at 4 slots, 4 of every 6). This times the same
step (the same adapters on the same rows) over stacks of L slots, so the only change is what grows with L: the
programs that exit, and the LoRA metadata's [L] arrays.

Model: the 8B-shaped decode step (`bench/model.py`'s random model; 1024 positions a request, query at 512;
each batch as `bench/model.py` runs it), the adapters random over the stack's first slots, one for every row
or one per row; each case's L in alternating rounds. JSON: slot_count.json.

  python bench/studies/slot_count.py [--batch 32] [--rank 16] [--slots 4,32,128] [--adapters 1,32] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import count_and_time, row_recorder  # noqa: E402
from model import engine_config, engine_layout, llama3_8b, random_lora, random_model, shuffled_slots  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora.runner import forward  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", default="4,32,128", help="stack sizes L to compare")
    parser.add_argument("--adapters", default="1,32", help="adapters in use (each over the stacks that hold them)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "slot_count.json")
    config = llama3_8b(32)
    model_def, params = engine_layout(*random_model(config), args.batch)
    sizes = sorted(map(int, args.slots.split(",")))
    full = random_lora(config, args.rank, sizes[-1])  # the smaller stacks are its first slots: the same adapters
    stacks = {size: jax.tree.map(lambda x, size=size: x[:size], full) for size in sizes}
    cache, call = base_decode(config, args.batch, 1024, 512, False)
    options = StepOptions(16, args.backend, attention_chunk=engine_config(args.batch).attention_chunk(
        config.num_kv_heads))
    for adapters in map(int, args.adapters.split(",")):
        slots = shuffled_slots(args.batch, adapters)
        runs = {}
        for size, lora in stacks.items():
            if size < adapters:
                continue
            step = Call(call.batch, slots, jnp.full(size, args.rank, jnp.int32))
            runs[size] = lambda c, step=step, lora=lora: forward(model_def, params, step, c, lora, options)
        logits = {}
        for size, run in runs.items():  # the cache threads through every call (the step donates it)
            logits[size], cache = run(cache)
        got, cache = count_and_time(runs, cache)
        ms, kernels = got["ms"], got["kernels"]
        first = next(iter(runs))
        row = dict(case=f"decode B={args.batch}, {adapters} r={args.rank}", backend=args.backend,
                   ms={str(size): v for size, v in ms.items()}, kernels={str(size): k for size, k in kernels.items()},
                   logits_equal={str(size): bool(jnp.array_equal(logits[first], logits[size])) for size in runs})
        print(row["case"], "  ".join(f"L={size}: {v:.3f} ms ({kernels[size]})" for size, v in ms.items()),
              "logits equal:", row["logits_equal"], flush=True)
        record(row)


if __name__ == "__main__":
    main()
