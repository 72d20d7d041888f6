"""What `max_seq_len` and the penalties cost a decode step (GPU), in the server's loop: a `Batcher` of `--batch` rows
of `max_seq_len` positions (`Engine.new_batcher`, as `jlora serve` makes it; `Engine.generate` sizes its own to the
longest request instead) on the 8B-shaped model (random weights), as many requests of 128 prompt tokens and 128
greedy tokens each, base model, with no penalty and with repetition, frequency and presence penalties on every
request, alternated over rounds, an engine per `max_seq_len` in one process. A step's inputs that scale with
`max_seq_len` are the rows' block tables ([batch, max_seq_len / block_size] int32) and, in a step with penalties,
the rows' token histories ([batch, max_seq_len] int32); the KV cache holds twice the blocks the requests need
whatever the length, so only those inputs change. ms per decode step: (a 128-token run less a 1-token run, the
prefill) over the 127 extra steps. JSON: penalties.json (penalties_b{batch}.json at other batches).

  python bench/studies/penalties.py [--batch 32] [--max-seq-lens 4096,32768,131072] [--rounds 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import gpu_facts  # noqa: E402
from model import llama3_8b, random_model  # noqa: E402

from jlora.engine import Engine  # noqa: E402
from jlora.scheduler import Batcher, Request  # noqa: E402

PROMPT, NEW = 128, 128
CASES = {"none": {}, "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)}


def time_cases(batcher: Batcher, prompts: list[list[int]], rounds: int) -> dict[str, list[float]]:
    """Each case's ms per decode step, a value per round (the cases alternate within a round)."""
    def run(n: int, case: str) -> float:
        requests = [Request(p, -1, n, **CASES[case]) for p in prompts]
        t0 = time.perf_counter()
        for r in requests:
            batcher.add(r)
        while batcher.busy:
            batcher.step()
        assert all(len(r.out) == n for r in requests)
        return time.perf_counter() - t0

    for case in CASES:  # compiles each case's steps
        run(NEW, case)
    steps = {case: [] for case in CASES}
    for _ in range(rounds):
        for case in CASES:
            prefill = min(run(1, case) for _ in range(2))
            steps[case].append((run(NEW, case) - prefill) / (NEW - 1) * 1e3)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-seq-lens", default="4096,32768,131072")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    config = llama3_8b(32)
    model_def, params = random_model(config)
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, PROMPT)).tolist()
    rows, kv_blocks = [], 2 * args.batch * (PROMPT + NEW) // 16
    for max_seq_len in map(int, args.max_seq_lens.split(",")):
        engine = Engine(model_def.merge(params), dtype=jnp.bfloat16, max_batch=args.batch, max_seq_len=max_seq_len,
                        kv_blocks=kv_blocks, prefix_caching=False)
        steps = time_cases(engine.new_batcher(args.batch, max_seq_len), prompts, args.rounds)
        ms = {case: statistics.median(t) for case, t in steps.items()}
        rows.append(dict(max_seq_len=max_seq_len, step_ms=ms, rounds=steps))
        print(f"# {device}: decode ms per step at batch {args.batch}, max_seq_len {max_seq_len}: " + ", ".join(
            f"{case} {ms[case]:.3f} ({ms[case] / ms['none']:.3f}x; rounds {', '.join(f'{t:.3f}' for t in steps[case])})"
            for case in CASES), flush=True)
        del engine
        gc.collect()
    os.makedirs(args.out, exist_ok=True)
    name = "penalties.json" if args.batch == 32 else f"penalties_b{args.batch}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(dict(device=device, gpu=gpu_facts(), batch=args.batch, prompt_len=PROMPT, new_tokens=NEW,
                       kv_blocks=kv_blocks, penalties=CASES["penalties"], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
