"""What the benchmark scripts share."""

from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp


def copy_bandwidth(repeats: int = 5) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus written (eight 512 MiB elementwise passes)."""
    x = jax.random.normal(jax.random.key(2), (1 << 27,), jnp.float32)
    f = jax.jit(lambda v: [v * (1.0 + i * 1e-3) for i in range(8)])
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 8 * 2 * x.nbytes / statistics.median(times)


def trace_events(run) -> list[tuple[int, float, float, int, str]]:
    """The GPU kernels that `run()` launches (a profiler trace of one call, blocked on its result), sorted by GPU
    and start: (GPU, start µs, duration µs, stream, kernel name); GPU and stream are the trace's process and
    thread ids."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(run())
        path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    return sorted((e["pid"], float(e["ts"]), float(e["dur"]), e["tid"], e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("pid") in gpu_pids)


def kernel_durations(events) -> dict[str, list[float]]:
    """Durations in µs by kernel name of `trace_events`' kernels."""
    kernels: dict[str, list[float]] = {}
    for _, _, dur, _, name in events:
        kernels.setdefault(name, []).append(dur)
    return kernels


def trace_kernels(run) -> dict[str, list[float]]:
    """Durations in µs, by kernel name, of the GPU kernels that `run()` launches."""
    return kernel_durations(trace_events(run))
