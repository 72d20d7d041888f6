"""Serving benchmark: `jlora serve`'s HTTP API under Poisson arrivals, against the bare engine loop.

A Llama-3-8B-shaped model with random bf16 weights (`--tiny`: a tiny float32 model, a CPU smoke run) serves
32 r=16 adapters (one random adapter under 32 names: 32 weight stacks) and the base model, popularity
skewed as in S-LoRA's experiments (adapter i drawn with weight 1 / (i + 1), the base model as often as the
top adapter). Prompts of 65-128 random tokens, outputs of 16-256 tokens (ignore_eos). Requests stream
through uvicorn on localhost from an asyncio client in another process (its Python never competes with
the server's for the interpreter lock). Per arrival rate: throughput, time to first token and inter-token
latency (p50 / p99), as a table (serve.md), JSON and a plot (serve.png). The reference: `Engine.generate`'s
decode step at batch `--max-batch` on distinct adapters (the bare engine loop), its tokens per second and its
step time.

  python bench/serve.py [--rates 4,16,64,inf] [--requests 96] [--max-batch 32] [--prefill-chunk 512]
                        [--out bench/results] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import pyplot  # noqa: E402
from jlora import testing  # noqa: E402
from jlora.adapters.peft import LINEAR_MODULES  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from jlora.server.app import build_app  # noqa: E402
from jlora.server.config import ServerConfig  # noqa: E402
from jlora.server.online import OnlineEngine  # noqa: E402

ADAPTERS, RANK = 32, 16


def build_engine(tiny: bool, max_batch: int, prefill_chunk: int, root: str) -> tuple[Engine, dict]:
    """The engine with ADAPTERS adapters loaded, and the HF config of its model."""
    if tiny:
        cfg = testing.tiny_config("llama", vocab_size=256)
        testing.write_model(f"{root}/m", cfg, seed=0)
        engine = Engine.from_pretrained(f"{root}/m", dtype="float32", max_loras=ADAPTERS, max_lora_rank=RANK,
                                        max_batch=max_batch, max_seq_len=512, prefill_chunk=prefill_chunk,
                                        progress=False)
    else:
        from model import llama3_8b, llama3_8b_hf, random_model

        cfg = llama3_8b_hf(32)
        model_def, params = random_model(llama3_8b(32))
        engine = Engine(model_def.merge(params), max_loras=ADAPTERS, max_lora_rank=RANK, dtype=jnp.bfloat16,
                        max_batch=max_batch, max_seq_len=512, prefill_chunk=prefill_chunk)
    testing.write_adapter(f"{root}/a", cfg, r=RANK, alpha=2 * RANK, seed=1, target_modules=LINEAR_MODULES)
    for i in range(ADAPTERS):
        engine.load_adapter(f"a{i}", f"{root}/a")
    return engine, cfg


def bare_loop(engine: Engine, batch: int, rng) -> dict:
    """`Engine.generate`'s decode step for `batch` requests on distinct adapters: ms per step and tok/s."""
    prompts = rng.integers(0, engine.model_config.vocab_size, (batch, 96)).tolist()
    adapters = [f"a{i % ADAPTERS}" for i in range(batch)]
    run = lambda n: (lambda t0: (engine.generate(prompts, adapters, max_new_tokens=n), time.perf_counter() - t0)[1])(
        time.perf_counter())
    run(128)
    prefill = statistics.median(run(1) for _ in range(3))
    total = statistics.median(run(128) for _ in range(3))
    step = (total - prefill) / 127
    return {"step_ms": step * 1e3, "tokens_per_s": batch / step}


def pick_model(rng) -> str:
    weights = np.array([1.0] + [1 / (i + 1) for i in range(ADAPTERS)])
    i = rng.choice(ADAPTERS + 1, p=weights / weights.sum())
    return "base" if i == 0 else f"a{i - 1}"


