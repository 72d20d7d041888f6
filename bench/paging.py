"""Paged KV cache benchmark: rows per cache memory, shared prefixes, and the prompt rate against max_seq_len.

On a Llama-3-8B-shaped model with random bf16 weights (`--tiny`: a tiny float32 model, a CPU smoke run) with 32
r=16 adapters on every linear module, requests run through the engine's batcher (the loop `jlora serve` runs,
without HTTP), each token timed as it arrives. Parts (`--parts`):

- scale: `--requests` requests at once (65-128 prompt tokens, 16-256 new, greedy; the 32 adapters skewed as in
  bench/serve.py, and the base model) over a cache of today's memory, 32 rows of max_seq_len 4096: contiguous
  with 32 rows, then paged (16-position blocks, as many as that memory holds) with `--rows` rows. Rows reached,
  tokens/s, time to first token and inter-token latency (p50 / p99), preemptions.
- prefix: every adapter's requests begin with the same 1024-token system prompt (16-64 tokens of their own
  after it, 32 new). Time to first token of a request alone on an idle engine whose cache holds the prompt
  under its adapter (a hit) against one whose cache does not (a miss), median over 8 adapters; then 8 requests
  per adapter at once with prefix caching on and off: tokens/s and time to first token.
- prompt: prompt tokens per second at max_seq_len 512 and 4096 (64 prompts of 480 tokens, one new token each),
  contiguous and paged.

Each run goes once to compile and is then timed. Table (paging.md) and JSON (paging.json).

  python bench/paging.py [--parts scale,prefix,prompt] [--requests 512] [--rows 128,256] [--out bench/results]
                         [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jlora import testing  # noqa: E402
from jlora.adapters.peft import LINEAR_MODULES  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from jlora.scheduler import Request  # noqa: E402

ADAPTERS, RANK, BLOCK = 32, 16, 16


def build_engine(tiny: bool, root: str) -> Engine:
    """The engine (max_seq_len 4096) with ADAPTERS adapters registered (a0, a1, ...) and resident in slots."""
    options = dict(max_loras=ADAPTERS, max_lora_rank=RANK, max_seq_len=4096, progress=False)
    if tiny:
        cfg = testing.tiny_config("llama", vocab_size=256, max_position_embeddings=4096)
        testing.write_model(f"{root}/m", cfg, seed=0)
        engine = Engine.from_pretrained(f"{root}/m", dtype="float32", **options)
    else:
        from model import llama3_8b, llama3_8b_hf, random_model

        cfg = llama3_8b_hf(32)
        model_def, params = random_model(llama3_8b(32))
        options.pop("progress")
        engine = Engine(model_def.merge(params), dtype=jnp.bfloat16, **options)
    testing.write_adapter(f"{root}/a", cfg, r=RANK, alpha=2 * RANK, seed=1, target_modules=LINEAR_MODULES)
    names = [f"a{i}" for i in range(ADAPTERS)]
    for name in names:
        engine.load_adapter(name, f"{root}/a")
    engine._make_resident(names)
    engine.pool.hold(names)  # in their slots for the whole run
    return engine


@dataclasses.dataclass
class Job:
    """A request to run: its prompt, model ("base" or an adapter) and new tokens."""

    prompt: list[int]
    model: str
    max_new: int


def run(engine: Engine, jobs: list[Job], rows: int, max_seq: int, **cache) -> dict:
    """The jobs at once through a batcher of `rows` rows of `max_seq` positions, the engine's config replaced by
    `cache` (block_size, kv_blocks, prefix_caching): seconds, tokens/s, TTFT and inter-token latency, rows
    reached, preemptions."""
    old = engine.config
    engine.config = dataclasses.replace(old, **cache)
    try:
        batcher = engine.new_batcher(rows, max_seq)
    finally:
        engine.config = old
    times: dict[int, list[float]] = {}

    def on_update(r: Request) -> None:
        if r.finish is None or r.finish == "length":
            times.setdefault(id(r), []).append(time.perf_counter())

    requests = [Request(j.prompt, -1 if j.model == "base" else engine.pool.slot(j.model), j.max_new,
                        prefix_id=j.model, on_update=on_update) for j in jobs]
    start, peak = time.perf_counter(), 0
    for r in requests:
        batcher.add(r)
    while batcher.busy:
        batcher.step()
        peak = max(peak, batcher.num_running)
    seconds = time.perf_counter() - start
    assert all(len(r.out) == r.max_new for r in requests)
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    ttft = [ts[0] - start for ts in times.values()]
    result = {"seconds": seconds, "tokens_per_s": sum(r.max_new for r in requests) / seconds,
              "prompt_tokens_per_s": sum(len(r.prompt) for r in requests) / seconds, "rows_reached": peak,
              "ttft_p50_ms": _quantile(ttft, 0.5) * 1e3, "itl_p50_ms": _quantile(itl, 0.5) * 1e3,
              "itl_p99_ms": _quantile(itl, 0.99) * 1e3, "preemptions": batcher.preemptions,
              "prefix_hit_rate": batcher.blocks.stats.hit_rate}
    del batcher
    gc.collect()
    return result


def timed(engine: Engine, jobs: list[Job], rows: int, max_seq: int, **cache) -> dict:
    """`run`, once to compile, then timed."""
    run(engine, jobs, rows, max_seq, **cache)
    return run(engine, jobs, rows, max_seq, **cache)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def skewed_jobs(rng, vocab: int, n: int) -> list[Job]:
    """bench/serve.py's workload: 65-128 prompt tokens, 16-256 new, adapter i drawn with weight 1 / (i + 1)."""
    weights = np.array([1.0] + [1 / (i + 1) for i in range(ADAPTERS)])
    picks = rng.choice(ADAPTERS + 1, n, p=weights / weights.sum())
    return [Job(rng.integers(0, vocab, int(rng.integers(65, 129))).tolist(), "base" if i == 0 else f"a{i - 1}",
                int(rng.integers(16, 257))) for i in picks]


