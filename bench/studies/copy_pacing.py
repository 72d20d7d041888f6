"""How adapter copies to the device slow a loop shaped like the engine's (1 ms of Python, a ~4 ms device step
fed from the host, two steps in flight), per way of issuing them (#36's ITL tail; docs/performance.md, § Tenancy).

Ways, each copying 8B-shaped q_proj + v_proj adapters (ranks 8/16/32/64: 7-55 MB, one `jax.device_put` per
layer, as `AdapterPool.stage` copies) without pause unless said: none; a loader thread; the same with the
step's input already on the device (is the step's own host -> device transfer, queued behind the copies, the
path of the stall?); a loader thread pacing its layers at 2000-250 MB/s; a loader thread copying 5 adapters a
second, unpaced and at 500 MB/s (about a serving load rate); the loop thread itself issuing 1, 4 or 32 layers
right after each dispatch.

  python bench/studies/copy_pacing.py [--steps 400]  # GPU
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

RANKS, LAYERS = (8, 16, 32, 64), 32


def adapters(rng: np.random.Generator) -> list[list[dict]]:
    """One adapter per rank: per layer {group: (a [4096, r], b [r, N])} in bf16 host memory."""
    bf16 = lambda shape: rng.random(shape, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    return [[{g: (bf16((4096, r)), bf16((r, n))) for g, n in (("q", 4096), ("v", 1024))} for _ in range(LAYERS)]
            for r in RANKS]


def nbytes(layer: dict) -> int:
    return sum(a.nbytes + b.nbytes for a, b in layer.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="loop intervals per way")
    args = parser.parse_args()
    device = jax.devices()[0]
    library = adapters(np.random.default_rng(0))
    n = 2048 if jax.default_backend() == "gpu" else 256
    x = jnp.ones((n, n), jnp.bfloat16)
    step = jax.jit(lambda x, tokens: jax.lax.fori_loop(0, 150, lambda i, y: (y @ x) * 1e-3, x)[0, :32] + tokens)
    on_device = jax.device_put(np.zeros(32, np.int32), device)
    jax.block_until_ready((step(x, on_device), jax.device_put(library[0], device)))

    def run(name: str, *, thread: bool = False, rate: float | None = None, gap: float = 0.0,
            inputs_on_device: bool = False, per_step: int = 0) -> None:
        stop, copies = threading.Event(), []

        def copier():  # one adapter after another, its layers paced at `rate` bytes/s, `gap` s between adapters
            i = 0
            while not stop.is_set():
                start, sent, outs = time.perf_counter(), 0, []
                for layer in library[i % len(library)]:
                    if rate:
                        time.sleep(max(0.0, start + sent / rate - time.perf_counter()))
                    outs.append(jax.device_put(layer, device))
                    sent += nbytes(layer)
                jax.block_until_ready(outs)
                copies.append(time.perf_counter() - start)
                time.sleep(gap)
                i += 1

        worker = threading.Thread(target=copier) if thread else None
        if worker:
            worker.start()
        current = None  # the loop thread's copy: [adapter, layers issued, start, outputs]
        intervals, last, in_flight = [], time.perf_counter(), None
        for k in range(args.steps):
            end = time.perf_counter() + 1e-3
            while time.perf_counter() < end:  # the loop's Python work
                pass
            out = step(x, on_device if inputs_on_device else np.full(32, k, np.int32))
            if per_step:  # the loop thread copies right after the dispatch
                current = current or [library[k % len(library)], 0, time.perf_counter(), []]
                for layer in current[0][current[1]: current[1] + per_step]:
                    current[3].append(jax.device_put(layer, device))
                current[1] += per_step
                if current[1] >= LAYERS and all(a.is_ready() for a in jax.tree.leaves(current[3])):
                    copies.append(time.perf_counter() - current[2])
                    current = None
            if in_flight is not None:
                np.asarray(in_flight)  # the step before, as the engine reads its tokens
            in_flight = out
            now = time.perf_counter()
            intervals.append(now - last)
            last = now
        np.asarray(in_flight)
        stop.set()
        if worker:
            worker.join()
        ms = np.array(intervals[20:]) * 1e3
        copied = (f"{len(copies)} adapters copied, {np.median(copies) * 1e3:.1f} ms p50 each" if copies
                  else "no copies")
        print(f"{name:34s} interval p50 {np.median(ms):.2f} / p99 {np.percentile(ms, 99):.2f} / max {ms.max():.1f}"
              f" ms; {copied}", flush=True)

    sizes = [round(sum(map(nbytes, a)) / 1e6, 1) for a in library]
    print(f"Device: {device.device_kind}; adapters of ranks {RANKS}: {sizes} MB")
    run("none")
    run("none, input on the device", inputs_on_device=True)
    run("loader thread, input on the device", thread=True, inputs_on_device=True)
    for rate in (None, 2e9, 1e9, 5e8, 2.5e8):
        run(f"loader thread, {rate / 1e6:g} MB/s" if rate else "loader thread, unpaced", thread=True, rate=rate)
    for rate in (None, 5e8):
        run(f"5 adapters/s, {rate / 1e6:g} MB/s" if rate else "5 adapters/s, unpaced", thread=True, rate=rate,
            gap=0.2)
    for per_step in (1, 4, 32):
        run(f"loop thread, {per_step} layers per step", per_step=per_step)


if __name__ == "__main__":
    main()
