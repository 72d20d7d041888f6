"""The decode expand writing its delta alone against adding it into the base's buffer, for #39.

The Pallas expand used to add each token's delta into the base projection's output in place (a read-add-write
of [T, N]), so it waited for the base GEMM and ran after it on the step's main stream. Written alone (the
model's `lora_linear(..., defer_add=True)`), the delta needs only the shrink: the expand runs beside the base
GEMM, and XLA adds the rounded delta in the kernel that reads the sum (the residual add, SiLU·mul, RoPE), as
the gather backend's delta is added.

Model: the 8B-shaped step (`bench/model.py`'s model, random weights) compiled twice, as shipped and with
`jlora.pallas.config.delta_expand` patched to in place while the copy traces, timed in alternating rounds:
decode over contiguous rows (context 1024, query at 512) at each batch of `--batches`, with each count of
`--adapters` of each rank of `--ranks`, under `--backend` (auto: the Pallas kernels where T·R > 512); and
prefills of `--prefill` (REQUESTSxLENGTH, one r=16 adapter a request). Both variants' logits are compared first.
JSON: expand_delta.json. `--against` sets what the shipped step is compared with: `in_place` (the above),
`gather` (the pallas backend against the gather backend, decode only: where `auto` should switch) or
`no_base_first` (the engine's decode steps order each gate|up GEMM before its LoRA kernels, `base_first`: the
step with that order lifted); JSON: expand_delta_vs_<against>.json for the last two.

  python bench/studies/expand_delta.py [--batches 32,64] [--ranks 64] [--adapters 1,8,32] [--prefill 4x512]
      [--backend auto] [--against in_place|gather|no_base_first] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import compare_patched  # noqa: E402
from model import SLOTS, llama3_8b, random_lora, random_model, time_alternating  # noqa: E402
from norm_kernel import prefill  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora import ops  # noqa: E402
from jlora.pallas import config as pallas_config  # noqa: E402
from jlora.runner import forward  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def compare(model_def, params, call, cache, lora, options: StepOptions, against: str) -> tuple[dict, str]:
    """({"ms": {label: median ms}, ...}, the other variant's label): the shipped step under `options` (label
    "shipped") against the variant `against` names, in alternating rounds."""
    if against == "in_place":
        got, _ = compare_patched(model_def, params, call, cache, lora, options, pallas_config, "delta_expand", False,
                                 ("shipped", against), inline=((ops, "_linear"), (ops, "_expand")))
        return got, against
    variants = {"gather": (dataclasses.replace(options, backend="pallas"), dataclasses.replace(options, backend="gather")),
                "no_base_first": (options, dataclasses.replace(options, base_first=False))}[against]
    runs = {label: (lambda c, o=o: forward(model_def, params, call, c, lora, o))
            for label, o in zip(("shipped", against), variants)}
    times, _ = time_alternating(runs, cache)
    return {"ms": {label: statistics.median(t) * 1e3 for label, t in times.items()}}, against


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--ranks", default="64")
    parser.add_argument("--adapters", default=f"1,8,{SLOTS}")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--against", default="in_place", choices=("in_place", "gather", "no_base_first"))
    parser.add_argument("--prefill", default="", help="prefills as REQUESTSxLENGTH,..., one adapter a request")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    print(f"# {device}: the shipped step against {args.against}", flush=True)
    config = llama3_8b(32)
    model_def, params = random_model(config)
    result = {"device": device, "backend": args.backend, "against": args.against, "rows": []}
    path = os.path.join(args.out, "expand_delta.json" if args.against == "in_place"
                        else f"expand_delta_vs_{args.against}.json")
    os.makedirs(args.out, exist_ok=True)

    def record(name: str, row: dict, got: dict, other: str) -> None:
        ms = got["ms"]
        row |= dict(shipped_ms=ms["shipped"], other_ms=ms[other], ratio=ms["shipped"] / ms[other],
                    **{k: got[k] for k in ("kernels", "logits_max_abs_diff") if k in got})
        result["rows"].append(row)
        extra = (f"; {got['kernels']['shipped']} / {got['kernels'][other]} kernels, logits max |diff| "
                 f"{got['logits_max_abs_diff']:.3g}" if "kernels" in got else "")
        print(f"{name}: shipped {ms['shipped']:7.3f} ms, {other} {ms[other]:7.3f} ms: {row['ratio']:.3f}x{extra}",
              flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    for shape in filter(None, args.prefill.split(",")):
        requests, length = map(int, shape.split("x"))
        lora = random_lora(config, 16)
        cache, call = prefill(config, requests, length)
        call = Call(call.batch, jnp.repeat(jnp.arange(requests, dtype=jnp.int32), length),
                    jnp.full(SLOTS, 16, jnp.int32))
        got, other = compare(model_def, params, call, cache, lora, StepOptions(64, args.backend), args.against)
        record(f"prefill {requests} x {length} r=16", dict(prefill=shape, rank=16, adapters=requests), got, other)
        del lora
    for rank in map(int, filter(None, args.ranks.split(","))):
        lora = random_lora(config, rank)
        for batch in map(int, args.batches.split(",")):
            for adapters in map(int, args.adapters.split(",")):
                cache, call = base_decode(config, batch, 1024, 512, False)
                call = Call(call.batch, jnp.arange(batch, dtype=jnp.int32) % adapters,
                            jnp.full(SLOTS, rank, jnp.int32))
                got, other = compare(model_def, params, call, cache, lora, StepOptions(16, args.backend),
                                     args.against)
                record(f"decode B={batch} {adapters} r={rank}", dict(batch=batch, rank=rank, adapters=adapters),
                       got, other)
        del lora


if __name__ == "__main__":
    main()