def scale(engine: Engine, args, rng) -> list[dict]:
    vocab, rows = engine.model_config.vocab_size, [int(x) for x in args.rows.split(",")]
    jobs = skewed_jobs(rng, vocab, args.requests)
    blocks = 32 * 4096 // BLOCK  # today's memory: 32 rows of 4096 positions
    configs = [("contiguous", 32, dict(block_size=0, kv_blocks=None))]
    configs += [(f"paged, {blocks} blocks", n, dict(block_size=BLOCK, kv_blocks=blocks)) for n in rows]
    out = []
    for cache, n, options in configs:
        row = {"cache": cache, "rows": n, **timed(engine, jobs, n, 4096, **options)}
        out.append(row)
        row["vs_contiguous_tokens_per_s"] = row["tokens_per_s"] / out[0]["tokens_per_s"]
        row["vs_contiguous_itl_p50"] = row["itl_p50_ms"] / out[0]["itl_p50_ms"]
        print(f"scale {row['cache']}, {row['rows']} rows: reached {row['rows_reached']}, {row['tokens_per_s']:.0f} "
              f"tok/s ({row['vs_contiguous_tokens_per_s']:.2f}x), ITL p50 {row['itl_p50_ms']:.2f} / p99 "
              f"{row['itl_p99_ms']:.2f} ms ({row['vs_contiguous_itl_p50']:.2f}x), TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
              f"{row['preemptions']} preemptions", flush=True)
    return out


