"""The residual add in the o and down GEMMs' kernel (`jlora.pallas.matmul_add`) against XLA's GEMM and add, for #39.

At decode sizes XLA runs the o and down GEMMs split along K and sums the splits with the residual add in a second
kernel; `matmul_add` computes each projection over the whole of K and adds the residual in one kernel.
`llama.residual_add_in_gemm` decides at which call sizes the model runs it (for projections without LoRA).

Model: the 8B-shaped decode step (`bench/model.py`'s random model, contiguous rows of 1024 positions, query at
512), each batch as `bench/model.py` runs it (`engine_config`), compiled twice, as shipped and with the decision
patched to the other answer while the second copy traces, timed in alternating rounds; both variants' logits
compared first. The base step at each batch, and at `--lora-batches` one r=16 adapter (`--rank`) on q|k|v alone
(PEFT's default targets for Llama: o and down have no LoRA, so they keep the kernel) and on every projection (the
kernel unused: the control). JSON: add_in_gemm.json.

  python bench/studies/add_in_gemm.py [--batches 16,32,64,128] [--lora-batches 32,64] [--out DIR]  # GPU
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
from jlora.models.lora_weights import LoRAWeights  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def case(model_def, params, name: str, batch: int, lora=None, rank: int = 16) -> dict:
    """The step as shipped and with `residual_add_in_gemm` answering the other way, alternating rounds."""
    config = model_def.merge(params).config
    cache, call = base_decode(config, batch, 1024, 512, False)
    if lora is not None:  # one adapter for every row
        call = Call(call.batch, jnp.zeros(batch, jnp.int32), jnp.full(SLOTS, rank, jnp.int32))
    shipped = llama.residual_add_in_gemm(batch)
    labels = ("in gemm", "apart") if shipped else ("apart", "in gemm")
    options = StepOptions(16, "auto", attention_chunk=engine_config(batch).attention_chunk(config.num_kv_heads))
    got, _ = compare_patched(model_def, params, call, cache, lora, options, llama, "residual_add_in_gemm",
                             not shipped, labels)
    return patched_row(name, got, ("in gemm", "apart"), shipped=labels[0])


def qkv_lora(config, rank: int) -> LoRAWeights:
    """`random_lora`'s slots with q|k|v's groups alone."""
    full = random_lora(config, rank)
    layers = tuple(type(layer)(a={"qkv": layer.a["qkv"]}, b={"qkv": layer.b["qkv"]}) for layer in full.layers)
    return LoRAWeights(layers=layers, embed_a=None, embed_b=None, lm_head_a=None, lm_head_b=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="16,32,64,128", help="base decode batch sizes")
    parser.add_argument("--lora-batches", default="32,64", help="batch sizes of the one-adapter cases")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "add_in_gemm.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    lora_batches = set(map(int, filter(None, args.lora_batches.split(","))))
    adapters = {"q|k|v": qkv_lora(config, args.rank), "every projection": random_lora(config, args.rank)}
    for batch in sorted(set(map(int, filter(None, args.batches.split(",")))) | lora_batches):
        stored = engine_layout(model_def, params, batch)
        record(case(*stored, f"decode B={batch}", batch))
        if batch in lora_batches:
            for targets, lora in adapters.items():
                record(case(*stored, f"decode B={batch}, 1 r={args.rank} on {targets}", batch, lora, args.rank))
        del stored


if __name__ == "__main__":
    main()