async def one_request(http, url: str, index: int, body: dict, delay: float, record: list) -> None:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    times, tokens = [], 0
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids:
                times.append((time.perf_counter(), len(ids)))
                tokens += len(ids)
    assert tokens == body["max_tokens"], (tokens, body["max_tokens"])
    record.append({"index": index, "start": start, "end": times[-1][0], "ttft": times[0][0] - start,
                   "tokens": tokens, "times": times,
                   "itl": [(t - prev) / n for (prev, _), (t, n) in zip(times, times[1:])]})


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def steady_throughput(record: list[dict], rows: int) -> float | None:
    """Tokens per second while every row is busy: from the moment `rows` requests have their first token to
    the moment fewer than `rows` remain unfinished (None when that window is empty)."""
    if len(record) < rows:
        return None
    begin = sorted(r["start"] + r["ttft"] for r in record)[rows - 1]
    end = sorted(r["end"] for r in record)[len(record) - rows]
    if end <= begin:
        return None
    tokens = sum(n for r in record for t, n in r["times"] if begin < t <= end)
    return tokens / (end - begin)


def summarize(record: list[dict], rows: int) -> dict:
    """Throughput (the whole run, and while all `rows` are busy), TTFT and inter-token latency p50 / p99 in ms."""
    span = max(r["end"] for r in record) - min(r["start"] for r in record)
    itl = [x for r in record for x in r["itl"]]
    ttft = [r["ttft"] for r in record]
    return {"requests": len(record), "tokens_per_s": sum(r["tokens"] for r in record) / span,
            "steady_tokens_per_s": steady_throughput(record, rows),
            "ttft_p50_ms": percentile(ttft, 0.5) * 1e3, "ttft_p99_ms": percentile(ttft, 0.99) * 1e3,
            "itl_p50_ms": percentile(itl, 0.5) * 1e3, "itl_p99_ms": percentile(itl, 0.99) * 1e3}


def send(client, url: str, rate: float, requests: list[dict], rng) -> list[dict]:
    """The `requests` sent at Poisson arrivals of `rate` per second (inf: all at once) by the `client` process:
    one record per request (its `index` in `requests`, start, end, TTFT, token times, inter-token latencies)."""
    gaps = rng.exponential(1 / rate, len(requests)) if np.isfinite(rate) else np.zeros(len(requests))
    return client.apply(send_all, (url, requests, (np.cumsum(gaps) - gaps[0]).tolist()))


def send_all(url: str, requests: list[dict], delays: list[float]) -> list[dict]:
    """In the client process: sends every request at its delay and streams the answers."""
    return asyncio.run(_send_all(url, requests, delays))


async def _send_all(url: str, requests: list[dict], delays: list[float]) -> list[dict]:
    import httpx

    record = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(one_request(http, url, i, body, d, record)
                               for i, (body, d) in enumerate(zip(requests, delays))))
    return record


