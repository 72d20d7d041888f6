"""What the benchmark scripts share."""

from __future__ import annotations

import contextlib
import copy
import glob
import gzip
import json
import os
import platform
import statistics
import subprocess
import tempfile
import threading
import time
from unittest import mock

import jax
import jax.numpy as jnp


def copy_bandwidth(passes: int = 8, repeats: int = 3) -> float:
    """Device copy bandwidth in bytes/s: bytes read plus written by `passes` elementwise passes over distinct
    512 MiB f32 arrays, over their kernels' durations in a profiler trace (median of `repeats` traces).

    Each pass reads an array of its own: passes over one shared input were fused by XLA into a single kernel
    that read it once, so counting a read per pass overstated the bandwidth (5.25 TB/s on an H200, against
    4.27 TB/s from separate passes, in one process)."""
    xs = [jax.random.normal(jax.random.key(i), (1 << 27,), jnp.float32) for i in range(passes)]
    f = jax.jit(lambda arrays: [a * 1.001 for a in arrays])
    jax.block_until_ready(f(xs))
    rates = []
    for _ in range(repeats):
        durations = [d for ds in trace_kernels(lambda: f(xs)).values() for d in ds]
        if len(durations) != passes:
            raise RuntimeError(f"copy_bandwidth: expected {passes} kernels (one per pass), the trace holds "
                               f"{len(durations)}")
        rates.append(passes * 2 * xs[0].nbytes / (sum(durations) * 1e-6))
    return statistics.median(rates)


# nvidia-smi's fields: the card's identity and limits, read once, and what moves while a table runs, sampled.
_GPU_FACTS = ("uuid", "name", "driver_version", "power.limit", "clocks.max.sm", "clocks.max.mem")
_GPU_SAMPLED = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
# NVML's clock-event reasons: why the SM clock stood below its top (bits of clocks_event_reasons.active).
_CLOCK_EVENTS = {0x1: "idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
                 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}


