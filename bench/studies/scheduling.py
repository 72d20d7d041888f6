"""Decode step time under XLA's default CUDA-graph scheduling and under CONCURRENT, per batch size.

One process compiles the 8B-shaped decode step (bench/model.py's model, context 512) at each batch size, for
the base model and with one r=16 adapter per request (up to 32 distinct), under XLA's default graphs and
under CONCURRENT ones, the LoRA step there also with the gate|up base GEMM scheduled before its LoRA kernels
(`base_first`, what the engine compiles), and times them in alternating rounds;
`jlora.compile_options.step_compiler_options` picks the mode from this table.

  python bench/studies/scheduling.py [--batches 1,2,4,8,16,32,64] [--layers 32] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax

from jlora.models.llama import Batch
from jlora.runner import forward
from jlora.step import Call, StepOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from model import CONTEXT, llama3_8b, random_model, setup, time_alternating  # noqa: E402

CONCURRENT = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
# mode: (compiler options, base_first)
MODES = {"default": ({}, False), "concurrent": (CONCURRENT, False), "concurrent, base first": (CONCURRENT, True)}
ROUNDS, STEPS = 4, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    config = llama3_8b(args.layers)
    device = jax.devices()[0].device_kind
    model_def, params = random_model(config)
    rows = []
    print(f"# {device}: decode ms per step, {args.layers} layers, context {CONTEXT}, {ROUNDS} alternating rounds\n"
          f"| batch | case | {' | '.join(MODES)} |\n|---|---|{'---|' * len(MODES)}", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        _, _, cache, tokens, positions, cases, _ = setup(config, model_def, params, 1, 16, batch)
        for weights, slots, ranks in cases.values():
            case = "base" if weights is None else "r=16"
            call = Call(Batch.of(tokens, positions), slots, ranks)
            modes = {m: v for m, v in MODES.items() if weights is not None or not v[1]}  # no LoRA: no barrier
            compiled = {mode: forward.with_options(options).lower(
                model_def, params, call, cache, weights, StepOptions(16, "auto", base_first=base_first)).compile()
                        for mode, (options, base_first) in modes.items()}

            def bound(run):  # cache -> (logits, cache) on this case's inputs
                return lambda c: run(params, call, c, weights)

            times, cache = time_alternating({mode: bound(run) for mode, run in compiled.items()}, cache, ROUNDS, STEPS)
            times = {mode: [sec * 1e3 for sec in t] for mode, t in times.items()}
            ms = {mode: statistics.median(t) for mode, t in times.items()}
            rows.append(dict(batch=batch, case=case, ms=ms, rounds=times))
            print(f"| {batch} | {case} | {' | '.join(f'{ms[m]:.2f}' if m in ms else '—' for m in MODES)} |",
                  flush=True)
        del cache
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scheduling.json"), "w") as f:
        json.dump({"device": device, "layers": args.layers, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
