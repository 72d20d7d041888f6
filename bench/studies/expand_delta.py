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
JSON: expand_delta.json. With `--against-gather` the decode steps compare the pallas backend (as shipped) with
the gather backend instead (expand_delta_vs_gather.json): where `auto` should switch.

  python bench/studies/expand_delta.py [--batches 32,64] [--ranks 64] [--adapters 1,8,32] [--prefill 4x512]
      [--backend auto] [--against-gather] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
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


def versus_gather(model_def, params, call, cache, lora, batch, rank, adapters) -> dict:
    """The step under the pallas backend against the gather backend, alternating rounds."""
    runs = {backend: (lambda c, backend=backend: forward(model_def, params, call, c, lora,
                                                           StepOptions(16, backend)))
            for backend in ("pallas", "gather")}
    times, _ = time_alternating(runs, cache)
    ms = {backend: statistics.median(t) * 1e3 for backend, t in times.items()}
    print(f"decode B={batch} {adapters} r={rank}: pallas {ms['pallas']:7.3f} ms, gather {ms['gather']:7.3f} ms: "
          f"{ms['pallas'] / ms['gather']:.3f}x", flush=True)
    return dict(batch=batch, rank=rank, adapters=adapters, pallas_ms=ms["pallas"], gather_ms=ms["gather"],
                ratio=ms["pallas"] / ms["gather"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--ranks", default="64")
    parser.add_argument("--adapters", default=f"1,8,{SLOTS}")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--against-gather", action="store_true",
                        help="the pallas backend (its expand as shipped) against the gather backend instead")
    parser.add_argument("--prefill", default="", help="prefills as REQUESTSxLENGTH,..., one adapter a request")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    print(f"# {device}", flush=True)
    config = llama3_8b(32)
    model_def, params = random_model(config)
    result, path = {"device": device, "backend": args.backend, "rows": []}, os.path.join(args.out, "expand_delta.json")
    os.makedirs(args.out, exist_ok=True)
    for shape in filter(None, args.prefill.split(",")):
        requests, length = map(int, shape.split("x"))
        lora = random_lora(config, 16)
        cache, call = prefill(config, requests, length)
        call = Call(call.batch, jnp.repeat(jnp.arange(requests, dtype=jnp.int32), length),
                    jnp.full(SLOTS, 16, jnp.int32))
        got, _ = compare_patched(model_def, params, call, cache, lora, StepOptions(64, args.backend),
                                 pallas_config, "delta_expand", False, ("delta", "in_place"),
                                 inline=((ops, "_linear"), (ops, "_expand")))
        ms = got["ms"]
        result["rows"].append(dict(prefill=shape, rank=16, adapters=requests, delta_ms=ms["delta"],
                                   in_place_ms=ms["in_place"], ratio=ms["delta"] / ms["in_place"],
                                   logits_max_abs_diff=got["logits_max_abs_diff"]))
        print(f"prefill {requests} x {length} r=16: delta {ms['delta']:7.3f} ms, in place {ms['in_place']:7.3f} ms: "
              f"{ms['delta'] / ms['in_place']:.3f}x; logits max |diff| {got['logits_max_abs_diff']:.3g}", flush=True)
        del lora
    for rank in map(int, filter(None, args.ranks.split(","))):
        lora = random_lora(config, rank)
        for batch in map(int, args.batches.split(",")):
            for adapters in map(int, args.adapters.split(",")):
                cache, call = base_decode(config, batch, 1024, 512, False)
                call = Call(call.batch, jnp.arange(batch, dtype=jnp.int32) % adapters,
                            jnp.full(SLOTS, rank, jnp.int32))
                if args.against_gather:
                    result["rows"].append(versus_gather(model_def, params, call, cache, lora, batch, rank, adapters))
                    with open(path.replace(".json", "_vs_gather.json"), "w") as f:
                        json.dump(result, f, indent=1)
                    continue
                got, _ = compare_patched(model_def, params, call, cache, lora, StepOptions(16, args.backend),
                                         pallas_config, "delta_expand", False, ("delta", "in_place"),
                                         inline=((ops, "_linear"), (ops, "_expand")))
                ms, kernels = got["ms"], got["kernels"]
                row = dict(batch=batch, rank=rank, adapters=adapters, delta_ms=ms["delta"],
                           in_place_ms=ms["in_place"], ratio=ms["delta"] / ms["in_place"], kernels=kernels,
                           logits_max_abs_diff=got["logits_max_abs_diff"],
                           logits_equal_fraction=got["logits_equal_fraction"])
                result["rows"].append(row)
                print(f"decode B={batch} {adapters} r={rank}: delta {ms['delta']:7.3f} ms ({kernels['delta']} "
                      f"kernels), in place {ms['in_place']:7.3f} ms ({kernels['in_place']}): {row['ratio']:.3f}x; "
                      f"logits max |diff| {row['logits_max_abs_diff']:.3g}", flush=True)
                with open(path, "w") as f:
                    json.dump(result, f, indent=1)
        del lora


if __name__ == "__main__":
    main()