def prefix(engine: Engine, args, rng) -> dict:
    vocab = engine.model_config.vocab_size
    system = rng.integers(0, vocab, 1024).tolist()
    job = lambda model: Job(system + rng.integers(0, vocab, int(rng.integers(16, 65))).tolist(), model, 32)
    cache = dict(block_size=BLOCK, kv_blocks=32 * 4096 // BLOCK)
    old = engine.config
    engine.config = dataclasses.replace(old, **cache)
    try:  # one batcher, idle between requests: the first of each adapter misses, the second hits
        batcher = engine.new_batcher(32, 4096)
    finally:
        engine.config = old
    ttft = {"miss": [], "hit": []}
    for i in range(9):
        for kind in ("miss", "hit"):
            j = job(f"a{i}")
            r = Request(j.prompt, engine.pool.slot(j.model), 1, prefix_id=j.model)
            start = time.perf_counter()
            batcher.add(r)
            while batcher.busy:
                batcher.step()
            if i:  # adapter a0: compiles
                ttft[kind].append(time.perf_counter() - start)
    del batcher
    gc.collect()
    out = {f"ttft_{k}_ms": statistics.median(v) * 1e3 for k, v in ttft.items()}
    out["hit_vs_miss"] = out["ttft_hit_ms"] / out["ttft_miss_ms"]
    jobs = [job(f"a{i % ADAPTERS}") for i in range(8 * ADAPTERS)]
    for on in (True, False):
        out["caching_on" if on else "caching_off"] = timed(engine, jobs, 64, 4096, prefix_caching=on, **cache)
    on, off = out["caching_on"], out["caching_off"]
    print(f"prefix: TTFT alone, hit {out['ttft_hit_ms']:.1f} ms, miss {out['ttft_miss_ms']:.1f} ms "
          f"({out['hit_vs_miss']:.2f}x); {len(jobs)} at once, caching on: {on['tokens_per_s']:.0f} tok/s, TTFT p50 "
          f"{on['ttft_p50_ms']:.0f} ms (hit rate {on['prefix_hit_rate']:.0%}); off: {off['tokens_per_s']:.0f} tok/s, "
          f"TTFT p50 {off['ttft_p50_ms']:.0f} ms", flush=True)
    return out


def prompt(engine: Engine, args, rng) -> list[dict]:
    vocab = engine.model_config.vocab_size
    jobs = [Job(rng.integers(0, vocab, 480).tolist(), f"a{i % ADAPTERS}", 1) for i in range(64)]
    out = []
    for block_size in (0, BLOCK):
        for max_seq in (512, 4096):
            r = timed(engine, jobs, 8, max_seq, block_size=block_size, kv_blocks=None, prefix_caching=False)
            out.append({"cache": "contiguous" if block_size == 0 else "paged", "max_seq_len": max_seq,
                        "prompt_tokens_per_s": r["prompt_tokens_per_s"]})
        out[-1]["vs_512"] = out[-1]["prompt_tokens_per_s"] / out[-2]["prompt_tokens_per_s"]
        print(f"prompt {out[-1]['cache']}: {out[-2]['prompt_tokens_per_s']:.0f} tok/s at 512, "
              f"{out[-1]['prompt_tokens_per_s']:.0f} at 4096 ({out[-1]['vs_512']:.2f}x)", flush=True)
    return out


def write_table(result: dict, path: str) -> None:
    lines = [f"Device: {result['device']}; {ADAPTERS} r={RANK} adapters + base; blocks of {BLOCK} positions.", ""]
    if "scale" in result:
        lines += ["| cache | rows | rows reached | tok/s | vs contiguous | ITL p50 ms | ITL p99 ms | ITL p50 vs "
                  "contiguous | TTFT p50 ms | preemptions |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['cache']} | {r['rows']} | {r['rows_reached']} | {r['tokens_per_s']:.0f} | "
                  f"{r['vs_contiguous_tokens_per_s']:.2f} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | "
                  f"{r['vs_contiguous_itl_p50']:.2f} | {r['ttft_p50_ms']:.0f} | {r['preemptions']} |"
                  for r in result["scale"]] + [""]
    if "prefix" in result:
        p = result["prefix"]
        lines += [f"Shared 1024-token prefix: TTFT alone {p['ttft_hit_ms']:.1f} ms on a hit, {p['ttft_miss_ms']:.1f} "
                  f"ms on a miss ({p['hit_vs_miss']:.2f}x).", "",
                  "| prefix caching | tok/s | TTFT p50 ms | hit rate |", "|---|---|---|---|"]
        lines += [f"| {k.split('_')[1]} | {p[k]['tokens_per_s']:.0f} | {p[k]['ttft_p50_ms']:.0f} | "
                  f"{p[k]['prefix_hit_rate']:.0%} |" for k in ("caching_on", "caching_off")] + [""]
    if "prompt" in result:
        lines += ["| cache | max_seq_len | prompt tok/s | vs 512 |", "|---|---|---|---|"]
        lines += [f"| {r['cache']} | {r['max_seq_len']} | {r['prompt_tokens_per_s']:.0f} | "
                  f"{r.get('vs_512', 1):.2f} |" for r in result["prompt"]] + [""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="scale,prefix,prompt")
    parser.add_argument("--requests", type=int, default=512, help="requests of the scale part")
    parser.add_argument("--rows", default="128,256", help="the paged caches' rows in the scale part")
    parser.add_argument("--tiny", action="store_true", help="a tiny float32 model (a smoke run on CPU)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    result = {"device": jax.devices()[0].device_kind}
    parts = {"scale": scale, "prefix": prefix, "prompt": prompt}
    os.makedirs(args.out, exist_ok=True)
    name = os.path.join(args.out, "paging_tiny" if args.tiny else "paging")
    with tempfile.TemporaryDirectory() as root:
        engine = build_engine(args.tiny, root)
        for part in args.parts.split(","):
            result[part] = parts[part](engine, args, rng)
            with open(f"{name}.json", "w") as f:  # after each part: a run cut short keeps what it measured
                json.dump(result, f, indent=1)
            write_table(result, f"{name}.md")


if __name__ == "__main__":
    main()
