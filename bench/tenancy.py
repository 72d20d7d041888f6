"""Tenancy benchmark, as S-LoRA measured it: `jlora serve` with N registered adapters over `--max-loras` slots.

N distinct PEFT adapters (q_proj and v_proj, PEFT's default for Llama; ranks drawn from 8, 16, 32 and 64;
random bf16) are written to local disk and registered on a Llama-3-8B-shaped model with random weights
(`--tiny`: a tiny float32 model, a CPU smoke run). A request picks adapter k of the N with weight
1 / (k + 1)^α (α = 1, and a flatter α = 0.5) and arrives at Poisson times of `--rate` per second: 65-128
random prompt tokens, 16-256 output tokens (ignore_eos), streamed through uvicorn to a client process. Every
run of one α sends the same arrival times, prompts and lengths; only the adapters drawn differ.

Runs go N ascending for each α on one server, so the tiers carry over from run to run. Before an α's first
run, its arrivals are sent once, unmeasured, on resident adapters: a step shape first seen compiles for
seconds, and waves of requests sent at once do not make every shape arrivals make. Before each run a
wave of one request per slot's worth of the most popular adapters makes them resident (N = `--max-loras`:
every adapter resident, no loads), and the OS drops the adapter files' pages (posix_fadvise), so a read
from disk is one. Per run: throughput, TTFT and inter-token latency (p50 / p99), the TTFT of requests that
found their adapter on disk (an adapter's first request of the benchmark: nothing loads an adapter before a
request asks for it), the tiers' hit rates (the slots, the device cache, the host tier), and load latency (disk ->
host, host -> device; p50 / p99 from the server's histogram, interpolated within buckets as Prometheus'
histogram_quantile does).
With `--control-slots K`, a second server in the same process, over the same weights with K slots, runs each
run's arrivals again after a wave that makes every adapter they ask for resident: the same adapters in the
same batches with no loads, so a ratio against it isolates what loads cost from what serving more distinct
adapters per batch costs. With `--repeat K` an α's runs go K times, the Ns alternating (32, 512, 32, 512...),
and each N's latencies are pooled over its K runs (after each round, so a run cut short keeps the rounds done):
the p99 of one run moves by 0.83-1.14x from run to run on the same arrivals (docs/performance.md § Tenancy), the
pooled one less; so do its on-disk requests' TTFT and its loads' histograms. Table (tenancy.md), JSON and a plot
(tenancy.png).

  python bench/tenancy.py [--adapters 32,128,512,1000] [--alphas 1,0.5] [--rate 16] [--requests 384]
                          [--max-loras 32] [--control-slots 0] [--max-cpu-loras 128] [--device-cache-memory GIB]
                          [--adapter-readers 4] [--max-batch 32] [--repeat 1] [--out bench/results] [--tiny]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
import tempfile
import time

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve  # noqa: E402
from common import pyplot  # noqa: E402
from model import bench_model  # noqa: E402
from jlora.admission import AdapterStats  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from jlora.server.app import build_app  # noqa: E402
from jlora.server.config import ServerConfig  # noqa: E402
from jlora.server.online import OnlineEngine  # noqa: E402
from serve import compile_waves, percentile, random_requests, send, start_server, summarize  # noqa: E402
from tenancy_targets import device_cache  # noqa: E402

RANKS = (8, 16, 32, 64)
TARGETS = ("q_proj", "v_proj")
TIERS = ("device", "device_cache", "host")  # AdapterStats' hits and misses: the slots, the device cache, the host


def build_engines(tiny: bool, args, root: str) -> tuple[list[Engine], dict]:
    """The engine (no adapters yet), and with `--control-slots` a second one over the same weights with that many
    slots; the HF config of their model."""
    options = dict(max_lora_rank=max(RANKS), max_batch=args.max_batch, max_seq_len=512,
                   max_cpu_loras=args.max_cpu_loras, prefill_chunk=args.prefill_chunk,
                   adapter_readers=args.adapter_readers)
    model, cfg, dtype = bench_model(tiny, root)
    served = Engine(model, dtype=dtype, max_loras=args.max_loras, device_cache_memory=args.device_cache_memory,
                    **options)
    control = [Engine(model, dtype=dtype, max_loras=args.control_slots, **options)] if args.control_slots else []
    return [served, *control], cfg


def write_adapters(root: str, cfg: dict, n: int, rng) -> list[str]:
    """`n` distinct PEFT adapter directories under `root` (their paths): each tensor a slice of one random
    bf16 pool at a random offset (distinct contents without drawing every value), synced to disk."""
    pool = (rng.standard_normal(1 << 26, dtype=np.float32) * 0.01).astype(ml_dtypes.bfloat16)
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    shapes = {"q_proj": (cfg["hidden_size"], cfg["num_attention_heads"] * d),
              "v_proj": (cfg["hidden_size"], cfg["num_key_value_heads"] * d)}
    paths = []
    for i in range(n):
        rank = int(rng.choice(RANKS))
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for name, (din, dout) in shapes.items():
                module = f"base_model.model.model.layers.{layer}.self_attn.{name}"
                for part, shape in (("lora_A", (rank, din)), ("lora_B", (dout, rank))):
                    start = int(rng.integers(0, pool.size - shape[0] * shape[1]))
                    tensors[f"{module}.{part}.weight"] = pool[start:start + shape[0] * shape[1]].reshape(shape)
        path = os.path.join(root, f"a{i}")
        os.makedirs(path)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                       "bias": "none", "task_type": "CAUSAL_LM"}, f)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        paths.append(path)
        if i % 100 == 99:
            print(f"# {i + 1} adapters written", flush=True)
    os.sync()
    return paths


def drop_page_cache(paths: list[str]) -> None:
    """Asks the OS to drop the cached pages of every adapter's files, so the next read comes from disk."""
    for path in paths:
        for name in os.listdir(path):
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def histogram(registry, name: str, labels: dict) -> tuple[list[tuple[float, float]], float, float]:
    """A Prometheus histogram's cumulative buckets [(upper bound, count)], sum and count."""
    buckets = []
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == f"{name}_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
                buckets.append((float(s.labels["le"]), s.value))
    value = lambda suffix: registry.get_sample_value(f"{name}_{suffix}", labels) or 0.0
    return sorted(buckets), value("sum"), value("count")


