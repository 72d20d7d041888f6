"""The residual add in the norms' kernel (`jlora.pallas.add_rms_norm`) against the add as a kernel of its own, for #39.

Over [out, in] weights (an engine of max_batch 1) a one-token step's projections are row reductions, and each
residual add after o and down ran as a kernel of its own (1.2-1.9 µs a layer each on an H200), where XLA's GEMMs
over [in, out] take it into the kernel that sums their split-K partials. `llama.residual_add_in_norm` decides
where the norm kernel takes the add in.

Model: the 8B-shaped decode step (`bench/model.py`'s random model, contiguous rows of 1024 positions, query at
512), each batch as `bench/model.py` runs it (`engine_config`: its weight layout and attention split), compiled
twice, as shipped and with the decision patched to the other answer while the second copy traces, timed in
alternating rounds; both variants' logits compared first. The base step at each batch, and one r=16 adapter
(`--rank`) at batch 1. JSON: add_in_norm.json.

  python bench/studies/add_in_norm.py [--batches 1,8,32] [--rank 16] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import compare_patched, patched_row, row_recorder  # noqa: E402
from model import SLOTS, engine_config, engine_layout, llama3_8b, random_lora, random_model  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora.models import llama  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def case(model_def, params, name: str, batch: int, lora=None, rank: int = 16) -> dict:
    """The step as shipped and with `residual_add_in_norm` answering the other way, alternating rounds."""
    config = model_def.merge(params).config
    cache, call = base_decode(config, batch, 1024, 512, False)
    if lora is not None:  # one adapter for every row
        call = Call(call.batch, jnp.zeros(batch, jnp.int32), jnp.full(SLOTS, rank, jnp.int32))
    shipped = llama.residual_add_in_norm(config, batch)
    labels = ("in norm", "apart") if shipped else ("apart", "in norm")
    options = StepOptions(16, "auto", attention_chunk=engine_config(batch).attention_chunk(config.num_kv_heads))
    got, _ = compare_patched(model_def, params, call, cache, lora, options, llama, "residual_add_in_norm",
                             not shipped, labels)
    return patched_row(name, got, ("in norm", "apart"), shipped=labels[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32", help="base decode batch sizes")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank at batch 1")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "add_in_norm.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    for batch in map(int, filter(None, args.batches.split(","))):
        stored = engine_layout(model_def, params, batch)
        record(case(*stored, f"decode B={batch}", batch))
        if batch == 1:
            record(case(*stored, f"decode B=1, 1 r={args.rank}", 1, random_lora(config, args.rank), args.rank))
        del stored


if __name__ == "__main__":
    main()
