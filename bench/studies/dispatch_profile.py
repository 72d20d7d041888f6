"""Where the decode step's host dispatch goes (#36, #39): the engine loop's `runner.step` call takes about 2 ms
of host time at p50 on an 8B model, with a tail of 6-11 ms at p99, in steps with nothing else to do
(docs/performance.md § Tenancy, *What a write and a copy cost the steps beside them*).

An 8B-shaped engine (paged cache) decodes 32 requests over 16 resident q_proj + v_proj adapters with
`Batcher.step`, as `write_cost.py` does, and times each `runner.step` call's host time and the interval between
step returns over `--steps` steps. Then a profiler trace of `--traced` steps gives the host-side events of the
runtime (TraceMe annotations on the host threads: the jitted call's argument handling, the executable's
launch, the command buffers' update and launch...), summed by name per step. Run it in processes of their own
under XLA_FLAGS to compare the runtime's options (command-buffer update modes, say); `--note` names the run,
and each process appends to dispatch_profile.json under `--out`.

  XLA_FLAGS=... python bench/studies/dispatch_profile.py [--steps 256] [--traced 16] [--note TEXT]
                                                         [--out bench/results]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import bench_model  # noqa: E402
from tenancy import write_adapters  # noqa: E402

from jlora.engine import Engine  # noqa: E402
from jlora.scheduler import Request  # noqa: E402

ADAPTERS, ROWS = 16, 32


def pct(xs, q) -> float:
    return float(np.percentile(xs, q) * 1e3)


def host_events(trace_dir: str) -> list[tuple[str, str, float]]:
    """(thread name, event name, duration µs) of every complete event on a host (not GPU) thread of the trace."""
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in str(e.get("args", {}).get("name", ""))}
    return [(names.get((e["pid"], e["tid"]), str(e["tid"])), e["name"], float(e["dur"])) for e in events
            if e.get("ph") == "X" and e["pid"] not in gpu]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--traced", type=int, default=16)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    model, cfg, dtype = bench_model(jax.default_backend() != "gpu", root)
    total = args.steps + args.traced + 64
    engine = Engine(model, dtype=dtype, max_loras=32, max_lora_rank=64, max_batch=ROWS, max_seq_len=total + 32)
    for i, path in enumerate(write_adapters(root, cfg, ADAPTERS, np.random.default_rng(0))):
        engine.load_adapter(f"r{i}", path)
    batcher = engine.new_batcher(ROWS, total + 32)
    rng = np.random.default_rng(1)
    for row in range(ROWS):
        name = f"r{row % ADAPTERS}"
        engine.pool.hold([name])
        batcher.add(Request(prompt=[int(t) for t in rng.integers(0, 256, 16)], slot=engine.pool.slot(name),
                            max_new=total))
    dispatch, steps = [], []
    step_call = engine.runner.step

    def timed_step(step, cache):
        start = time.perf_counter()
        out = step_call(step, cache)
        dispatch.append(time.perf_counter() - start)
        steps.append(step)
        return out

    engine.runner.step = timed_step
    for _ in range(48):  # the prompts in, every shape compiled
        batcher.step()
    dispatch.clear()
    intervals, last = [], time.perf_counter()
    for _ in range(args.steps):
        batcher.step()
        now = time.perf_counter()
        intervals.append(now - last)
        last = now
    timed = list(dispatch)
    # The same step again and again, its inputs from the host each call (new device buffers, as the engine's) or
    # placed on the device once (the same buffers every call); one call in flight, or two.
    replay = {}
    host_step = steps[-1]
    device_step = jax.device_put(host_step)
    for name, step, in_flight in [("host inputs, 1 in flight", host_step, 1),
                                  ("device inputs, 1 in flight", device_step, 1),
                                  ("host inputs, 2 in flight", host_step, 2),
                                  ("device inputs, 2 in flight", device_step, 2)]:
        times, pending = [], []
        for _ in range(64):
            start = time.perf_counter()
            tokens, batcher.cache, _ = step_call(step, batcher.cache)
            times.append(time.perf_counter() - start)
            pending.append(tokens)
            if len(pending) >= in_flight:
                jax.block_until_ready(pending.pop(0))
        jax.block_until_ready(pending)
        replay[name] = {"p50": pct(times[8:], 50), "p99": pct(times[8:], 99)}
        print(f"replay, {name}: runner.step host ms p50 / p99 {replay[name]['p50']:.2f} / {replay[name]['p99']:.2f}",
              flush=True)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.traced):
                batcher.step()
            jax.block_until_ready(batcher.cache)
        events = host_events(trace_dir)
    by_name = collections.defaultdict(list)
    for thread, name, dur in events:
        by_name[thread, name].append(dur)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:40]
    device = jax.devices()[0].device_kind
    run = {"device": device, "note": args.note, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "steps": args.steps, "dispatch_ms": {"p50": pct(timed, 50), "p90": pct(timed, 90), "p99": pct(timed, 99)},
           "interval_ms": {"p50": pct(intervals, 50), "p99": pct(intervals, 99)}, "replay_dispatch_ms": replay,
           "traced_steps": args.traced,
           "host_events": [{"thread": t, "name": n[:120], "per_step": len(d) / args.traced,
                            "us_per_step": sum(d) / args.traced} for (t, n), d in top]}
    print(f"# {device} {args.note!r} XLA_FLAGS={run['xla_flags']!r}")
    print(f"runner.step host ms p50 / p90 / p99: {run['dispatch_ms']['p50']:.2f} / {run['dispatch_ms']['p90']:.2f} / "
          f"{run['dispatch_ms']['p99']:.2f}; interval p50 / p99 {run['interval_ms']['p50']:.2f} / "
          f"{run['interval_ms']['p99']:.2f}")
    for e in run["host_events"]:
        print(f"  {e['us_per_step']:9.1f} µs/step  x{e['per_step']:6.1f}  [{e['thread'][:24]}] {e['name']}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "dispatch_profile.json")
    runs = json.load(open(path))["runs"] if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump({"runs": [*runs, run]}, f, indent=1)


if __name__ == "__main__":
    main()
