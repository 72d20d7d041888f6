"""The base GEMM before its LoRA kernels at every projection, not only gate|up, for #39's batch-8 rows.

Under concurrent CUDA graphs the first kernel after a fork keeps the graph's stream. Where the LoRA runs in XLA
(the gather backend: batch 1 and 8 under `auto`), `base_first` puts gate|up's base GEMM before its LoRA kernels
with an optimization barrier (`llama.base_first_projection`); the profile of batch 8's step with one adapter
(`bench/results/model_profile_b8_r16.txt`) shows the other projections' GEMMs on side streams beside the LoRA
reductions, and slower there than in the base step (q|k|v 14.3 -> 19.1 µs, o 10.0 -> 13.2, down 29.6 -> 38.3).

Model: the 8B-shaped decode step (`bench/model.py`'s random model, each batch as it runs it; r=16 adapters, one
for every row or one per row), as shipped and with `base_first_projection` replaced by another rule while the
second copy traces (by default gate|up only, the rule before the shipped ones: every GEMM first, and none where
the projections are row reductions; or `--other` names one of RULES), timed in alternating rounds; both
variants' logits compared first. JSON: base_first_all.json.

  python bench/studies/base_first_all.py [--batches 1,8,16] [--rank 16] [--other RULE] [--backend auto] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import compare_patched, patched_row, row_recorder  # noqa: E402
from model import (SLOTS, engine_config, engine_layout, llama3_8b, random_lora, random_model,  # noqa: E402
                   shuffled_slots)
from split_attention import base_decode  # noqa: E402

from jlora.models import llama  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402

RULES = {"gate|up only": lambda name, _: name == "gate_up", "every projection": lambda name, _: True,
         "every projection but q|k|v": lambda name, _: name != "qkv",  # q|k|v's LoRA then leads its GEMM
         "none": lambda name, _: False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--other", choices=RULES, help="the rule against the shipped one (default: the other of "
                        "gate|up only and every projection)")
    parser.add_argument("--backend", default="auto", help="the LoRA backend (gather: the XLA LoRA at any batch)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "base_first_all.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    lora = random_lora(config, args.rank)
    for batch in map(int, args.batches.split(",")):
        stored = engine_layout(model_def, params, batch)
        cache, call = base_decode(config, batch, 1024, 512, False)
        chunk = engine_config(batch).attention_chunk(config.num_kv_heads)
        options = StepOptions(16, args.backend, attention_chunk=chunk)
        reductions = engine_config(batch).weights_out_in and batch == 1  # `project`'s one-token reductions
        shipped = "none" if reductions else "every projection"
        labels = (shipped, args.other or "gate|up only")
        for adapters in sorted({1, batch}):
            slots = shuffled_slots(batch, adapters)
            step = Call(call.batch, slots, jnp.full(SLOTS, args.rank, jnp.int32))
            got, cache = compare_patched(*stored, step, cache, lora, options, llama, "base_first_projection",
                                         RULES[labels[1]], labels)
            record(patched_row(f"decode B={batch}, {adapters} r={args.rank}", got, labels, shipped=labels[0],
                               backend=args.backend))
        del stored


if __name__ == "__main__":
    main()
