"""How XLA compiles the prompt attention's gather of cache blocks: host dispatch time and device time of
`cache[tables]` (the model's `_gather`) against other forms, per number of blocks, and whether the compiled
step holds a while loop (a loop the host drives, one launch per block).

  python bench/studies/block_gather.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS = 32


def forms():
    def indexed(caches, tables):  # the model's _gather, per layer
        return [c[tables].transpose(0, 2, 1, 3, 4).reshape(tables.shape[0], c.shape[1], -1, c.shape[3])
                for c in caches]

    def take_rows(caches, tables):  # each block one row of KV·P·D values
        return [jnp.take(c.reshape(c.shape[0], -1), tables.reshape(-1), axis=0) for c in caches]

    def take_axis(caches, tables):
        return [jnp.take(c, tables, axis=0, mode="clip") for c in caches]

    return {"indexed": indexed, "take_rows": take_rows, "take_axis": take_axis}


def main() -> None:
    caches = [jnp.ones((8192, 8, 16, 128), jnp.bfloat16) for _ in range(LAYERS)]
    for name, fn in forms().items():
        f = jax.jit(fn)
        for nb in (1, 32, 128):
            tables = np.arange(nb, dtype=np.int32)[None, :]
            hlo = f.lower(caches, tables).compile().as_text()
            jax.block_until_ready(f(caches, tables))
            t0 = time.perf_counter()
            out = f(caches, tables)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            t2 = time.perf_counter()
            print(f"{name} nb={nb}: dispatch {1e3 * (t1 - t0):.2f} ms, then {1e3 * (t2 - t1):.2f} ms, "
                  f"while loops: {hlo.count(' while(')}", flush=True)


if __name__ == "__main__":
    main()