def histogram_delta(before, after) -> dict:
    """p50, p99 (linear within buckets, as histogram_quantile) and mean in ms of what a histogram observed
    between two readings, and its cumulative bucket counts [(upper bound, count)] (for pooling runs); None
    percentiles when it observed nothing."""
    (b0, s0, c0), (b1, s1, c1) = before, after
    return bucket_summary([(le, n1 - dict(b0).get(le, 0.0)) for le, n1 in b1], s1 - s0, c1 - c0)


def bucket_summary(cumulative: list[tuple[float, float]], total: float, count: float) -> dict:
    """p50, p99 and mean in ms of a histogram's cumulative buckets [(upper bound, count)], its sum (s) and count."""
    if count == 0:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "mean_ms": None, "buckets": cumulative}

    def quantile(q: float) -> float:
        rank, lower, below = q * count, 0.0, 0.0
        for le, n in cumulative:
            if n >= rank:
                if le == float("inf"):
                    return lower
                return lower + (le - lower) * (rank - below) / max(n - below, 1e-12)
            lower, below = le, n
        return lower

    return {"count": int(count), "p50_ms": quantile(0.5) * 1e3, "p99_ms": quantile(0.99) * 1e3,
            "mean_ms": total / count * 1e3, "buckets": cumulative}


def pooled_histogram(runs: list[dict]) -> dict:
    """One histogram summary of several runs' `histogram_delta`s: their bucket counts added."""
    counts = collections.Counter()
    for run in runs:
        counts.update(dict(run["buckets"]))
    total = sum((run["mean_ms"] or 0.0) * run["count"] / 1e3 for run in runs)
    return bucket_summary(sorted(counts.items()), total, sum(run["count"] for run in runs))


