"""Whether copying adapters to the device on loader threads stalls the engine loop beside them, per way of
issuing the copy: the interval of a loop that does 1 ms of Python and then waits for a ~5 ms device step, while
1 or 2 threads copy 8B-shaped adapters (q_proj + v_proj, ranks 8-64) to the device without pause.

Ways: `none` (no copies), `one call` (one `jax.device_put` for every array of an adapter, as `AdapterPool.stage`
did), `per layer` (one call per layer, one adapter at a time:
`AdapterPool.stage` before it copied an adapter in one transfer, `copy_forms.py`), `pinned` (one copy per layer from arrays already in pinned host memory, as a host tier
that kept them so would copy). The answer is in docs/performance.md, § Tenancy.

  python bench/studies/stage_stalls.py [--layers 32] [--steps 800]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jlora import testing  # noqa: E402
from jlora.adapters import AdapterPool  # noqa: E402
from model import llama3_8b, llama3_8b_hf  # noqa: E402


def one_call(pool: AdapterPool, prepared) -> None:
    """Every array of the adapter's layers copied in one `jax.device_put`."""
    places = tuple(pool.placement(i, layer) for i, layer in enumerate(prepared.host.layers))
    jax.block_until_ready(jax.device_put(prepared.host.layers, places))


def to_pinned(pool: AdapterPool, prepared):
    """The adapter's layers as arrays in pinned host memory, placed as a slot holds them."""
    return [jax.device_put(layer, pool.placement(i, layer, "pinned_host"))
            for i, layer in enumerate(prepared.host.layers)]


def from_pinned(pool: AdapterPool, layers) -> None:
    """One copy per layer from pinned host memory to the device."""
    jax.block_until_ready([jax.device_put(layer, pool.placement(i, layer)) for i, layer in enumerate(layers)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=800, help="loop intervals per way")
    args = parser.parse_args()
    config, hf = llama3_8b(args.layers), llama3_8b_hf(args.layers)
    pool = AdapterPool(config, max_loras=2, max_lora_rank=64, dtype=jnp.bfloat16)
    with tempfile.TemporaryDirectory() as root:
        prepared = []
        for rank in (8, 16, 32, 64):
            testing.write_adapter(f"{root}/r{rank}", hf, r=rank, alpha=2 * rank, seed=rank,
                                  target_modules=["q_proj", "v_proj"])
            prepared.append(pool.prepare(f"{root}/r{rank}"))
    n = 2048 if jax.default_backend() == "gpu" else 256
    x = jnp.ones((n, n), jnp.bfloat16)
    device_step = jax.jit(lambda x: jax.lax.fori_loop(0, 150, lambda i, y: (y @ x) * 1e-3, x))
    jax.block_until_ready(device_step(x))
    ways = {"none": None, "one call": lambda p: one_call(pool, p), "per layer": pool.stage}
    if jax.default_backend() == "gpu":  # pinned host memory is a GPU memory kind
        pinned = {id(p): to_pinned(pool, p) for p in prepared}
        ways["pinned"] = lambda p: from_pinned(pool, pinned[id(p)])
    print(f"Device: {jax.devices()[0].device_kind}")
    for threads in (1, 2):
        for name, copy in ways.items():
            if copy is None and threads > 1:
                continue
            stop, copies = threading.Event(), []

            def copier():
                i = 0
                while not stop.is_set():
                    start = time.perf_counter()
                    copy(prepared[i % len(prepared)])
                    copies.append(time.perf_counter() - start)
                    i += 1

            workers = [threading.Thread(target=copier) for _ in range(threads if copy else 0)]
            for w in workers:
                w.start()
            intervals, last = [], time.perf_counter()
            for _ in range(args.steps):
                end = last + 1e-3
                while time.perf_counter() < end:  # the loop's Python work
                    pass
                jax.block_until_ready(device_step(x))
                now = time.perf_counter()
                intervals.append(now - last)
                last = now
            stop.set()
            for w in workers:
                w.join()
            ms = np.array(intervals) * 1e3
            copied = f"{len(copies)} copies, p50 {np.median(copies) * 1e3:.1f} ms" if copies else "no copies"
            print(f"{threads} thread(s), {name:9s}: interval p50 {np.median(ms):.2f} / p99 {np.percentile(ms, 99):.2f}"
                  f" / max {ms.max():.1f} ms; {copied}", flush=True)


if __name__ == "__main__":
    main()
