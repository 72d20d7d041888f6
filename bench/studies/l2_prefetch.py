"""Whether reading a projection's weight into L2 beside the decode attention speeds up its GEMM (#39).

At batch 1 the decode attention waits on loads (9 µs a layer, #39's profile) while the memory bus idles, and the
o projection's GEMM after it reads its 34 MB at 2.9 TB/s. This study chains 32 layers shaped like the 8B
model's attention half, each `x -> norm -> q GEMM [K, K] -> decode attention over 1024 positions -> o GEMM
[K, K] -> x + o`, every layer with weights and caches of its own, compiled as the engine compiles decode steps
(concurrent CUDA graphs), in these forms:
- `plain`: as above;
- `prefetch`: a reduction over the o weight (XLA's, reading all of it) starts once the q GEMM is done (an
  optimization barrier), beside the attention, and the attention's output takes its sum times 0, so the o GEMM
  waits for it and may find the weight in L2 (a barrier alone let XLA drop the unused sum);
- `prefetch half`: the same over the weight's first half of rows;
- `serial prefetch`: the reduction after the attention, before the o GEMM: the reduction's cost plus a GEMM
  from L2, against `plain`'s GEMM from memory.
ms per chain (median of rounds, the forms alternating, each round the wall time of back-to-back calls). On an
H200 every read made the chain slower (bench/results/l2_prefetch.json; docs/performance.md § The model step).

  python bench/studies/l2_prefetch.py [--batches 1,32] [--rounds 5] [--out bench/results] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from jlora.compile_options import step_compiler_options  # noqa: E402
from jlora.pallas.decode_attention import decode_attention  # noqa: E402

FORMS = ("plain", "prefetch", "prefetch half", "serial prefetch")


def chain(form: str, x, wq, wo, k_cache, v_cache, positions, rows, kv_heads: int, head_dim: int):
    """x [B, K] through len(wq) layers of `form` (module doc): [B, K]."""
    b, k = x.shape
    for i in range(len(wq)):
        h = (x.astype(jnp.float32) * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
                                                    + 1e-5)).astype(x.dtype)
        q = jnp.dot(h, wq[i], preferred_element_type=jnp.float32).astype(x.dtype)
        w = wo[i]
        if form in ("prefetch", "prefetch half"):
            q, w = jax.lax.optimization_barrier((q, w))  # the read starts once the q GEMM is done
            touched = jnp.sum((w if form == "prefetch" else w[: k // 2]).astype(jnp.float32))
        a = decode_attention(q.reshape(b, kv_heads, -1, head_dim), k_cache[i], v_cache[i], positions, rows)
        a = a.reshape(b, k)
        if form == "serial prefetch":
            a, w = jax.lax.optimization_barrier((a, w))
            touched = jnp.sum(w.astype(jnp.float32))
        if form != "plain":  # the o GEMM after the read, whose sum it takes (times 0) so that XLA keeps it
            a = a + (touched * 0).astype(a.dtype)
        x = x + jnp.dot(a, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3, help="of back-to-back calls per form and round")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    args = parser.parse_args()
    layers, k, kv_heads, head_dim, seq = (2, 256, 2, 64, 128) if args.tiny else (32, 4096, 8, 128, 1024)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    key = jax.random.key(0)
    # one array per layer and weight, as the model's parameters (a slice of a stacked array may be copied)
    wq, wo = ([(jax.random.normal(jax.random.fold_in(key, 2 * i + j), (k, k), jnp.float32) / np.sqrt(k)).astype(dtype)
               for i in range(layers)] for j in range(2))
    result = {"device": jax.devices()[0].device_kind, "layers": layers, "hidden": k, "positions": seq, "rows": []}
    for batch in map(int, args.batches.split(",")):
        shape = (batch, kv_heads, seq, head_dim)
        k_cache, v_cache = ([jax.random.normal(jax.random.fold_in(key, 1000 * j + i), shape, jnp.float32).astype(dtype)
                             for i in range(layers)] for j in (1, 2))
        x = jax.random.normal(jax.random.fold_in(key, 5000), (batch, k), jnp.float32).astype(dtype)
        positions, rows = jnp.full(batch, seq // 2, jnp.int32), jnp.arange(batch, dtype=jnp.int32)
        calls, outs = {}, {}
        for form in FORMS:
            calls[form] = jax.jit(lambda *a, f=form: chain(f, *a, kv_heads=kv_heads, head_dim=head_dim),
                                  compiler_options=step_compiler_options(1) or None)
            outs[form] = np.asarray(calls[form](x, wq, wo, k_cache, v_cache, positions, rows).astype(jnp.float32))
        for form in FORMS[1:]:  # the same values: the barriers and reads change no result
            np.testing.assert_array_equal(outs[form], outs["plain"])
        times = {form: [] for form in FORMS}
        for round_ in range(args.rounds + 1):  # round 0 warms up, unrecorded
            for form, call in calls.items():
                n, start = 0, time.perf_counter()
                while time.perf_counter() - start < args.seconds:
                    out = call(x, wq, wo, k_cache, v_cache, positions, rows)
                    n += 1
                out.block_until_ready()
                if round_:
                    times[form].append((time.perf_counter() - start) / n * 1e3)
        row = {"batch": batch, **{form: statistics.median(t) for form, t in times.items()}}
        print(f"batch {batch}: " + ", ".join(f"{form} {row[form]:.3f} ms" for form in FORMS)
              + f"; prefetch {row['prefetch'] / row['plain']:.3f}x plain", flush=True)
        result["rows"].append(row)
        del k_cache, v_cache
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "l2_prefetch_tiny.json" if args.tiny else "l2_prefetch.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
