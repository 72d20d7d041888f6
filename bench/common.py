"""What the benchmark scripts share."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def copy_bandwidth(repeats: int = 5) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus written (eight 512 MiB elementwise passes)."""
    x = jax.random.normal(jax.random.key(2), (1 << 27,), jnp.float32)
    f = jax.jit(lambda v: [v * (1.0 + i * 1e-3) for i in range(8)])
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 8 * 2 * x.nbytes / statistics.median(times)
