"""Scoring benchmark: a multiple-choice workload through `Engine.score`, as lm-eval's loglikelihood tasks run it.

W = `--contexts` contexts of 96-160 random tokens, each with `--choices` continuations of 1-16 tokens: one
request per (context, choice), the continuation's log-probability after its context. On a Llama-3-8B-shaped
model with random weights in bf16 (`--tiny`: a tiny float32 model, a CPU smoke run), with `--adapters`
random adapters of rank `--rank` on every linear module. Cases:

- base: W under the base model.
- 1 adapter: W under one adapter.
- N adapters mixed: W with request i under adapter i mod N (the same tokens as base: the cost of the mix).
- N adapters, one run / N runs: W' = `--sweep-contexts` contexts scored under each of the N adapters, in one
  `Engine.score` call (every adapter's requests mixed) against N calls of one adapter each.

Each case runs once to compile, then timed (`--repeats`, median). Tokens/s counts prompt + continuation
tokens. Table (scoring.md) and JSON.

  python bench/scoring.py [--contexts 1000] [--choices 4] [--adapters 32] [--rank 16] [--sweep-contexts 64]
                          [--max-batch 64] [--prefill-chunk 512] [--repeats 3] [--out bench/results] [--tiny]
"""

from __future__ import annotations

import argparse
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


def workload(contexts: int, choices: int, vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, continuations): each context repeated once per choice."""
    rng = np.random.default_rng(seed)
    prompts, continuations = [], []
    for _ in range(contexts):
        context = rng.integers(0, vocab, int(rng.integers(96, 161))).tolist()
        for _ in range(choices):
            prompts.append(context)
            continuations.append(rng.integers(0, vocab, int(rng.integers(1, 17))).tolist())
    return prompts, continuations


def build_engine(args, root: str) -> tuple[Engine, dict]:
    """The engine with `args.adapters` random adapters registered (a0, a1, ...), and its model's HF config."""
    options = dict(max_loras=args.adapters, max_lora_rank=args.rank, max_batch=args.max_batch, max_seq_len=192,
                   prefill_chunk=args.prefill_chunk)
    if args.tiny:
        cfg = testing.tiny_config("llama", vocab_size=256)
        testing.write_model(f"{root}/m", cfg, seed=0)
        engine = Engine.from_pretrained(f"{root}/m", dtype="float32", progress=False, **options)
    else:
        from model import llama3_8b, llama3_8b_hf, random_model

        cfg = llama3_8b_hf(32)
        model_def, params = random_model(llama3_8b(32))
        engine = Engine(model_def.merge(params), dtype=jnp.bfloat16, **options)
    for i in range(args.adapters):
        path = f"{root}/a{i}"
        testing.write_adapter(path, cfg, r=args.rank, alpha=2 * args.rank, seed=i, target_modules=LINEAR_MODULES)
        engine.register_adapter(f"a{i}", path)
    return engine, cfg


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one untimed run (compilations, adapter loads)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, default=1000)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sweep-contexts", type=int, default=64, help="contexts of the one-run / N-runs cases")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tiny", action="store_true", help="a tiny float32 model (a CPU smoke run)")
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    print(f"# {device}: {args.contexts} contexts x {args.choices} choices, {args.adapters} adapters r={args.rank} "
          f"(all linear modules), max_batch {args.max_batch}, prefill_chunk {args.prefill_chunk}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        engine, cfg = build_engine(args, root)
        vocab = cfg["vocab_size"]
        prompts, continuations = workload(args.contexts, args.choices, vocab, seed=0)
        tokens = sum(len(p) + len(c) for p, c in zip(prompts, continuations))
        n = len(prompts)
        names = [f"a{i}" for i in range(args.adapters)]
        cases = {"base": [None] * n, "1 adapter": ["a0"] * n,
                 f"{args.adapters} adapters mixed": [names[i % args.adapters] for i in range(n)]}
        for case, adapters in cases.items():
            seconds = timed(lambda: engine.score(prompts, continuations, adapters), args.repeats)
            rows.append(dict(case=case, requests=n, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds))
            print(f"# {case}: {seconds:.2f} s, {tokens / seconds:.0f} tok/s", flush=True)
        sweep_p, sweep_c = workload(args.sweep_contexts, args.choices, vocab, seed=1)
        sweep_tokens = sum(len(p) + len(c) for p, c in zip(sweep_p, sweep_c)) * args.adapters
        one = timed(lambda: engine.score(sweep_p * args.adapters, sweep_c * args.adapters,
                                         [a for a in names for _ in sweep_p]), args.repeats)
        runs = timed(lambda: [engine.score(sweep_p, sweep_c, [a] * len(sweep_p)) for a in names], args.repeats)
        for case, seconds in ((f"{args.adapters} adapters, one run", one),
                              (f"{args.adapters} runs of 1 adapter", runs)):
            rows.append(dict(case=case, requests=len(sweep_p) * args.adapters, tokens=sweep_tokens, seconds=seconds,
                             tokens_per_s=sweep_tokens / seconds))
            print(f"# {case}: {seconds:.2f} s, {sweep_tokens / seconds:.0f} tok/s", flush=True)
    base = rows[0]["seconds"]
    lines = [f"Scoring on {device}: {args.contexts} contexts x {args.choices} choices (W), {args.adapters} adapters "
             f"r={args.rank} on every linear module; one-run / N-runs cases over {args.sweep_contexts} contexts.", "",
             "| case | requests | tokens | s | tok/s | time vs base W |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['case']} | {row['requests']} | {row['tokens']} | {row['seconds']:.2f} | "
                     f"{row['tokens_per_s']:.0f} | {row['seconds'] / base:.2f} |")
    lines.append(f"\nOne run of {args.adapters} adapters against {args.adapters} runs: "
                 f"{rows[-1]['seconds'] / rows[-2]['seconds']:.2f}x faster.")
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scoring.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "scoring.json"), "w") as f:
        json.dump({"device": device, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
