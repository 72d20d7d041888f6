"""Where a request's time to first token goes after a shared-prefix hit: the host's time inside each
`Batcher.step` against the device's time after it, on an idle engine.

On bench/paging.py's 8B-shaped engine (`--tiny`: its tiny CPU model), paged (16-position blocks), three rounds
of: a 1032-token prompt under a new prefix id (a miss: three prompt pieces), the same 1024-token prefix with
other last tokens (a hit: one piece of 8 tokens), and a 12-token prompt (no prefix). Round 0 compiles.
`--profile`: the host's functions by own time over the last round (cProfile).

  python bench/studies/prefix_hit.py [--tiny] [--profile]
"""

from __future__ import annotations

import cProfile
import dataclasses
import os
import pstats
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paging import build_engine  # noqa: E402
from jlora.scheduler import Request  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        engine = build_engine("--tiny" in sys.argv, root)
        engine.config = dataclasses.replace(engine.config, block_size=16, kv_blocks=8192)
        batcher = engine.new_batcher(32, 4096)
        system = np.random.default_rng(0).integers(0, 1000, 1024).tolist()
        profile = cProfile.Profile()
        for rep in range(3):
            if rep == 2 and "--profile" in sys.argv:
                profile.enable()
            for kind, prompt in (("miss", system + [rep, 1, 2, 3, 4, 5, 6, 7]),
                                 ("hit", system + [rep, 9, 8, 7, 6, 5, 4]), ("short", [rep + 5] * 12)):
                batcher.add(Request(prompt, engine.pool.slot("a1"), 1, prefix_id=f"x{rep}"))
                marks, start = [], time.perf_counter()
                while batcher.busy:
                    batcher.step()
                    dispatched = time.perf_counter()
                    if batcher.in_flight is not None:
                        jax.block_until_ready(batcher.in_flight.tokens)
                    marks.append((dispatched - start, time.perf_counter() - dispatched))
                    start = time.perf_counter()
                print(rep, kind, " | ".join(f"host {h * 1e3:.1f} ms, device {d * 1e3:.1f} ms" for h, d in marks),
                      flush=True)
        profile.disable()
        if "--profile" in sys.argv:
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
