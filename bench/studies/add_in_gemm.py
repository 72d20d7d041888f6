"""The decode step's q|k|v, o and down projections in Pallas kernels (`jlora.pallas.projections`, and `matmul_add` with
the residual add after o and down) against XLA's GEMMs and adds, for #39.

At decode sizes XLA runs these GEMMs split along K and sums the splits (with the residual add) in a second kernel;
the kernels compute each projection over the whole of K in one. `llama.projections_in_kernel` decides at which
call sizes the model runs them (for projections without LoRA), `llama.projection_kernel` for which projections.

Model: the 8B-shaped decode step (`bench/model.py`'s random model, contiguous rows of 1024 positions, query at
512), each batch as `bench/model.py` runs it (`engine_config`), compiled twice, as shipped and with the decision
patched to the other answer while the second copy traces, timed in alternating rounds; both variants' logits
compared first. The base step at each batch, and at `--lora-batches` one r=16 adapter (`--rank`) on q|k|v alone
(PEFT's default targets for Llama: o and down have no LoRA, so they keep the kernel) and on every projection (the
kernel unused: the control). With `--qkv`, the base steps against q|k|v alone back on XLA's GEMM (what q|k|v's
kernel takes). With `--tiling`, the kernels at that one tiling; with `--min-rows`, their rows in a tile of at
least that many (`projections.MIN_ROWS`; 64 puts 16-32 rows in the tile that 33-64 take). JSON: add_in_gemm.json,
each row with the kernels' tilings (BN, BK, stages) and fewest rows a tile.

  python bench/studies/add_in_gemm.py [--batches 16,32,64,128] [--lora-batches 32,64] [--qkv] [--tiling BN,BK,ST]
                                      [--min-rows 16|32|64] [--out DIR]  # GPU
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
from jlora.pallas import projections  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def case(model_def, params, name: str, batch: int, lora=None, rank: int = 16, qkv: bool = False) -> dict:
    """The step as shipped and with `projections_in_kernel` answering the other way (with `qkv`: with q|k|v alone
    on XLA's GEMM, `projection_kernel` patched), alternating rounds."""
    config = model_def.merge(params).config
    cache, call = base_decode(config, batch, 1024, 512, False)
    if lora is not None:  # one adapter for every row
        call = Call(call.batch, jnp.zeros(batch, jnp.int32), jnp.full(SLOTS, rank, jnp.int32))
    options = StepOptions(16, "auto", attention_chunk=engine_config(batch).attention_chunk(config.num_kv_heads))
    if qkv:
        labels = ("kernels", "q|k|v in XLA")
        got, _ = compare_patched(model_def, params, call, cache, lora, options, llama, "projection_kernel",
                                 lambda name: name in ("o", "down"), labels)
        return patched_row(name, got, labels, shipped=labels[0])
    shipped = llama.projections_in_kernel(batch)
    labels = ("kernels", "XLA") if shipped else ("XLA", "kernels")
    got, _ = compare_patched(model_def, params, call, cache, lora, options, llama, "projections_in_kernel",
                             not shipped, labels)
    return patched_row(name, got, ("kernels", "XLA"), shipped=labels[0])


def qkv_lora(config, rank: int) -> LoRAWeights:
    """`random_lora`'s slots with q|k|v's groups alone."""
    full = random_lora(config, rank)
    layers = tuple(type(layer)(a={"qkv": layer.a["qkv"]}, b={"qkv": layer.b["qkv"]}) for layer in full.layers)
    return LoRAWeights(layers=layers, embed_a=None, embed_b=None, lm_head_a=None, lm_head_b=None)


def tiling_arg(text: str) -> projections.Tiling:
    """--tiling's value: three positive integers, BN,BK,STAGES."""
    try:
        tiling = tuple(int(part) for part in text.split(","))
    except ValueError:
        tiling = ()
    if len(tiling) != 3 or min(tiling) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not three positive integers BN,BK,STAGES")
    return tiling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="16,32,64,128", help="base decode batch sizes")
    parser.add_argument("--lora-batches", default="32,64", help="batch sizes of the one-adapter cases")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank")
    parser.add_argument("--qkv", action="store_true", help="also each base step against q|k|v on XLA's GEMM")
    parser.add_argument("--tiling", type=tiling_arg, help="BN,BK,STAGES: the kernels' one tiling for every width "
                        "(default: `projections.TILINGS`), e.g. 64,128,4")
    parser.add_argument("--min-rows", type=int, choices=(16, 32, 64), default=projections.MIN_ROWS,
                        help="the fewest rows a kernel's tile holds (a power of two; default: `projections.MIN_ROWS`)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if args.tiling:
        projections.TILINGS = (args.tiling,)
    projections.MIN_ROWS = args.min_rows
    _, record_row = row_recorder(args.out, "add_in_gemm.json")
    tilings = [list(t) for t in projections.TILINGS]
    record = lambda row: record_row({**row, "tilings": tilings, "min_rows": args.min_rows})  # the kernels' tiles
    config = llama3_8b(32)
    model_def, params = random_model(config)
    lora_batches = set(map(int, filter(None, args.lora_batches.split(","))))
    adapters = {"q|k|v": qkv_lora(config, args.rank), "every projection": random_lora(config, args.rank)}
    for batch in sorted(set(map(int, filter(None, args.batches.split(",")))) | lora_batches):
        stored = engine_layout(model_def, params, batch)
        record(case(*stored, f"decode B={batch}", batch))
        if args.qkv and llama.projections_in_kernel(batch):
            record(case(*stored, f"decode B={batch}, q|k|v", batch, qkv=True))
        if batch in lora_batches:
            for targets, lora in adapters.items():
                record(case(*stored, f"decode B={batch}, 1 r={args.rank} on {targets}", batch, lora, args.rank))
        del stored


if __name__ == "__main__":
    main()
