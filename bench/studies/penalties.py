"""What `max_seq_len` and the penalties cost a decode step (GPU): `Engine.generate` on the 8B-shaped model
(random weights), 32 requests of 128 prompt tokens and 128 greedy tokens each, base model, with no penalty and
with repetition, frequency and presence penalties on every request, alternated over rounds in one process per
`max_seq_len`. A step's inputs that scale with `max_seq_len` are the rows' block tables ([32, max_seq_len /
block_size] int32) and, in a step with penalties, the rows' token histories ([32, max_seq_len] int32); the KV
cache holds `--kv-blocks` blocks whatever the length, so only those inputs change. ms per decode step: (a
128-token run less a 1-token run, the prefill) over the 127 extra steps. JSON: penalties.json.

  python bench/studies/penalties.py [--max-seq-lens 4096,32768,131072] [--rounds 3] [--out bench/results]
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

BATCH, PROMPT, NEW = 32, 128, 128
CASES = {"none": {}, "penalties": dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)}


def time_cases(engine: Engine, prompts: list[list[int]], rounds: int) -> dict[str, list[float]]:
    """Each case's ms per decode step, a value per round (the cases alternate within a round)."""
    def run(n: int, case: str) -> float:
        t0 = time.perf_counter()
        out = engine.generate(prompts, [None] * BATCH, max_new_tokens=n, ignore_eos=True, **CASES[case])
        assert all(len(o) == n for o in out)
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
    parser.add_argument("--kv-blocks", type=int, default=1024, help="the KV cache's 16-position blocks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    config = llama3_8b(32)
    model_def, params = random_model(config)
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, PROMPT)).tolist()
    rows = []
    for max_seq_len in map(int, args.max_seq_lens.split(",")):
        engine = Engine(model_def.merge(params), dtype=jnp.bfloat16, max_batch=BATCH, max_seq_len=max_seq_len,
                        kv_blocks=args.kv_blocks)
        steps = time_cases(engine, prompts, args.rounds)
        ms = {case: statistics.median(t) for case, t in steps.items()}
        rows.append(dict(max_seq_len=max_seq_len, step_ms=ms, rounds=steps))
        print(f"# {device}: decode ms per step at batch {BATCH}, max_seq_len {max_seq_len}: " + ", ".join(
            f"{case} {ms[case]:.3f} ({ms[case] / ms['none']:.3f}x; rounds {', '.join(f'{t:.3f}' for t in steps[case])})"
            for case in CASES), flush=True)
        del engine
        gc.collect()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "penalties.json"), "w") as f:
        json.dump(dict(device=device, gpu=gpu_facts(), batch=BATCH, prompt_len=PROMPT, new_tokens=NEW,
                       kv_blocks=args.kv_blocks, penalties=CASES["penalties"], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