def _smi_query(fields: tuple[str, ...]) -> list[str]:
    """nvidia-smi's command line for `fields` of JAX's first GPU, one CSV line per reading."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    return ["nvidia-smi", "-i", gpu, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


def gpu_facts() -> dict[str, str]:
    """The card a run measures on, as nvidia-smi reports it (UUID, name, driver, power limit, top clocks), and the
    host's kernel release, which differs between the device tool's two runtimes; the kernel alone where nvidia-smi
    is missing or fails."""
    facts = {}
    try:
        line = subprocess.run(_smi_query(_GPU_FACTS), capture_output=True, text=True, timeout=30,
                              check=True).stdout.splitlines()[0]
        facts = dict(zip(_GPU_FACTS, (v.strip() for v in line.split(","))))
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return facts | {"kernel": platform.release()}


class GpuMonitor:
    """The GPU a run measures on, so that tables from different processes and machines can be told apart: `facts`
    (`gpu_facts`) and `span()`, the SM and memory clocks, power draw, temperature and clock-event reasons that
    nvidia-smi samples every `period_ms` in the background while a block runs. Where nvidia-smi is missing or
    fails, spans stay empty."""

    def __init__(self, period_ms: int = 100):
        self.facts = gpu_facts()
        self._samples: list[tuple[float, list[str]]] = []
        self._sampler = None
        if "uuid" in self.facts:
            with contextlib.suppress(OSError):
                self._sampler = subprocess.Popen(_smi_query(_GPU_SAMPLED) + [f"--loop-ms={period_ms}"], text=True,
                                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._sampler.stdout:
            values = [v.strip() for v in line.split(",")]
            if len(values) == len(_GPU_SAMPLED):
                self._samples.append((time.monotonic(), values))

    @contextlib.contextmanager
    def span(self):
        """Yields a dict that holds, once the block ends, what the samples taken during it read: the SM clock's
        median and least MHz, the memory clock's median MHz, the median and most power drawn (W), the hottest
        temperature (C), and the clock-event reasons seen (NVML's names: "idle" between calls, none while the GPU
        works at its top clock, "sw_power_cap" where the power limit held it down); nothing where no sample was
        taken."""
        got, start = {}, time.monotonic()
        yield got
        end = time.monotonic()
        samples = [dict(zip(_GPU_SAMPLED, v)) for t, v in self._samples if start <= t <= end]

        def numbers(field):
            return [float(s[field]) for s in samples if s[field].replace(".", "", 1).isdigit()]

        sm, mem, power, temp = (numbers(f) for f in ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"))
        events = 0
        for s in samples:
            with contextlib.suppress(ValueError):
                events |= int(s["clocks_event_reasons.active"], 16)
        if sm:
            got.update(samples=len(samples), sm_mhz=statistics.median(sm), sm_mhz_min=min(sm),
                       mem_mhz=statistics.median(mem) if mem else None,
                       power_w=statistics.median(power) if power else None, power_w_max=max(power, default=None),
                       temperature_c_max=max(temp, default=None),
                       clock_events=[name for bit, name in _CLOCK_EVENTS.items() if events & bit])

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.terminate()
            self._sampler.wait()


def describe_span(got: dict) -> str:
    """A `GpuMonitor.span()` result in a few words for a printed row ("" when it holds nothing)."""
    if not got:
        return ""
    events = ",".join(e for e in got["clock_events"] if e != "idle") or "none"
    return (f"  [SM {got['sm_mhz']:.0f} MHz (least {got['sm_mhz_min']:.0f}), {got['power_w_max'] or 0:.0f} W at most, "
            f"clock events: {events}]")


def row_recorder(out_dir: str, name: str):
    """(device, record): the first GPU's kind, printed as the run's header, and `record(row)`, which appends a row
    to {"device", "gpu", "rows"} ("gpu": `gpu_facts`, so runs on different cards can be told apart) and writes it
    to `out_dir`/`name` after every row, so a run cut short keeps its rows."""
    device = jax.devices()[0].device_kind
    print(f"# {device}", flush=True)
    result, path = {"device": device, "gpu": gpu_facts(), "rows": []}, os.path.join(out_dir, name)
    os.makedirs(out_dir, exist_ok=True)

    def record(row: dict) -> None:
        result["rows"].append(row)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    return device, record


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


def patched_model(model_def, target, attribute: str, value, inline: tuple = ()):
    """(a copy of `model_def`, a context manager, calls): the copy is a jit cache key of its own (a `ModelDef`
    hashes by identity), so a step of it traced inside the context sees `target.attribute` answer `value`
    whatever its arguments (a function `value`: `target.attribute` is it); `calls` records each call of the
    patched rule, to check that the trace saw it.
    `inline`: (module, name) pairs of jitted functions that the model calls and that read the rule; inside
    the context they run unjitted, since a jit's trace cache is keyed by its arguments, not by the rule, and
    would hand the copy the shipped trace (or the shipped step the copy's)."""
    calls = []

    @contextlib.contextmanager
    def patched():
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(
                target, attribute, lambda *args: calls.append(args) or (value(*args) if callable(value) else value)))
            for module, name in inline:
                stack.enter_context(mock.patch.object(module, name, getattr(module, name).__wrapped__))
            yield

    return copy.copy(model_def), patched, calls


def time_variants(params, call, cache, lora, variants: dict) -> tuple[dict, object]:
    """Model steps compiled as variants of one step, timed in alternating rounds: `variants` maps a name to
    (model_def, options, patch), `patch` a context manager factory inside which that variant's step traces (None:
    as shipped) and `model_def` a jit cache key of its own where there is one (`copy.copy` of the model's: a
    `ModelDef` hashes by identity), so that the patch reaches it. The first variant is the reference. Returns
    ({"ms": {name: median ms}, "kernels": {name: kernels a step}, "logits_max_abs_diff" and
    "logits_equal_fraction": {name: against the first}}, cache); the logits are compared first."""
    from jlora.runner import forward

    logits = {}
    for name, (model_def, options, patch) in variants.items():
        with (patch or contextlib.nullcontext)():  # the variant's step traces here
            logits[name], cache = forward(model_def, params, call, cache, lora, options)
    runs = {name: (lambda c, model_def=model_def, options=options: forward(model_def, params, call, c, lora, options))
            for name, (model_def, options, _) in variants.items()}
    got, cache = count_and_time(runs, cache)
    first = next(iter(logits.values()))
    return dict(got, logits_max_abs_diff={name: float(jnp.abs(v - first).max()) for name, v in logits.items()},
                logits_equal_fraction={name: float(jnp.mean(v == first)) for name, v in logits.items()}), cache


