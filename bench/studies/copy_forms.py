"""Which part of an engine-shaped loop adapter copies to the device slow, and whether the form of the copy
matters (#36's ITL tail; docs/performance.md, § Tenancy).

The loop: 1 ms of Python, then the dispatch of a memory-bound step (x [32, 4096] through 64 pairs of 8B-shaped
MLP weights, about 15 GB read, fed a token array from the host), then the read of the step before (two steps
in flight). Each interval is split into the dispatch's host time and the read's wait: a stall on the host
shows in the dispatch, one on the device in the wait. The step takes `--inputs` small arrays (8, as the engine's
step), from the host each step or, in the `device inputs` rounds, placed on the device beforehand: if the copies
slow the dispatch through the step's own input transfers (one host-to-device stream per device), the rounds
with device inputs do not slow.

Copies, each of 8B-shaped q_proj + v_proj adapters (ranks 8/16/32/64: 7-55 MB), by a thread beside the loop,
without pause or 5 adapters a second: `per layer` (one `jax.device_put` per layer of a pytree of A and B
arrays, as `AdapterPool.stage` copied), `packed` (the adapter's bytes as one contiguous array, one
`device_put`, as `AdapterPool.stage` copies now), `chunked` (the same bytes in 4 MB `device_put`s, so a
step's input waits behind at most one of them), `gated` (those chunks issued only while the loop waits for
the step before, so none is issued while the loop dispatches: whether the copy slows the dispatch as it is
issued or while its transfer runs), `mapped` (the same from host memory registered with the GPU
client once, `Client.dma_map`: PjRt then copies from it directly instead of through a pinned staging buffer of
its own; GPU only), `host copy` (the packed bytes copied host to host with numpy, no device involved).
`--no-staging` runs the process with PjRt's staging of host-to-device copies off (the client option
`should_stage_host_to_device_transfers`; the CUDA driver then stages pageable memory itself).

  python bench/studies/copy_forms.py [--steps 300] [--inputs 8] [--no-staging]  # GPU
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from copy_pacing import RANKS, adapters  # the same library of 8B-shaped adapters

CHUNK = 4 << 20  # bytes per piece of the chunked and gated copies


def packed(adapter: list[dict]) -> np.ndarray:
    """The adapter's arrays, raveled and joined into one uint8 array."""
    return np.concatenate([x.view(np.uint8).ravel() for x in jax.tree.leaves(adapter)])


