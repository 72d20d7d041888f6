"""Where the inter-token latency of a tenancy run goes: a timeline of the engine loop and the loader threads.

Runs bench/tenancy.py (its arguments follow) with the engine loop's `Batcher.step` and `AdapterPool.install` and
the loader's `AdapterPool.prepare` and `stage` timed. Each interval between two step dispatches is what every row
that step decodes waits for its token; per run, intervals are classed by what happened in them:
  - write: the loop wrote an adapter into a slot (`AdapterPool.install`);
  - prompt: the step, or the one before it whose end it waits for, took prompt tokens;
  - loading: a loader thread was reading (prepare) or copying (stage) an adapter.
For each class: intervals, the share of decoded tokens, p50 / p99 of the interval weighted by the rows it
decodes (so comparable with the client's inter-token latency, also printed). Written to `--out` as
loop_timeline.json (the summary per run); `--events` also keeps every event.

  python bench/studies/loop_timeline.py [--events] [tenancy.py's arguments, e.g. --alphas 1 --adapters 32,1000]
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLASSES = ("write", "prompt", "loading")


def timed(events: list, cls, name: str, detail=None) -> None:
    """Replaces `cls.name` with a wrapper that appends (name, start, end, thread, detail(self)) to `events`."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            events.append((name, start, time.perf_counter(), threading.get_ident(),
                           None if detail is None else detail(self)))

    setattr(cls, name, wrapper)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    if not len(values) or weights.sum() == 0:
        return None
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, q * cumulative[-1])])


def summarize(events: list, begin: float, end: float) -> dict:
    """The step intervals within [begin, end) by class (see the module docstring)."""
    steps = sorted((e for e in events if e[0] == "step" and begin <= e[1] < end and e[4]), key=lambda e: e[1])
    writes = np.array([e[1] for e in events if e[0] == "install" and begin <= e[1] < end])
    loads = [(e[1], e[2]) for e in events if e[0] in ("prepare", "stage") and e[2] > begin and e[1] < end]
    rows = []
    for before, step, after in zip([None] + steps[:-2], steps[:-1], steps[1:]):
        a, b = step[1], after[1]
        prompt = step[4][0] > 0 or (before is not None and before[4][0] > 0)
        rows.append((b - a, step[4][1], bool(((writes >= a) & (writes < b)).any()), prompt,
                     any(s < b and e > a for s, e in loads)))
    if not rows:
        return {"intervals": 0}
    interval, decoded = np.array([r[0] for r in rows]), np.array([r[1] for r in rows], float)
    flags = {c: np.array([r[2 + i] for r in rows]) for i, c in enumerate(CLASSES)}
    out = {"intervals": len(rows), "p50_ms": weighted_quantile(interval, decoded, 0.5) * 1e3,
           "p99_ms": weighted_quantile(interval, decoded, 0.99) * 1e3, "classes": {}}
    names = ["none"] + [c for c in CLASSES] + ["write+loading", "prompt+loading"]
    masks = {"none": ~(flags["write"] | flags["prompt"] | flags["loading"]), **flags,
             "write+loading": flags["write"] & flags["loading"], "prompt+loading": flags["prompt"] & flags["loading"]}
    for name in names:
        m = masks[name]
        p50, p99 = (weighted_quantile(interval[m], decoded[m], q) for q in (0.5, 0.99))
        out["classes"][name] = {"intervals": int(m.sum()), "token_share": float(decoded[m].sum() / decoded.sum()),
                                "p50_ms": None if p50 is None else p50 * 1e3,
                                "p99_ms": None if p99 is None else p99 * 1e3}
    prompts = np.array([s[4][0] for s in steps if s[4][0] > 0])
    if len(prompts):
        out["prompt_tokens_per_step"] = {"steps": len(prompts), "p50": float(np.median(prompts)),
                                         "p99": float(np.percentile(prompts, 99)), "mean": float(prompts.mean())}
    return out


def main() -> None:
    import serve
    import tenancy
    from jlora.adapters.pool import AdapterPool
    from jlora.scheduler import Batcher

    keep = "--events" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--events"]
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "bench/results"
    events: list = []
    timed(events, Batcher, "step", lambda b: None if b.in_flight is None else
          (sum(p[3] for p in b.in_flight.pieces), len(b.in_flight.sampling)))
    timed(events, AdapterPool, "install")
    timed(events, AdapterPool, "prepare")
    timed(events, AdapterPool, "stage")
    runs = []
    send = tenancy.send

    def measured_send(client, url, rate, requests, rng):
        begin = time.perf_counter()
        record = send(client, url, rate, requests, rng)
        if np.isfinite(rate):  # a measured run (the warm-up waves go at once)
            row = summarize(events, begin, time.perf_counter())
            row["client_itl_p99_ms"] = serve.summarize(record, 1)["itl_p99_ms"]
            row["models"] = len({r["model"] for r in requests})
            runs.append(row)
            print(json.dumps(row, indent=1), flush=True)
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "loop_timeline.json"), "w") as f:
                json.dump({"runs": runs, **({"events": events} if keep else {})}, f)
        return record

    tenancy.send = measured_send
    tenancy.main()


if __name__ == "__main__":  # the client process (spawned) imports this module: only the parent runs
    main()