def variants_row(name: str, got: dict, **extra) -> dict:
    """`time_variants`' result as a JSON row, printed: the case's `name`, `extra`, and each variant's median ms,
    its ratio to the first's, kernels a step and how its logits differ from the first's."""
    ms = got["ms"]
    first = next(iter(ms.values()))
    row = dict(case=name, **extra, **got)
    print(f"{name}: " + ", ".join(
        f"{v} {t:.3f} ms ({t / first:.3f}x, {got['kernels'][v]} kernels, logits max |diff| "
        f"{got['logits_max_abs_diff'][v]:.2g})" for v, t in ms.items()), flush=True)
    return row


def compare_patched(model_def, params, call, cache, lora, options, target, attribute: str, value,
                    labels: tuple[str, str], inline: tuple = ()) -> tuple[dict, object]:
    """A model step as shipped against the same step traced with `target.attribute` answering (or being) `value`
    (`patched_model`, with `inline`), timed in alternating rounds: ({"ms": {label: median ms}, "kernels": {label: kernels a
    step}, "logits_max_abs_diff", "logits_equal_fraction"}, cache). The logits are compared first."""
    shipped, patched_label = labels
    patched_def, patched, traced = patched_model(model_def, target, attribute, value, inline)
    got, cache = time_variants(params, call, cache, lora, {patched_label: (patched_def, options, patched),
                                                           shipped: (model_def, options, None)})
    assert traced, f"the patched variant did not trace {attribute}"
    return dict(ms=got["ms"], kernels=got["kernels"], logits_max_abs_diff=got["logits_max_abs_diff"][shipped],
                logits_equal_fraction=got["logits_equal_fraction"][shipped]), cache


def patched_row(name: str, got: dict, labels: tuple[str, str], **extra) -> dict:
    """`compare_patched`'s result as a JSON row, printed: the case's `name`, `extra`, each variant's median ms
    (`<label>_ms`, spaces as underscores), the first label's ratio to the second, the kernels a step and how the
    logits differ."""
    ms, kernels = got["ms"], got["kernels"]
    first, second = labels
    row = dict(case=name, **extra, **{f"{label.replace(' ', '_')}_ms": ms[label] for label in labels},
               ratio=ms[first] / ms[second], kernels=kernels, logits_max_abs_diff=got["logits_max_abs_diff"],
               logits_equal_fraction=got["logits_equal_fraction"])
    print(f"{name:28s} {first} {ms[first]:7.3f} ms ({kernels[first]} kernels), {second} {ms[second]:7.3f} ms "
          f"({kernels[second]}): {row['ratio']:.3f}x" + "".join(f"; {k} {v}" for k, v in extra.items())
          + f"; logits max |diff| {row['logits_max_abs_diff']:.3g}, equal {row['logits_equal_fraction']:.3f}",
          flush=True)
    return row


def count_and_time(runs: dict, cache) -> tuple[dict, object]:
    """({"ms": {label: median ms}, "kernels": {label: kernels a step}}, cache) of `run(cache) -> (logits, cache)`
    for each of `runs`: each traced once, then timed in alternating rounds (`model.time_alternating`)."""
    from model import time_alternating  # bench/model.py imports this module

    kernels = {}
    for variant, run in runs.items():
        holder = [cache]

        def steps(run=run, holder=holder):
            out, holder[0] = run(holder[0])
            return out

        kernels[variant] = sum(len(d) for d in trace_kernels(steps).values())
        cache = holder[0]
    times, cache = time_alternating(runs, cache)
    return dict(ms={variant: statistics.median(t) * 1e3 for variant, t in times.items()}, kernels=kernels), cache


def pyplot():
    """matplotlib's pyplot on its file backend, or None (said once per plot) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt
