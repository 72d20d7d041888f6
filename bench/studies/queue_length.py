"""The engine's host work against the length of its queue: `Engine.generate` of P prompts on a tiny random model,
so that the device's step is short and the host's scheduling shows (the fastest of `--rounds` runs):
- with n samples each (the n - 1 other samples are forks, which wait in the batcher's queue for their prompt's
  first sample): each step asks that queue whether a fork's source waits and which forks a running request has;
- over `--adapters` adapters in runs of 50 requests each, with 2 slots: the requests wait in `Admission` for a
  slot, and each step's poll visits them by adapter.
Wall time per request should not grow with P. Runs on the CPU (or any device). JSON: queue_length.json.

  python bench/studies/queue_length.py [--prompts 250,1000,4000] [--samples 1,4] [--adapters 8] [--max-batch 16]
                                       [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax

from jlora import testing
from jlora.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="250,1000,4000", help="prompt counts P")
    parser.add_argument("--samples", default="1,4", help="samples n per prompt (base model)")
    parser.add_argument("--adapters", type=int, default=8, help="adapters over 2 slots, one sample a prompt")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each case; the fastest is reported")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    args = parser.parse_args()
    config = testing.tiny_config("llama")
    with tempfile.TemporaryDirectory() as root:
        testing.write_model(f"{root}/m", config, seed=1)
        engine = Engine.from_pretrained(f"{root}/m", max_loras=2, max_lora_rank=8, max_batch=args.max_batch,
                                        max_seq_len=64, progress=False)
        for i in range(args.adapters):  # read when first used: the directory must outlive the runs
            testing.write_adapter(f"{root}/a{i}", config, r=4, alpha=8, seed=i)
            engine.register_adapter(f"a{i}", f"{root}/a{i}")
        cases = [(f"n={n}", n, lambda count: [None] * count) for n in map(int, args.samples.split(","))]
        cases.append((f"{args.adapters} adapters", 1,
                      lambda count: [f"a{i // 50 % args.adapters}" for i in range(count)]))
        prompts = lambda count: [[1 + i % 50, 2, 3] for i in range(count)]  # noqa: E731 - 3 tokens, 50 distinct
        for _, n, adapters in cases:  # compiles the steps, loads the adapters
            engine.generate(prompts(200), adapters(200), 2, n=n, temperature=1.0)
        rows = []
        print(f"# {jax.devices()[0].device_kind}, max_batch {args.max_batch}, 3 prompt tokens, 2 new tokens each")
        for name, n, adapters in cases:
            for count in map(int, args.prompts.split(",")):
                times = []
                for _ in range(args.rounds):  # the first may compile a prefill shape
                    start = time.perf_counter()
                    engine.generate(prompts(count), adapters(count), 2, n=n, temperature=1.0)
                    times.append(time.perf_counter() - start)
                seconds = min(times)
                rows.append(dict(case=name, prompts=count, requests=count * n, seconds=round(seconds, 3),
                                 ms_per_request=round(seconds / (count * n) * 1e3, 4)))
                print(f"{name:12s} P={count:6d} requests={count * n:6d}  {seconds:8.2f} s  "
                      f"{rows[-1]['ms_per_request']:6.3f} ms a request", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "queue_length.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, max_batch=args.max_batch, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
