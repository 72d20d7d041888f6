"""The q|k|v LoRA delta added in the decode-attention kernel against XLA's add before it, for #39.

Where the Pallas LoRA kernels write q|k|v's delta apart (`defer_add`: batch 32 and above, or r=64 from batch 16),
XLA added it to the q|k|v GEMM's output in a fusion with RoPE and the two cache writes before the attention kernel
(3.3 µs a layer at batch 32 with one r=16 adapter on an H200, against 0.7 for the base step's split-K sum there).
Handed the delta (`NewToken.delta`), the attention kernel adds it, rotates and writes as it does for the base step.
`llama.qkv_delta_in_attention` decides.

Model: the 8B-shaped decode step (`bench/model.py`'s random model, each batch as `bench/model.py` runs it, 1024
positions a request, query at 512; the adapters' slots shuffled over the rows, the first `base` rows of the
shuffle on the base model), compiled twice, as shipped and with the decision patched off while the second copy
traces, timed in alternating rounds; both variants' logits compared first. JSON: delta_in_attention.json.

  python bench/studies/delta_in_attention.py [--cases 32x16x1,32x16x32x16,...] [--out DIR]  # GPU
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

LABELS = ("in the kernel", "XLA adds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x16x1,32x16x8,32x16x32,32x16x1x16,64x16x32,32x64x1,32x64x32,64x64x8",
                        help="decode batch x rank x adapters [x rows on the base model]")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "delta_in_attention.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    loras = {}
    for case in filter(None, args.cases.split(",")):
        batch, rank, used, base = (list(map(int, case.split("x"))) + [0])[:4]
        lora = loras.setdefault(rank, random_lora(config, rank))
        stored = engine_layout(model_def, params, batch)
        cache, call = base_decode(config, batch, 1024, 512, False)
        slots = shuffled_slots(batch, used).at[:base].set(-1)
        call = Call(call.batch, slots, jnp.full(SLOTS, rank, jnp.int32))
        options = StepOptions(16, "auto", attention_chunk=engine_config(batch).attention_chunk(config.num_kv_heads))
        got, cache = compare_patched(*stored, call, cache, lora, options, llama, "qkv_delta_in_attention",
                                     lambda affine: False, LABELS)
        name = f"decode B={batch}, {used} r={rank}" + (f", {base} rows base" if base else "")
        record(patched_row(name, got, LABELS, batch=batch, rank=rank, adapters=used, base_rows=base))
        del stored, cache


if __name__ == "__main__":
    main()