def percentiles(seconds: list[float]) -> str:
    ms = np.array(seconds) * 1e3
    return f"{np.median(ms):.2f} / {np.percentile(ms, 99):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="loop intervals per way")
    parser.add_argument("--inputs", type=int, default=8, help="the step's small input arrays")
    parser.add_argument("--no-staging", action="store_true", help="PjRt's staging of host-to-device copies off")
    args = parser.parse_args()
    if args.no_staging:  # before the backend starts
        jax.config.update("jax_pjrt_client_create_options", {"should_stage_host_to_device_transfers": False})
    device = jax.devices()[0]
    library = adapters(np.random.default_rng(0))
    flat = [packed(a) for a in library]
    gpu = jax.default_backend() == "gpu"
    pairs, d, f = (64, 4096, 14336) if gpu else (2, 256, 512)
    key = jax.random.key(0)
    weights = [(jax.random.normal(jax.random.fold_in(key, i), (d, f), jnp.bfloat16) * 0.02,
                jax.random.normal(jax.random.fold_in(key, pairs + i), (f, d), jnp.bfloat16) * 0.02)
               for i in range(pairs)]

    @jax.jit
    def step(weights, inputs):
        x = jnp.ones((32, d), jnp.bfloat16) * sum(inputs)[:, None].astype(jnp.bfloat16)
        for up, down in weights:
            x = x + jax.nn.silu(x @ up) @ down
        return x[:, 0]

    def host_inputs(k: int) -> list[np.ndarray]:
        return [np.full(32, k + i, np.int32) for i in range(args.inputs)]

    jax.block_until_ready((step(weights, host_inputs(0)), jax.device_put(library[0], device),
                           jax.device_put(flat[0], device)))
    start = time.perf_counter()
    for k in range(20):
        out = step(weights, host_inputs(k))
    out.block_until_ready()
    print(f"Device: {device.device_kind}; step alone {(time.perf_counter() - start) / 20 * 1e3:.2f} ms; "
          f"adapters of ranks {RANKS}: {[round(x.nbytes / 1e6, 1) for x in flat]} MB", flush=True)

    def copy_per_layer(i: int) -> None:
        jax.block_until_ready([jax.device_put(layer, device) for layer in library[i % len(library)]])

    def copy_packed(i: int) -> None:
        jax.device_put(flat[i % len(flat)], device).block_until_ready()

    def copy_chunked(i: int) -> None:
        x = flat[i % len(flat)]
        jax.block_until_ready([jax.device_put(x[j:j + CHUNK], device) for j in range(0, x.nbytes, CHUNK)])

    waiting = threading.Event()  # set while the loop waits for the step before

    def copy_gated(i: int) -> None:
        x = flat[i % len(flat)]
        for j in range(0, x.nbytes, CHUNK):
            waiting.wait()
            jax.device_put(x[j:j + CHUNK], device).block_until_ready()

    def copy_on_host(i: int) -> None:
        flat[i % len(flat)].copy()

    mapped = [np.empty_like(x) for x in flat]  # each adapter's packed bytes in host memory the client maps
    try:
        for m, x in zip(mapped, flat):
            device.client.dma_map(m.ctypes.data, m.nbytes)
            m[...] = x
    except Exception as err:  # UNIMPLEMENTED off GPU
        print(f"no mapped copies: {type(err).__name__}: {err}", flush=True)
        mapped = None

    def copy_mapped(i: int) -> None:
        jax.device_put(mapped[i % len(mapped)], device).block_until_ready()

    def run(name: str, copy=None, gap: float = 0.0, on_device: bool = False) -> None:
        # device inputs: placed beforehand, one set per step (a call whose inputs a step in flight holds waits)
        feeds = ([jax.device_put(host_inputs(k), device) for k in range(args.steps)] if on_device else None)
        jax.block_until_ready(feeds)
        stop, copies = threading.Event(), []

        def copier():
            i = 0
            while not stop.is_set():
                start = time.perf_counter()
                copy(i)
                copies.append(time.perf_counter() - start)
                time.sleep(gap)
                i += 1

        worker = threading.Thread(target=copier) if copy else None
        if worker:
            worker.start()
        intervals, dispatches, waits, last, in_flight = [], [], [], time.perf_counter(), None
        for k in range(args.steps):
            end = time.perf_counter() + 1e-3
            while time.perf_counter() < end:  # the loop's Python work
                pass
            t0 = time.perf_counter()
            out = step(weights, feeds[k] if on_device else host_inputs(k))
            t1 = time.perf_counter()
            waiting.set()
            if in_flight is not None:
                np.asarray(in_flight)  # the step before, as the engine reads its tokens
            waiting.clear()
            in_flight = out
            now = time.perf_counter()
            dispatches.append(t1 - t0)
            waits.append(now - t1)
            intervals.append(now - last)
            last = now
        np.asarray(in_flight)
        stop.set()
        waiting.set()  # a gated copy's last chunk
        if worker:
            worker.join()
        copied = (f"{len(copies)} copies, {np.median(copies) * 1e3:.1f} ms p50" if copies else "no copies")
        print(f"{name:36s} interval {percentiles(intervals[20:])}  dispatch {percentiles(dispatches[20:])}  "
              f"wait {percentiles(waits[20:])} ms (p50 / p99); {copied}", flush=True)

    run("none")
    run("none, device inputs", on_device=True)
    for gap, rate in ((0.0, "unpaced"), (0.2, "5/s")):
        run(f"per layer, {rate}", copy_per_layer, gap)
        run(f"packed, {rate}", copy_packed, gap)
        run(f"packed, {rate}, device inputs", copy_packed, gap, on_device=True)
        run(f"chunked, {rate}", copy_chunked, gap)
        run(f"gated, {rate}", copy_gated, gap)
        if mapped is not None:
            run(f"mapped, {rate}", copy_mapped, gap)
            run(f"mapped, {rate}, device inputs", copy_mapped, gap, on_device=True)
        run(f"host copy, {rate}", copy_on_host, gap)
    run("none, again")
    if mapped is not None:
        for m in mapped:
            device.client.dma_unmap(m.ctypes.data)
        np.testing.assert_array_equal(np.asarray(jax.device_put(mapped[1], device)), flat[1])  # copies are exact


if __name__ == "__main__":
    main()
