"""What a slot write and an adapter's copy to the device cost the decode steps beside them, apart from what
else a tenancy run changes (prompts, the mix of adapters): #36, docs/performance.md § Tenancy.

An 8B-shaped engine with 32 slots decodes 32 requests over 16 resident q_proj + v_proj adapters (the tenancy
benchmark's ranks) with `Batcher.step`, no prompt after the first steps. Rounds alternate three modes, the
same steps in each:
  - none: steps alone;
  - write: every `--every`-th step writes an adapter, staged beforehand, into one of the 16 idle slots
    (`AdapterPool.install` in the step's `while_in_flight`, as the engine loops do);
  - stage: a thread copies prepared adapters to the device (`AdapterPool.stage`) back to back, no writes.
Per mode, the intervals between step returns (what a decoding row waits for a token) p50 / p99, those with a
write apart, the host time of the write, of the step dispatch after a write and of the others, and the
intervals in which the interpreter collected generation 1 or 2 (`--freeze`: `gc.freeze()` after the warm-up).
Written to `--out` as write_cost.json (write_cost_gc_frozen.json).

  python bench/studies/write_cost.py [--rounds 8] [--steps 64] [--every 8] [--freeze] [--out bench/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import bench_model  # noqa: E402
from tenancy import write_adapters  # noqa: E402

from jlora.engine import Engine  # noqa: E402
from jlora.scheduler import Request  # noqa: E402

RESIDENT, CYCLED = 16, 32  # adapters the requests use; adapters written into the other 16 slots in turn


def pct(xs, q) -> float | None:
    return float(np.percentile(xs, q) * 1e3) if len(xs) else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64, help="steps per mode per round")
    parser.add_argument("--every", type=int, default=8, help="a write every this many steps (write mode)")
    parser.add_argument("--freeze", action="store_true", help="gc.freeze() after the warm-up steps")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    model, cfg, dtype = bench_model(jax.default_backend() != "gpu", root)
    steps_total = args.rounds * 3 * args.steps + 64
    engine = Engine(model, dtype=dtype, max_loras=32, max_lora_rank=64, max_batch=32,
                    max_seq_len=steps_total + 32)
    paths = write_adapters(root, cfg, RESIDENT + CYCLED, np.random.default_rng(0))
    pool = engine.pool
    for i in range(RESIDENT):
        engine.load_adapter(f"r{i}", paths[i])
    prepared = [pool.prepare(p) for p in paths[RESIDENT:]]
    staged = [pool.stage(p) for p in prepared]
    batcher = engine.new_batcher(32, steps_total + 32)
    rng = np.random.default_rng(1)
    for row in range(32):
        name = f"r{row % RESIDENT}"
        pool.hold([name])
        batcher.add(Request(prompt=[int(t) for t in rng.integers(0, 256, 16)], slot=pool.slot(name),
                            max_new=steps_total))
    writes = 0

    def write() -> float:
        nonlocal writes
        start = time.perf_counter()
        pool.install(f"w{writes}", staged[writes % CYCLED])  # evicts the least recently written idle adapter
        writes += 1
        return time.perf_counter() - start

    dispatch = []  # host time of each runner.step call
    step_call = engine.runner.step

    def timed_step(*a, **k):
        start = time.perf_counter()
        out = step_call(*a, **k)
        dispatch.append(time.perf_counter() - start)
        return out

    engine.runner.step = timed_step
    for _ in range(32):  # the prompts in, every shape compiled, every rank bucket's write compiled
        batcher.step(write)
    if args.freeze:
        gc.freeze()
    collections = []  # (generation, seconds) of each garbage collection

    def on_gc(phase: str, info: dict, started=[0.0]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)
    stop = threading.Event()

    def stage_loop(copies: list) -> None:
        i = 0
        while not stop.is_set():
            start = time.perf_counter()
            jax.block_until_ready(jax.tree.leaves(pool.stage(prepared[i % CYCLED]).host.layers))
            copies.append(time.perf_counter() - start)
            i += 1

    results = {m: {"intervals": [], "write_intervals": [], "write_host": [], "dispatch_after_write": [],
                   "dispatch": [], "copies": [], "gc_intervals": [], "gc": []} for m in ("none", "write", "stage")}
    for rnd in range(args.rounds):
        for mode in ("none", "write", "stage"):
            r = results[mode]
            thread = None
            if mode == "stage":
                stop.clear()
                thread = threading.Thread(target=stage_loop, args=(r["copies"],))
                thread.start()
            last, after_write = time.perf_counter(), False
            for i in range(args.steps):
                hosted, collected = [], len(collections)
                wrote = mode == "write" and i % args.every == 0
                batcher.step((lambda: hosted.append(write())) if wrote else None)
                now = time.perf_counter()
                (r["dispatch_after_write"] if after_write else r["dispatch"]).append(dispatch[-1])
                (r["write_intervals"] if wrote else r["intervals"]).append(now - last)
                older = [t for g, t in collections[collected:] if g > 0]  # collections of generation 1 or 2
                if older:
                    r["gc"] += older
                    r["gc_intervals"].append(now - last)
                r["write_host"] += hosted
                last, after_write = now, wrote
            if thread is not None:
                stop.set()
                thread.join()
        print(f"# round {rnd + 1} done", flush=True)
    device = jax.devices()[0].device_kind
    summary = {"device": device, "gc_frozen": args.freeze, "steps_per_mode": args.rounds * args.steps,
               "every": args.every, "modes": {}}
    print(f"Device: {device}; gc frozen: {args.freeze}; {args.rounds} rounds x {args.steps} steps per mode; "
          "ms p50 / p99")
    for mode, r in results.items():
        row = {k: {"n": len(v), "p50_ms": pct(v, 50), "p99_ms": pct(v, 99)} for k, v in r.items()}
        summary["modes"][mode] = row
        print(mode.ljust(6), "  ".join(f"{k} {v['p50_ms'] or 0:.2f}/{v['p99_ms'] or 0:.2f} (n={v['n']})"
                                       for k, v in row.items() if v["n"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "write_cost_gc_frozen.json" if args.freeze else "write_cost.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
