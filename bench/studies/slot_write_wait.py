"""Whether a slot write (a jitted update of the pool's stacks, donated) blocks the host while a step that reads
the stacks is in flight (#36: intervals with a slot write run ~3 ms longer at p50; docs/performance.md, § Tenancy).

The stacks: 64 arrays shaped as an 8B pool's q|k|v A and B stacks (32 slots, rank 64); the step: a jitted read of
every stack plus ~5 ms of matrix work; the write: one slot of every stack set, donated, as `_write_slot`. Host time
of the write call, idle and with one or two steps in flight, and with the stacks not donated.

  python bench/studies/slot_write_wait.py  # GPU
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    gpu = jax.default_backend() == "gpu"
    slots, rank, k, n, layers = (32, 64, 4096, 6144, 32) if gpu else (4, 8, 64, 96, 4)
    stacks = [(jnp.zeros((slots, 3 * rank, k), jnp.bfloat16), jnp.zeros((slots, n, rank), jnp.bfloat16))
              for _ in range(layers)]
    new = [(np.ones((3 * rank, k), jnp.bfloat16), np.ones((n, rank), jnp.bfloat16)) for _ in range(layers)]
    new = jax.device_put(new)
    x = jnp.ones((4096, 4096) if gpu else (64, 64), jnp.bfloat16)

    @jax.jit
    def step(stacks, x):
        y = x
        for _ in range(40 if gpu else 2):
            y = (y @ x) * 1e-3
        return y[0, 0] + sum(a[0, 0, 0] + b[0, 0, 0] for a, b in stacks)

    def write(stacks, slot, new):
        return jax.tree.map(lambda w, v: w.at[slot].set(v), stacks, new)

    donated = jax.jit(write, donate_argnums=0)
    kept = jax.jit(write)
    jax.block_until_ready((step(stacks, x), stacks := donated(stacks, 0, new), kept(stacks, 0, new)))
    start = time.perf_counter()
    for _ in range(10):
        out = step(stacks, x)
    out.block_until_ready()
    print(f"Device: {jax.devices()[0].device_kind}; step {(time.perf_counter() - start) / 10 * 1e3:.2f} ms; stacks "
          f"{sum(a.nbytes + b.nbytes for a, b in stacks) / 1e9:.2f} GB", flush=True)
    for name, fn in (("donated", donated), ("not donated", kept)):
        for in_flight in (0, 1, 2):
            calls, ready = [], []
            for i in range(20):
                jax.block_until_ready(stacks)
                outs = [step(stacks, x) for _ in range(in_flight)]
                t0 = time.perf_counter()
                result = fn(stacks, np.int32(i % slots), new)
                t1 = time.perf_counter()
                jax.block_until_ready((result, outs))
                t2 = time.perf_counter()
                if fn is donated:
                    stacks = result
                calls.append(t1 - t0)
                ready.append(t2 - t0)
            print(f"{name:12s} {in_flight} steps in flight: write call {np.median(calls) * 1e3:.2f} ms p50 "
                  f"(max {np.max(calls) * 1e3:.2f}), done after {np.median(ready) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
