"""Batch 8's LoRA decode rows timed among fewer of `bench/model.py`'s cases, for #39's batch-8 question.

`bench/model.py` times a batch size's five decode cases (the base step, r=16 and r=64 with 1 and 8 adapters) in
alternating rounds in one process, and there batch 8's LoRA steps read 10-40 % slower than the same steps timed
by the studies, while the host's dispatch stays under half the step. Here the same five steps (`model.py`'s
inputs, engine layout and attention split) are timed in alternating rounds within subsets of the cases, in
one process, so an interaction between the cases shows as a difference between the subsets.
JSON: batch8_cases.json.

  python bench/studies/batch8_cases.py [--batch 8] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import row_recorder  # noqa: E402
from model import (CONTEXT, SLOTS, engine_config, engine_layout, llama3_8b, model_step, random_lora,  # noqa: E402
                   random_model, shuffled_slots, time_alternating)

from jlora.models.llama import KVCache  # noqa: E402



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "batch8_cases.json")
    config, batch, rng = llama3_8b(32), args.batch, np.random.default_rng(0)
    model_def, params = random_model(config)
    cache = KVCache.zeros(config, batch, 2 * CONTEXT, jnp.bfloat16)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, 1)), jnp.int32)
    positions = jnp.full((batch, 1), CONTEXT, jnp.int32)
    loras = {rank: random_lora(config, rank) for rank in (16, 64)}
    cases = {(0, 0): (None, jnp.full(batch, -1, jnp.int32), jnp.zeros(SLOTS, jnp.int32))}
    for rank in (16, 64):
        for adapters in (1, 8):
            slots = shuffled_slots(batch, adapters, rng)
            cases[rank, adapters] = (loras[rank], slots, jnp.full(SLOTS, rank, jnp.int32))
    stored, chunk = engine_layout(model_def, params, batch), engine_config(batch).attention_chunk(config.num_kv_heads)
    steps = {case: model_step(*stored, tokens, positions, *args, 16, None, chunk) for case, args in cases.items()}
    for subset in ((0, 0), (16, 1)), ((0, 0), (16, 1), (64, 1)), tuple(cases):
        host = {}
        times, cache = time_alternating({case: steps[case] for case in subset}, cache, dispatch=host)
        ms = {f"r{r}_n{n}": statistics.median(times[r, n]) * 1e3 for r, n in subset}
        dispatch = {f"r{r}_n{n}": statistics.median(host[r, n]) * 1e3 for r, n in subset}
        print(f"cases {sorted(ms)}: " + ", ".join(f"{k} {v:.3f} ms (host {dispatch[k]:.2f})" for k, v in ms.items()),
              flush=True)
        record(dict(batch=batch, chunk=chunk, ms=ms, dispatch_ms=dispatch))


if __name__ == "__main__":
    main()