def start_server(app) -> tuple[Callable[[], None], str]:
    """`app` served by uvicorn on a free localhost port from a thread: a function that stops it (and waits until
    it has), its completions URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # keep-alive past any gap between arrivals: a connection the server closes after its idle timeout (5 s by
    # default) just as the client sends on it again fails that request (httpx.ReadError)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=600))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join()  # before the interpreter's shutdown, which would refuse the threads uvicorn's own ends

    return stop, f"http://127.0.0.1:{port}/v1/completions"


def random_requests(rng, vocab: int, models: list[str]) -> list[dict]:
    """One streamed greedy request per entry of `models`: 65-128 random prompt tokens, 16-256 output tokens."""
    return [{"model": model, "prompt": rng.integers(0, vocab, int(rng.integers(65, 129))).tolist(),
             "max_tokens": int(rng.integers(16, 257)), "temperature": 0, "stream": True, "ignore_eos": True}
            for model in models]


def compile_waves(client, url: str, rng, vocab: int, max_batch: int, models: list[str]) -> None:
    """Waves of each batch size from `max_batch` down to 1 for each of `models`: the prefill buckets compile
    before anything is measured."""
    for wave in sorted({max_batch, 16, 8, 4, 2, 1}, reverse=True):
        for model in models:
            send(client, url, float("inf"), random_requests(rng, vocab, [model] * wave), rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="4,16,64,inf", help="arrival rates, requests per second (inf: all at once)")
    parser.add_argument("--requests", type=int, default=96, help="requests per rate")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prompt tokens per step at most")
    parser.add_argument("--tiny", action="store_true", help="a tiny float32 model (a smoke run on CPU)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    device = jax.devices()[0].device_kind
    with tempfile.TemporaryDirectory() as root:
        engine, _ = build_engine(args.tiny, args.max_batch, args.prefill_chunk, root)
        bare = bare_loop(engine, args.max_batch, rng)
        print(f"# {device}: bare engine loop, batch {args.max_batch} on {ADAPTERS} r={RANK} adapters: "
              f"{bare['step_ms']:.2f} ms per decode step, {bare['tokens_per_s']:.0f} tok/s", flush=True)
        online = OnlineEngine(engine, max_waiting=100_000)
        stop_server, url = start_server(build_app(online, ServerConfig(served_model_name="base")))
        vocab = engine.model_config.vocab_size
        client = multiprocessing.get_context("spawn").Pool(1)
        compile_waves(client, url, rng, vocab, args.max_batch, ["a0", "base"])  # with and without LoRA
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            models = [pick_model(rng) for _ in range(args.requests)]
            row = {"rate": rate, **summarize(send(client, url, rate, random_requests(rng, vocab, models), rng),
                                             args.max_batch)}
            row["vs_bare_throughput"] = row["tokens_per_s"] / bare["tokens_per_s"]
            steady = row["steady_tokens_per_s"]
            row["steady_vs_bare"] = None if steady is None else steady / bare["tokens_per_s"]
            row["itl_p50_vs_bare_step"] = row["itl_p50_ms"] / bare["step_ms"]
            rows.append(row)
            busy = "-" if steady is None else f"{steady:.0f} tok/s, {row['steady_vs_bare']:.0%}"
            print(f"rate {rate:>5} req/s: {row['tokens_per_s']:7.0f} tok/s ({row['vs_bare_throughput']:.0%} of bare; "
                  f"all rows busy: {busy}), TTFT p50 {row['ttft_p50_ms']:.0f} / p99 {row['ttft_p99_ms']:.0f} ms, "
                  f"inter-token p50 {row['itl_p50_ms']:.2f} / p99 {row['itl_p99_ms']:.2f} ms "
                  f"(p50 x{row['itl_p50_vs_bare_step']:.2f} the bare step)", flush=True)
        client.close()
        stop_server()
    os.makedirs(args.out, exist_ok=True)
    name = "serve_tiny" if args.tiny else "serve"
    result = {"device": device, "max_batch": args.max_batch, "adapters": ADAPTERS, "rank": RANK, "bare": bare,
              "prefill_chunk": args.prefill_chunk, "rows": rows}
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, f"{name}.png"))
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(f"Device: {device}; batch {args.max_batch}; {ADAPTERS} r={RANK} adapters + base, skewed; prefill chunk "
                f"{args.prefill_chunk} tokens; bare engine loop {bare['step_ms']:.2f} ms per decode step, "
                f"{bare['tokens_per_s']:.0f} tok/s.\n\n"
                "| rate req/s | tok/s | of bare | all rows busy: tok/s | of bare | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
                "ITL p99 ms | ITL p50 / bare step |\n|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            steady = ("- | -" if r["steady_tokens_per_s"] is None
                      else f"{r['steady_tokens_per_s']:.0f} | {r['steady_vs_bare']:.0%}")
            f.write(f"| {r['rate']:g} | {r['tokens_per_s']:.0f} | {r['vs_bare_throughput']:.0%} | {steady} | {r['ttft_p50_ms']:.0f} | "
                    f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | "
                    f"{r['itl_p50_vs_bare_step']:.2f} |\n")


def plot(result: dict, path: str) -> None:
    """Throughput, time to first token and inter-token latency against the arrival rate, the bare loop marked."""
    plt = pyplot()
    if plt is None:
        return
    rows, bare = result["rows"], result["bare"]
    x, labels = range(len(rows)), [f"{r['rate']:g}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("tokens/s", [("whole run", "tokens_per_s"), ("all rows busy", "steady_tokens_per_s")],
               bare["tokens_per_s"], "bare loop"),
              ("time to first token, ms", [("p50", "ttft_p50_ms"), ("p99", "ttft_p99_ms")], None, None),
              ("inter-token latency, ms", [("p50", "itl_p50_ms"), ("p99", "itl_p99_ms")], bare["step_ms"], "bare step")]
    for ax, (ylabel, series, line, line_label) in zip(axes, panels):
        for label, key in series:
            ax.plot(x, [r[key] if r[key] is not None else float("nan") for r in rows], marker="o", label=label)
        if line is not None:
            ax.axhline(line, color="gray", linestyle="--", label=line_label)
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("arrival rate, requests/s")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    fig.suptitle(f"jlora serve on {result['device']}: batch {result['max_batch']}, {result['adapters']} "
                 f"r={result['rank']} adapters + base, Poisson arrivals", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
