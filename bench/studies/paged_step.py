"""The engine's decode step on a contiguous cache against paged ones, 32 rows decoding.

On bench/paging.py's 8B-shaped engine (`--tiny`: its tiny CPU model), 32 requests of 100 prompt tokens (one
adapter each) are prefilled, then 50 decode steps are timed (wall per step, and the host's time inside
`Batcher.step`, which includes waiting for the step before), for each (block size, max_seq_len): contiguous
(block size 0) and paged blocks of 16 and 64 positions, at max_seq_len 4096 and 512. Prints one line each.

  python bench/studies/paged_step.py [--tiny]
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paging import build_engine  # noqa: E402
from jlora.scheduler import Request  # noqa: E402

CASES = ((0, 4096, None), (16, 4096, 8192), (64, 4096, 2048), (16, 512, 8192), (0, 512, None))


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        engine = build_engine("--tiny" in sys.argv, root)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 1000, 100).tolist() for _ in range(32)]
        for block, max_seq, blocks in CASES:
            engine.config = dataclasses.replace(engine.config, block_size=block, kv_blocks=blocks)
            batcher = engine.new_batcher(32, max_seq)
            for _ in range(2):  # the first compiles
                for i, p in enumerate(prompts):
                    batcher.add(Request(p, engine.pool.slot(f"a{i}"), 120))
                for _ in range(20):  # prompts in, then decoding
                    batcher.step()
                jax.block_until_ready(batcher.cache)
                host, start = 0.0, time.perf_counter()
                for _ in range(50):
                    t = time.perf_counter()
                    batcher.step()
                    host += time.perf_counter() - t
                jax.block_until_ready(batcher.cache)
                wall = (time.perf_counter() - start) / 50
                while batcher.busy:
                    batcher.step()
            print(f"block {block} max_seq {max_seq}: {wall * 1e3:.2f} ms per step, host {host / 50 * 1e3:.2f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
