"""The decode attention kernel's launch parameters (#39): cache positions per loop step (`block_t`), Triton's
warps per program and pipeline stages, swept over the 8B shape (8 KV heads of 4 query heads, head_dim 128) at
the batches and contexts the model step runs, over contiguous rows and over the paged cache (16-position
blocks in a random order), unsplit and split as the engine splits (`split_chunk`).

Each case: device µs per layer over layers with distinct caches, each layer's query the layer before's output
(as in the model), as many layers as make their caches 4x the 50 MB L2 (at least 8), so no run finds a layer's
keys still in L2 from the run before; and the visible KV bytes over that time; every setting's output is checked
against the shipped setting's (‖out − ref‖ / ‖ref‖ < 1e-2) first. A setting that does not compile (shared
memory) is recorded as such. JSON: attention_tiles.json, written after each case.

A setting adopted must be one for every batch of an engine: the key block sets the online softmax's order of
operations, so a request's bits alone and in a batch stay equal only when every batch size runs the same one.

  python bench/studies/attention_tiles.py [--cases rows,paged,split] [--out DIR]   # GPU
  python bench/studies/attention_tiles.py --smoke                                  # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import trace_kernels  # noqa: E402

from jlora.pallas.decode_attention import _call, _kernel, _paged_kernel, split_chunk  # noqa: E402

KV, GROUPS, HEAD_DIM, PAGE = 8, 4, 128, 16
MIN_LAYERS, CACHES_BYTES = 8, 200 << 20  # the layers' caches together: 4x the H100 / H200's 50 MB L2
SHIPPED = dict(block_t=64, num_warps=4, num_stages=3)
SETTINGS = [dict(block_t=b, num_warps=w, num_stages=s)
            for b, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
CASES = {  # layout -> (batch, cache positions, query position)
    "rows": [(1, 1024, 512), (8, 1024, 512), (32, 1024, 512), (64, 1024, 512), (32, 4096, 4000)],
    "paged": [(32, 1024, 512), (64, 1024, 512), (32, 4096, 4000)],
    "split": [(1, 1024, 512), (8, 1024, 512), (1, 4096, 4000)],  # paged, split as the engine splits
}


def attention(layout: str, batch: int, max_seq: int, pos: int):
    """(fn(q, k, v, **setting), caches' shape, the call's extra arrays) for one case."""
    positions = jnp.full((batch,), pos, jnp.int32)
    if layout == "rows":
        def fn(q, k, v, *, block_t, **launch):
            return _call(_kernel, "decode_attention", q, positions, jnp.arange(batch, dtype=jnp.int32), k, v,
                            block_t=block_t, window=None, chunk=None, limit=max_seq, **launch)
        return fn, (batch, KV, max_seq, HEAD_DIM)
    blocks = batch * max_seq // PAGE
    tables = jnp.asarray(np.random.default_rng(0).permutation(blocks).reshape(batch, -1), jnp.int32)
    chunk = split_chunk(max_seq, PAGE) if layout == "split" else None

    def fn(q, k, v, *, block_t, **launch):
        return _call(functools.partial(_paged_kernel, page=PAGE), "paged_decode_attention", q, positions,
                        tables, k.reshape(-1, HEAD_DIM), v.reshape(-1, HEAD_DIM), block_t=block_t, window=None,
                        chunk=chunk, limit=max_seq, **launch)
    return fn, (blocks, KV, PAGE, HEAD_DIM)


def case_rows(layout: str, batch: int, max_seq: int, pos: int, layers: int, settings: list[dict]) -> list[dict]:
    fn, shape = attention(layout, batch, max_seq, pos)
    key = jax.random.key(batch * max_seq)
    ks = [jax.random.normal(jax.random.fold_in(key, 2 * i), shape, jnp.bfloat16) for i in range(layers)]
    vs = [jax.random.normal(jax.random.fold_in(key, 2 * i + 1), shape, jnp.bfloat16) for i in range(layers)]
    q = jax.random.normal(jax.random.fold_in(key, 2 * layers), (batch, KV, GROUPS, HEAD_DIM), jnp.bfloat16)
    ref = jax.jit(functools.partial(fn, **SHIPPED))(q, ks[0], vs[0]).astype(jnp.float32)
    kv_bytes = 2 * KV * HEAD_DIM * 2 * batch * (pos + 1)
    rows = []
    for setting in settings:
        row = dict(layout=layout, batch=batch, max_seq=max_seq, position=pos, layers=layers, **setting,
                   shipped=setting == SHIPPED)
        one = jax.jit(functools.partial(fn, **setting))
        try:
            out = one(q, ks[0], vs[0]).astype(jnp.float32)
        except Exception as err:  # noqa: BLE001 - a setting past the shared memory fails to compile
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            rows.append(row)
            continue
        row["rel_error"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        if row["rel_error"] >= 1e-2:
            raise AssertionError(f"{row}: relative error {row['rel_error']:.3g} against the shipped setting")

        def chain(q, ks, vs):
            for k, v in zip(ks, vs):
                q = fn(q, k, v, **setting)
            return q

        if jax.default_backend() == "gpu":
            run = jax.jit(chain)
            jax.block_until_ready(run(q, ks, vs))
            kernels = trace_kernels(lambda: run(q, ks, vs))
            row["us_per_layer"] = sum(sum(d) for d in kernels.values()) / layers
            row["TBps"] = kv_bytes / row["us_per_layer"] / 1e6
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one small case per layout (interpret mode on CPU)")
    parser.add_argument("--cases", default="rows,paged,split", help="the layouts to sweep")
    parser.add_argument("--batches", default=None, help="only these batch sizes (e.g. 1,32); default all")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    print(f"# {device}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention_tiles_smoke.json" if args.smoke else "attention_tiles.json")
    result = {"device": device, "shipped": SHIPPED, "rows": []}
    for layout in args.cases.split(","):
        cases = [(2, 256, 200)] if args.smoke else CASES[layout]
        if args.batches:
            cases = [c for c in cases if c[0] in {int(b) for b in args.batches.split(",")}]
        for batch, max_seq, pos in cases:
            settings = [SHIPPED, dict(block_t=32, num_warps=4, num_stages=2)] if args.smoke else SETTINGS
            per_layer = 2 * batch * KV * max_seq * HEAD_DIM * 2  # K and V, bf16
            layers = 1 if args.smoke else max(MIN_LAYERS, -(-CACHES_BYTES // per_layer))
            start = time.monotonic()
            rows = case_rows(layout, batch, max_seq, pos, layers, settings)
            result["rows"] += rows
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            timed = [r for r in rows if "us_per_layer" in r]
            if timed:
                best, shipped = min(timed, key=lambda r: r["us_per_layer"]), next(r for r in timed if r["shipped"])
                print(f"{layout:5s} B={batch:2d} {pos}/{max_seq} ({layers} layers, {time.monotonic() - start:.0f} s): "
                      f"shipped {shipped['us_per_layer']:6.1f} µs ({shipped['TBps']:.2f} TB/s), "
                      f"best {best['us_per_layer']:6.1f} µs ({best['TBps']:.2f} TB/s) "
                      f"at block_t={best['block_t']} warps={best['num_warps']} stages={best['num_stages']}; "
                      + " ".join(f"{r['block_t']}/{r['num_warps']}/{r['num_stages']}:"
                                 f"{r['us_per_layer']:.1f}" for r in timed), flush=True)


if __name__ == "__main__":
    main()
