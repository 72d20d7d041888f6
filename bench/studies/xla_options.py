"""Decode step time under XLA options (#39): whether another choice of GEMM (cuBLAS for every dot, more Triton
tilings tried) reads the small projections' weights faster than what XLA picks by default, and whether a fusion
option merges the small kernels between the GEMMs, and what programmatic dependent launch (PDL: on Hopper a
kernel starts while the one before it ends) gives.

One process compiles the 8B-shaped decode step (bench/model.py's model, context 512) at each batch size for
the base model, one r=16 adapter for every row and (batch 32) 32 distinct ones, under jlora's own options
(`jlora.compile_options.step_compiler_options`: CONCURRENT graphs) and under each option set below added to
them, and times the compiled steps in alternating rounds. Each case's step is traced once per option set:
the kernels per step, their time in GEMMs and the GEMM kernels' names. An option this XLA does not know fails
its compile; the row says so.

XLA autotunes each GEMM shape once per process and reuses the result under every later option set, so a set
that changes only the autotuner's search (exhaustive tiling) is timed in a process of its own, alternated
with processes of jlora's options. Each process appends its run to `xla_options.json` under `--out`, with
`--note` saying which run it was.

  python bench/studies/xla_options.py [--batches 1,32] [--sets NAME,...] [--note TEXT] [--layers 32]
                                      [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jlora.compile_options import step_compiler_options
from jlora.models.llama import Batch
from jlora.runner import forward
from jlora.step import Call, StepOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import kernel_durations, trace_events  # noqa: E402
from model import CONTEXT, kernel_class, llama3_8b, random_model, setup, time_alternating  # noqa: E402

# name: XLA options added to jlora's
SETS = {
    "jlora": {},
    "cuBLAS GEMMs": {"xla_gpu_enable_triton_gemm": False},
    "exhaustive Triton tiling": {"xla_gpu_exhaustive_tiling_search": True},
    "Triton for any GEMM": {"xla_gpu_triton_gemm_any": True},
    "Triton warp specialization": {"xla_gpu_experimental_enable_triton_warp_specialization": True},
    "cuBLASLt": {"xla_gpu_enable_cublaslt": True},
    "block-level fusion rewriter": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": True},
    "all fusions with Triton": {"xla_gpu_experimental_all_fusions_with_triton": True},
    "heroless Triton fusion": {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
    "same-shape multi-output fusion": {"xla_gpu_experimental_enable_same_shape_multi_output_fusion": True},
    "cuDNN layer norm": {"xla_gpu_enable_cudnn_layer_norm": True},
    # programmatic dependent launch (Hopper): a kernel starts while the one before it ends
    "PDL": {"xla_gpu_enable_pdl": True},
    "PDL with early launch": {"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True},
    "no PDL": {"xla_gpu_enable_pdl": False},
    "Triton multi-output fusion": {"xla_gpu_unsupported_enable_triton_multi_output_fusion": True},
    "fusion autotuner": {"xla_gpu_experimental_enable_fusion_autotuner": True},
    # XLA's default, which jlora's steps turn off: a fusion may keep its bf16 values in f32 (results before
    # 2026-11-28 name the other side of this A/B "no excess precision", then added to jlora's options)
    "excess precision": {"xla_allow_excess_precision": True},
}
ROUNDS, STEPS = 4, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--sets", default=",".join(SETS), help=f"option sets among {list(SETS)}")
    parser.add_argument("--note", default="", help="what this process's run is, kept with its rows")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    sets = {name: SETS[name] for name in args.sets.split(",")}
    config = llama3_8b(args.layers)
    device = jax.devices()[0].device_kind
    model_def, params = random_model(config)
    rows, failed = [], {}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "xla_options.json")
    earlier = []
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)["runs"]
    print(f"# {device}: decode ms per step, {args.layers} layers, context {CONTEXT}, {ROUNDS} alternating rounds",
          flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        _, _, cache, tokens, positions, cases, _ = setup(config, model_def, params, 1, 16, batch)
        lora, slots, ranks = cases["lora"]
        variants = {"base": cases["base"], "1 adapter": (lora, jnp.zeros_like(slots), ranks)}
        if batch >= 32:
            variants["32 adapters"] = cases["lora"]
        for case, (weights, sl, rk) in variants.items():
            call = Call(Batch.of(tokens, positions), sl, rk)
            compiled, compile_s = {}, {}
            for name, extra in sets.items():
                if name in failed:
                    continue
                try:
                    t0 = time.perf_counter()
                    compiled[name] = forward.with_options({**step_compiler_options(1), **extra}).lower(
                        model_def, params, call, cache, weights, StepOptions(16, "auto")).compile()
                    compile_s[name] = time.perf_counter() - t0
                except Exception as e:  # an option this XLA lacks, or a value it refuses
                    failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    print(f"# {name}: compile failed: {failed[name]}", flush=True)
            runs = {name: (lambda run: lambda c: run(params, call, c, weights))(run) for name, run in compiled.items()}
            times, cache = time_alternating(runs, cache, ROUNDS, STEPS)
            for name, run in runs.items():
                def steps(run=run):
                    nonlocal cache
                    for _ in range(STEPS):
                        logits, cache = run(cache)
                    return logits, cache

                kernels = kernel_durations(trace_events(steps))
                gemms = {k: d for k, d in kernels.items() if kernel_class(k) == "gemm"}
                row = dict(batch=batch, case=case, options=name, ms=statistics.median(times[name]) * 1e3,
                           compile_s=compile_s[name],
                           rounds_ms=[t * 1e3 for t in times[name]],
                           kernels=sum(map(len, kernels.values())) / STEPS,
                           gemm_ms=sum(map(sum, gemms.values())) / STEPS / 1e3,
                           gemm_kernels={k[:90]: [len(d) / STEPS, round(statistics.median(d), 2)]
                                         for k, d in sorted(gemms.items(), key=lambda kv: -sum(kv[1]))[:8]})
                rows.append(row)
                print(f"batch {batch:3d} {case:12s} {name:26s} {row['ms']:7.3f} ms  kernels {row['kernels']:5.0f}  "
                      f"GEMM {row['gemm_ms']:6.3f} ms  compile {row['compile_s']:5.1f} s", flush=True)
                for k, (count, med) in row["gemm_kernels"].items():
                    print(f"    x{count:4.0f} {med:7.2f} µs  {k}", flush=True)
            this = dict(device=device, layers=args.layers, process=args.note, sets=sets, failed=failed, rows=rows)
            with open(path, "w") as f:  # after every case
                json.dump({"device": device, "runs": [*earlier, this]}, f, indent=1)
        del cache


if __name__ == "__main__":
    main()
