"""What `prefill_chunk` trades: prompt throughput against the decoding rows' step time while a prompt goes in.

On the 8B-shaped model with 32 r=16 adapters (bench/model.py's random weights), per chunk size: (a) the
prefill of `Engine.generate` (max_new_tokens=1) for 32 prompts of 128 tokens and for 4 of 2048, as prompt
tokens per second; (b) a batcher of 32 rows where 31 requests decode and a 2048-token prompt arrives: the
mean step time (the decoding rows' inter-token latency) while its pieces go in, against the decode step
alone before it.

  python bench/studies/prefill_chunk.py [--chunks 256,512,1024,2048] [--out bench/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine
from jlora.scheduler import Batcher, Request
from jlora.testing import write_adapter
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from model import llama3_8b, llama3_8b_hf, random_model  # noqa: E402

ADAPTERS, RANK, ROWS, LONG = 32, 16, 32, 2048


def prefill_rate(engine: Engine, batch: int, length: int, rng) -> float:
    """Prompt tokens per second of generate(max_new_tokens=1) for `batch` prompts of `length` tokens."""
    prompts = rng.integers(0, engine.model_config.vocab_size, (batch, length)).tolist()
    adapters = [f"a{i % ADAPTERS}" for i in range(batch)]
    run = lambda: (lambda t0: (engine.generate(prompts, adapters, max_new_tokens=1), time.perf_counter() - t0)[1])(
        time.perf_counter())
    run()
    return batch * length / statistics.median(run() for _ in range(3))


def step_times(engine: Engine, chunk: int, rng) -> tuple[float, float]:
    """(mean decode step of 31 rows, mean step while a LONG-token prompt goes in beside them), seconds."""
    vocab = engine.model_config.vocab_size
    batcher = Batcher(engine.runner, ROWS, 4096, prefill_chunk=chunk)
    for i in range(ROWS - 1):
        batcher.add(Request(rng.integers(0, vocab, 128).tolist(), engine.pool.slot(f"a{i}"), 1024))

    def timed(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            batcher.step()
        return (time.perf_counter() - start) / steps

    timed(40)  # admissions, compilation
    decode = timed(20)
    pieces = -(-LONG // chunk)
    for _ in range(2):  # the first prompt compiles its steps
        batcher.add(Request(rng.integers(0, vocab, LONG).tolist(), engine.pool.slot("a31"), 2))
        window = timed(pieces + 4) * (pieces + 4)
    # Steps are pipelined: a step() call waits for the step before it, so the window's calls time the decode
    # step before the prompt, its pieces and 3 decode steps after.
    return decode, (window - 4 * decode) / pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="256,512,1024,2048")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    device = jax.devices()[0].device_kind
    model_def, params = random_model(llama3_8b(32))
    engine = Engine(model_def.merge(params), max_loras=ADAPTERS, max_lora_rank=RANK, dtype=jnp.bfloat16,
                    max_batch=32, max_seq_len=4096)
    with tempfile.TemporaryDirectory() as root:
        write_adapter(root, llama3_8b_hf(32), r=RANK, alpha=2 * RANK, seed=1, target_modules=LINEAR_MODULES)
        for i in range(ADAPTERS):
            engine.load_adapter(f"a{i}", root)
    rows = []
    print(f"# {device}: 8B shape, {ADAPTERS} r={RANK} adapters", flush=True)
    for chunk in (int(c) for c in args.chunks.split(",")):
        engine.config = dataclasses.replace(engine.config, prefill_chunk=chunk)
        short, long = prefill_rate(engine, 32, 128, rng), prefill_rate(engine, 4, LONG, rng)
        decode, mixed = step_times(engine, chunk, rng)
        rows.append({"chunk": chunk, "prefill_32x128_tok_s": short, "prefill_4x2048_tok_s": long,
                     "decode_step_ms": decode * 1e3, "step_with_prompt_ms": mixed * 1e3})
        print(f"chunk {chunk:5}: prefill 32 x 128 {short:8.0f} tok/s, 4 x {LONG} {long:8.0f} tok/s; "
              f"31 rows decoding {decode * 1e3:.2f} ms per step, {mixed * 1e3:.2f} ms while a {LONG}-token prompt "
              f"goes in", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_chunk.json"), "w") as f:
        json.dump({"device": device, "adapters": ADAPTERS, "rank": RANK, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
