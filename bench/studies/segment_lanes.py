"""The engine's segment lanes (`jlora.runner.segment_lanes`) against a program per segment, for #39.

The segmented Pallas kernels' grids hold a program per segment a batch may hold, cdiv(T, block_m) + L at most
(L the slots); with few adapters in use most find none. Where a call's segments in use fit in 2·cdiv(T, block_m),
the engine runs its projections' LoRA kernels over that many lanes (`StepOptions.lanes`), each lane looping over
every lanes-th segment in use: the same bits, fewer programs. This times the step under the engine's rule and
with lanes off.

Model: the 8B-shaped decode step (`bench/model.py`'s model and adapters, 32 slots; each batch as `bench/model.py`
runs it), the slots shuffled over the rows, backend `auto`; timed in alternating rounds, one process; both
variants' logits compared. JSON: segment_lanes_rule.json.

  python bench/studies/segment_lanes.py [--cases 32x16x1,32x64x1,32x16x4,64x16x1,64x64x1] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import count_and_time, row_recorder  # noqa: E402
from model import SLOTS, engine_config, engine_layout, llama3_8b, random_lora, random_model  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora.runner import forward, segment_lanes  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x16x1,32x64x1,32x16x4,64x16x1,64x64x1", help="batch x rank x adapters")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "segment_lanes_rule.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    loras = {}
    for case in args.cases.split(","):
        batch, rank, used = map(int, case.split("x"))
        lora = loras.setdefault(rank, random_lora(config, rank))
        stored = engine_layout(model_def, params, batch)
        cache, call = base_decode(config, batch, 1024, 512, False)
        slots = np.random.default_rng(0).permutation(np.arange(batch) % used).astype(np.int32)
        call = Call(call.batch, jnp.asarray(slots), jnp.full(SLOTS, rank, jnp.int32))
        chunk = engine_config(batch).attention_chunk(config.num_kv_heads)
        lanes = segment_lanes(slots, "auto", rank)
        variants = {"lanes": StepOptions(16, "auto", attention_chunk=chunk, lanes=lanes),
                    "a program per segment": StepOptions(16, "auto", attention_chunk=chunk)}
        logits, runs = {}, {}
        for name, options in variants.items():
            logits[name], cache = forward(*stored, call, cache, lora, options)
            runs[name] = lambda c, options=options: forward(*stored, call, c, lora, options)
        got, cache = count_and_time(runs, cache)
        ms = got["ms"]
        row = dict(batch=batch, rank=rank, adapters=used, lanes=lanes, ms=ms, kernels=got["kernels"],
                   ratio=ms["lanes"] / ms["a program per segment"],
                   logits_equal=bool(jnp.array_equal(*logits.values())))
        print(f"decode B={batch} r={rank} adapters={used} lanes={lanes}: " + ", ".join(
            f"{n} {t:.3f} ms" for n, t in ms.items()) + f": {row['ratio']:.3f}x, same logits {row['logits_equal']}",
              flush=True)
        record(row)


if __name__ == "__main__":
    main()