def pick_models(rng, n: int, alpha: float, size: int) -> list[str]:
    weights = 1.0 / np.arange(1, n + 1) ** alpha
    return [f"a{k}" for k in rng.choice(n, size=size, p=weights / weights.sum())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", default="32,128,512,1000", help="numbers of registered adapters, N")
    parser.add_argument("--alphas", default="1,0.5", help="popularity exponents: adapter k drawn with 1/(k+1)^α")
    parser.add_argument("--rate", type=float, default=16, help="arrival rate, requests per second")
    parser.add_argument("--requests", type=int, default=384, help="requests per run")
    parser.add_argument("--max-loras", type=int, default=32, help="device slots")
    parser.add_argument("--control-slots", type=int, default=0,
                        help="a second server over the same weights with this many slots runs each run's arrivals "
                             "again, every adapter they use made resident first: the run without loads (0: none)")
    parser.add_argument("--max-cpu-loras", type=int, default=128, help="host tier: adapters")
    parser.add_argument("--device-cache-memory", type=float, default=None, metavar="GIB",
                        help="device cache: GiB of adapters kept on the device beside the slots (default: none)")
    parser.add_argument("--adapter-readers", type=int, default=4, help="reader processes (and loader threads)")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per step at most")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each N per α, alternating with the other Ns; latencies pooled over them")
    parser.add_argument("--tiny", action="store_true", help="a tiny float32 model (a smoke run on CPU)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    counts, alphas = [int(n) for n in args.adapters.split(",")], [float(a) for a in args.alphas.split(",")]
    rng = np.random.default_rng(0)
    device = jax.devices()[0].device_kind
    rows, pooled = [], {}  # pooled: α -> its Ns' pooled rows
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as root:
        engines, cfg = build_engines(args.tiny, args, root)
        start = time.perf_counter()
        paths = write_adapters(root, cfg, max(counts), rng)
        print(f"# {len(paths)} adapters written in {time.perf_counter() - start:.0f} s", flush=True)
        servers = [Server(engine, paths) for engine in engines]
        served, control = servers[0], (servers[1] if len(servers) > 1 else None)
        vocab = engines[0].model_config.vocab_size
        client = multiprocessing.get_context("spawn").Pool(1)
        for server, waves in zip(servers, (rng, np.random.default_rng(1))):  # (the control's: arrivals as without it)
            compile_waves(client, server.url, waves, vocab, args.max_batch, ["a0", "base"])
        touched = {"a0"}
        for alpha in alphas:
            trace_seed = int(rng.integers(1 << 31))
            records = {}  # (N, "served" or "control") -> the client's records of its runs
            colds = {}  # N -> the TTFTs of its runs' requests that found their adapter on disk
            alpha_rows = []
            for repeat, n in ((i, n) for i in range(args.repeat) for n in counts):
                warm = [f"a{k}" for k in range(min(n, args.max_loras))]
                send(client, served.url, float("inf"), random_requests(rng, vocab, warm), rng)
                touched.update(warm)
                # the α's arrivals once on resident adapters: the step shapes they make compile
                if n == counts[0] and repeat == 0:
                    for server in servers:
                        trace = np.random.default_rng(trace_seed)  # (serve.send: not `send`, which a study may time)
                        serve.send(client, server.url, args.rate, random_requests(
                            trace, vocab, [warm[i % len(warm)] for i in range(args.requests)]), trace)
                drop_page_cache(paths[:n])
                models = pick_models(rng, n, alpha, args.requests)
                cold = {i for i, m in enumerate(models) if m not in touched}
                touched.update(models)
                record, row = served.measure(client, args, trace_seed, models)
                records.setdefault((n, "served"), []).append(record)
                cold_ttft = [r["ttft"] for r in record if r["index"] in cold]
                colds.setdefault(n, []).extend(cold_ttft)
                row.update(alpha=alpha, adapters=n, repeat=repeat, distinct=len(set(models)),
                           cold_requests=len(cold_ttft))
                row["cold_ttft_p50_ms"] = percentile(cold_ttft, 0.5) * 1e3 if cold_ttft else None
                row["cold_ttft_p99_ms"] = percentile(cold_ttft, 0.99) * 1e3 if cold_ttft else None
                d2h, h2d = row["disk_to_host"]["p99_ms"], row["host_to_device"]["p99_ms"]
                # what the target bounds an on-disk request's TTFT p99 by: a load, then one step
                row["load_plus_step_ms"] = None if d2h is None else d2h + (h2d or 0.0) + row["itl_p99_ms"]
                if control is not None and len(set(models)) > args.control_slots:
                    print(f"# no all-resident run: {len(set(models))} adapters used, {args.control_slots} slots",
                          flush=True)
                elif control is not None:
                    # the same arrivals with every adapter they ask for resident beforehand: no loads
                    wave = sorted(set(models))
                    send(client, control.url, float("inf"), random_requests(np.random.default_rng(n), vocab, wave),
                         np.random.default_rng(n))
                    record, row["control"] = control.measure(client, args, trace_seed, models)
                    records.setdefault((n, "control"), []).append(record)
                print(format_row(row), flush=True)
                rows.append(row)
                alpha_rows.append(row)
                if args.repeat > 1 and n == counts[-1]:  # a round of Ns done: pool the rounds so far
                    pooled[alpha] = pool_runs(alpha, counts, records, colds, alpha_rows, args.max_batch)
                save(args, device, rows, pooled)  # after every run: a call cut short keeps what it measured
        client.close()
        for server in servers:
            server.stop()


class Server:
    """An engine with the benchmark's adapters registered, served by uvicorn on a localhost port."""

    def __init__(self, engine: Engine, paths: list[str]):
        for i, path in enumerate(paths):
            engine.register_adapter(f"a{i}", path)
        self.online = OnlineEngine(engine, max_waiting=100_000)
        self.stop, self.url = start_server(build_app(self.online, ServerConfig(served_model_name="base")))

    def measure(self, client, args, trace_seed: int, models: list[str]) -> tuple[list[dict], dict]:
        """The α's arrivals (`trace_seed`) asking for `models`: the client's record, and the run's row: latency,
        throughput, tier hit rates and what the server's histograms observed during it."""
        stats, registry = self.online.admission.stats, self.online.metrics.registry
        tiers = [(getattr(stats, f"{t}_hits"), getattr(stats, f"{t}_misses")) for t in TIERS]
        loads = [histogram(registry, "jlora_adapter_load_seconds", {"stage": s}) for s in AdapterStats.STAGES]
        steps = histogram(registry, "jlora_step_seconds", {})
        trace = np.random.default_rng(trace_seed)  # every N of an α: the same arrivals and lengths
        vocab = self.online.engine.model_config.vocab_size
        record = send(client, self.url, args.rate, random_requests(trace, vocab, models), trace)
        row = summarize(record, args.max_batch)
        for tier, (hits, misses) in zip(TIERS, tiers):
            hits, misses = getattr(stats, f"{tier}_hits") - hits, getattr(stats, f"{tier}_misses") - misses
            row[f"{tier}_hit_rate"] = hits / (hits + misses) if hits + misses else None
        for stage, before in zip(AdapterStats.STAGES, loads):
            row[stage] = histogram_delta(before, histogram(registry, "jlora_adapter_load_seconds", {"stage": stage}))
        row["step"] = histogram_delta(steps, histogram(registry, "jlora_step_seconds", {}))
        return record, row


def pool_runs(alpha: float, counts: list[int], records: dict, colds: dict, rows: list[dict],
              max_batch: int) -> list[dict]:
    """Per N, its runs pooled (`--repeat`): the latencies of all its requests, its on-disk requests' TTFT p99
    against the pooled loads' bound (disk -> host p99 + host -> device p99 + ITL p99), and the ITL p99 against
    the fewest N's pooled and the same runs' all-resident (control) ones."""
    pooled = []
    for n in counts:
        runs = [r for r in rows if r["adapters"] == n]
        row = {"alpha": alpha, "adapters": n, "runs": len(runs),
               **summarize([r for run in records[n, "served"] for r in run], max_batch)}
        mean_rates(row, runs)
        for stage in AdapterStats.STAGES:
            row[stage] = pooled_histogram([r[stage] for r in runs])
        d2h, h2d = row["disk_to_host"]["p99_ms"], row["host_to_device"]["p99_ms"]
        row["cold_requests"] = len(colds[n])
        row["cold_ttft_p99_ms"] = percentile(colds[n], 0.99) * 1e3 if colds[n] else None
        row["load_plus_step_ms"] = None if d2h is None else d2h + (h2d or 0.0) + row["itl_p99_ms"]
        if (n, "control") in records:
            row["control"] = summarize([r for run in records[n, "control"] for r in run], max_batch)
            mean_rates(row["control"], [r["control"] for r in runs if "control" in r])
            row["itl_p99_vs_resident"] = row["itl_p99_ms"] / row["control"]["itl_p99_ms"]
        row["itl_p99_vs_fewest"] = row["itl_p99_ms"] / pooled[0]["itl_p99_ms"] if pooled else 1.0
        pooled.append(row)
        print(f"pooled over {row['runs']} runs: alpha {alpha:g} N {n:5d}: ITL p50 {row['itl_p50_ms']:.2f} / p99 "
              f"{row['itl_p99_ms']:.2f} ms ({row['itl_p99_vs_fewest']:.2f}x the fewest N"
              + (f", {row['itl_p99_vs_resident']:.2f}x all resident" if "control" in row else "")
              + f"); on disk: {row['cold_requests']} requests, TTFT p99 {ms(row['cold_ttft_p99_ms'])} ms, load + "
              f"step p99 {ms(row['load_plus_step_ms'])} ms", flush=True)
    return pooled


def mean_rates(pooled: dict, runs: list[dict]) -> None:
    """A pooled row's throughputs: the mean of its runs' (a rate over the span of all runs would count the time
    between them); None where no run measured one."""
    for key in ("tokens_per_s", "steady_tokens_per_s"):
        rates = [r[key] for r in runs if r[key] is not None]
        pooled[key] = float(np.mean(rates)) if rates else None


def save(args, device: str, rows: list[dict], pooled: dict[float, list[dict]]) -> None:
    """The runs so far as JSON, a table and a plot in `args.out`; each against its α's run of fewest adapters (of
    the same repeat), and the pooled latencies of `--repeat`."""
    fewest = {}
    for r in rows:
        first = fewest.setdefault((r["alpha"], r.get("repeat", 0)), r)
        r["throughput_vs_fewest"] = r["tokens_per_s"] / first["tokens_per_s"]
        r["itl_p99_vs_fewest"] = r["itl_p99_ms"] / first["itl_p99_ms"]
    os.makedirs(args.out, exist_ok=True)
    name = "tenancy_tiny" if args.tiny else "tenancy"
    result = {"device": device, "max_batch": args.max_batch, "prefill_chunk": args.prefill_chunk,
              "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras,
              "device_cache_memory": args.device_cache_memory,
              "adapter_readers": args.adapter_readers, "rate": args.rate,
              "requests": args.requests, "ranks": RANKS, "rows": rows,
              "pooled": [r for alpha_rows in pooled.values() for r in alpha_rows]}
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_table(result, os.path.join(args.out, f"{name}.md"))
    plot(result, os.path.join(args.out, f"{name}.png"))


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def slot_writes(r: dict) -> str:
    """The slot writes' count and host time p50 / p99 (rows saved before they were measured: -)."""
    w = r.get("slot_write") or {"count": 0}
    return "-" if not w["count"] else f"{w['count']} p50 {w['p50_ms']:.1f} / p99 {w['p99_ms']:.1f} ms"


def resident(r: dict) -> str:
    """The table's three all-resident columns: the same arrivals' ITL p50 and p99 with no loads, and the ratio."""
    c = r.get("control")
    if c is None:
        return "- | - | -"
    return f"{c['itl_p50_ms']:.2f} | {c['itl_p99_ms']:.2f} | {r['itl_p99_ms'] / c['itl_p99_ms']:.2f}"


def waits(r: dict) -> str:
    """p50 / p99 ms of the loads' waits for a loader thread and for a slot (rows saved before they were measured: -)."""
    q, w = r.get("queued"), r.get("slot_wait")
    if not q or not q["count"]:
        return "-"
    return (f"thread {ms(q['p50_ms'])} / {ms(q['p99_ms'])}, slot "
            + ("-" if not w["count"] else f"{ms(w['p50_ms'])} / {ms(w['p99_ms'])}"))


def format_row(r: dict) -> str:
    d2h, h2d = r["disk_to_host"], r["host_to_device"]
    c = r.get("control")
    control = "" if c is None else (f"; all resident: ITL p50 {c['itl_p50_ms']:.2f} / p99 {c['itl_p99_ms']:.2f} ms, "
                                    f"{c['tokens_per_s']:.0f} tok/s, device hits {rate(c['device_hit_rate'])}")
    return (f"alpha {r['alpha']:g} N {r['adapters']:5d} ({r['distinct']} used): {r['tokens_per_s']:6.0f} tok/s, "
            f"TTFT p50 {r['ttft_p50_ms']:.0f} / p99 {r['ttft_p99_ms']:.0f} ms (on disk: {r['cold_requests']} requests, "
            f"p50 {ms(r['cold_ttft_p50_ms'])} / p99 {ms(r['cold_ttft_p99_ms'])} ms; load + step p99 "
            f"{ms(r['load_plus_step_ms'])} ms), ITL p50 {r['itl_p50_ms']:.2f} / "
            f"p99 {r['itl_p99_ms']:.2f} ms, engine step p50 {ms(r['step']['p50_ms'])} / p99 "
            f"{ms(r['step']['p99_ms'])} ms, hits device {rate(r['device_hit_rate'])} device cache "
            f"{rate(r.get('device_cache_hit_rate'))} host {rate(r['host_hit_rate'])}, "
            f"loads disk->host {d2h['count']} p50 {ms(d2h['p50_ms'])} / p99 {ms(d2h['p99_ms'])} ms, host->device "
            f"{h2d['count']} p50 {ms(h2d['p50_ms'])} / p99 {ms(h2d['p99_ms'])} ms, waits {waits(r)} ms, "
            f"slot writes {slot_writes(r)}{control}")


def write_table(result: dict, path: str) -> None:
    with open(path, "w") as f:
        f.write(f"Device: {result['device']}; batch {result['max_batch']}, prefill_chunk {result['prefill_chunk']}; "
                f"{result['max_loras']} device slots, host "
                f"tier {result['max_cpu_loras']} adapters, {device_cache(result)}, "
                f"{result.get('adapter_readers', 4)} readers; "
                "q_proj + v_proj adapters of ranks "
                f"{'/'.join(map(str, result['ranks']))}; Poisson arrivals at {result['rate']:g} req/s, "
                f"{result['requests']} requests per run.\n\n"
                "| α | N | used | tok/s | vs fewest N | TTFT p50 ms | TTFT p99 ms | on disk: requests | TTFT p50 ms | "
                "TTFT p99 ms | load + step p99 ms | ITL p50 ms | ITL p99 ms | ITL p99 vs fewest N | device hits | "
                "device cache hits | host hits | "
                "disk→host loads | p50 ms | p99 ms | host→device loads | p50 ms | p99 ms | waits p50 / p99 ms | "
                "slot writes (host time) | all resident: ITL p50 ms | ITL p99 ms | ITL p99 vs all resident |\n"
                f"|{'---|' * 28}\n")
        for r in result["rows"]:
            d2h, h2d = r["disk_to_host"], r["host_to_device"]
            f.write(f"| {r['alpha']:g} | {r['adapters']} | {r['distinct']} | {r['tokens_per_s']:.0f} | "
                    f"{r['throughput_vs_fewest']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                    f"{r['cold_requests']} | {ms(r['cold_ttft_p50_ms'])} | {ms(r['cold_ttft_p99_ms'])} | "
                    f"{ms(r['load_plus_step_ms'])} | "
                    f"{r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['itl_p99_vs_fewest']:.2f} | "
                    f"{rate(r['device_hit_rate'])} | {rate(r.get('device_cache_hit_rate'))} | "
                    f"{rate(r['host_hit_rate'])} | {d2h['count']} | "
                    f"{ms(d2h['p50_ms'])} | {ms(d2h['p99_ms'])} | {h2d['count']} | {ms(h2d['p50_ms'])} | "
                    f"{ms(h2d['p99_ms'])} | {waits(r)} | {slot_writes(r)} | {resident(r)} |\n")
        if result.get("pooled"):
            f.write("\nLatencies pooled over each N's runs (`--repeat`):\n\n| α | N | runs | TTFT p99 ms | on disk: "
                    "requests | TTFT p99 ms | load + step p99 ms | ITL p50 ms | ITL p99 ms | ITL p99 vs fewest N | "
                    f"all resident: ITL p99 ms | ITL p99 vs all resident |\n|{'---|' * 12}\n")
            for r in result["pooled"]:
                c = r.get("control")
                f.write(f"| {r['alpha']:g} | {r['adapters']} | {r['runs']} | {r['ttft_p99_ms']:.0f} | "
                        f"{r['cold_requests']} | {ms(r['cold_ttft_p99_ms'])} | {ms(r['load_plus_step_ms'])} | "
                        f"{r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['itl_p99_vs_fewest']:.2f} | "
                        + ("- | - |" if c is None else f"{c['itl_p99_ms']:.2f} | {r['itl_p99_vs_resident']:.2f} |")
                        + "\n")


def plot(result: dict, path: str) -> None:
    """Throughput, TTFT and inter-token latency against the number of adapters, one line per α (its first runs)."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("tokens/s", [("", "tokens_per_s")]),
              ("time to first token, ms", [("p50", "ttft_p50_ms"), ("p99", "ttft_p99_ms")]),
              ("inter-token latency, ms", [("p50", "itl_p50_ms"), ("p99", "itl_p99_ms")])]
    for ax, (ylabel, series) in zip(axes, panels):
        for alpha in sorted({r["alpha"] for r in result["rows"]}, reverse=True):
            rows = [r for r in result["rows"] if r["alpha"] == alpha and r.get("repeat", 0) == 0]  # one pass of Ns
            for label, key in series:
                ax.plot([r["adapters"] for r in rows], [r[key] for r in rows], marker="o",
                        label=f"α={alpha:g} {label}".strip())
        ax.set_xscale("log")
        ax.set_xlabel("adapters registered, N")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[0].set_ylim(bottom=0)
    axes[1].set_yscale("log")
    fig.suptitle(f"jlora serve on {result['device']}: {result['max_loras']} device slots, host tier "
                 f"{result['max_cpu_loras']}, {device_cache(result)}, Poisson {result['rate']:g} req/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
