"""Two probes of the batch-1 decode step over [out, in] weights, for #39 (neither adopted; docs/performance.md):

- `projections`: a Pallas GEMV over an [N, K] weight (a program per `bn` output rows, a loop over K in `bk`
  pieces, f32 products summed along the row) against XLA's row reduction (`jlora.models.llama.project` at one
  token), each Llama-3-8B projection at one token, over 24 calls with distinct weights (so that L2 holds no
  weight), device time per call; the GEMV at 44 tilings (bn 2-16, bk 512-2048, 4 or 8 warps, 2 or 3 stages), its
  best three timed again. Every output is checked against a float32 dot (relative error < 1e-2).
- `attention`: the decode attention over 1024 positions (query at 512), contiguous rows and 16-position pages,
  at batch 1-8, unsplit and split over chunks of 64, 128 and 256 positions (`split_chunk` takes 256 at least):
  device time per layer with its combine, 32 layers chained. `model`: the 8B base decode step (`bench/model.py`'s
  random model and layout) at batch 1, 2, 4 and 8 with those chunks, in alternating rounds.

JSON: batch_one_probes.json.

  python bench/studies/batch_one_probes.py [--parts attention,model,projections] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import copy_bandwidth, trace_kernels  # noqa: E402
from model import engine_layout, llama3_8b, random_model, time_alternating  # noqa: E402
from split_attention import attention_case, base_decode, chain  # noqa: E402

from jlora.runner import forward  # noqa: E402
from jlora.step import StepOptions  # noqa: E402

F32 = jnp.float32
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096)}  # (K, N)
TILINGS = [(bn, bk, warps, stages) for bn in (2, 4, 8, 16) for bk in (512, 1024, 2048) for warps in (4, 8)
           for stages in (2, 3) if bn * bk <= 16384]


def _gemv_kernel(x_ref, w_ref, o_ref, *, bn: int, bk: int, nk: int, m: int):
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * bn, bn), bn)

    def body(k, acc):
        ks = pl.ds(pl.multiple_of(k * bk, bk), bk)
        w = w_ref[rows, ks].astype(F32)  # [bn, bk]
        x = x_ref[:, ks].astype(F32)  # [m, bk]
        return acc + jnp.sum(x[:, None, :] * w[None, :, :], axis=2)

    o_ref[:, rows] = jax.lax.fori_loop(0, nk, body, jnp.zeros((m, bn), F32)).astype(o_ref.dtype)


def gemv(x: jax.Array, w: jax.Array, bn: int, bk: int, warps: int, stages: int) -> jax.Array:
    """x [M, K] times w [N, K] transposed -> [M, N] in x's dtype."""
    m, k = x.shape
    return pl.pallas_call(functools.partial(_gemv_kernel, bn=bn, bk=bk, nk=k // bk, m=m),
                          out_shape=jax.ShapeDtypeStruct((m, w.shape[0]), x.dtype), grid=(w.shape[0] // bn,),
                          compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
                          interpret=jax.default_backend() != "gpu")(x, w)


def row_reduction(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.sum(x.astype(F32) * w.astype(F32), axis=1)[None].astype(x.dtype)


def projections(result: dict, save) -> None:
    key = jax.random.key(0)
    for name, (k, n) in SHAPES.items():
        calls = 24
        ws = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) * 0.02 for i in range(calls)]
        xs = [jax.random.normal(jax.random.fold_in(key, 99 + i), (1, k), jnp.bfloat16) for i in range(calls)]
        ref = jnp.dot(xs[0].astype(F32), ws[0].astype(F32).T)

        def timed(fn, traces: int = 1) -> dict:
            error = float(jnp.linalg.norm(jax.jit(fn)(xs[0], ws[0]).astype(F32) - ref) / jnp.linalg.norm(ref))
            assert error < 1e-2, (name, error)
            run = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
            jax.block_until_ready(run(xs, ws))
            best = min(sum(sum(d) for d in trace_kernels(lambda: run(xs, ws)).values()) / calls
                       for _ in range(traces))
            return {"us": best, "TBps": k * n * 2 / best / 1e6, "err": error}

        row = {"shape": name, "k": k, "n": n, "pallas": []}
        for tiling in TILINGS:
            try:
                row["pallas"].append({"tiling": tiling, **timed(lambda x, w, t=tiling: gemv(x, w, *t))})
            except Exception as e:  # a tiling Triton cannot compile
                row["pallas"].append({"tiling": tiling, "error": str(e)[:200]})
        ok = sorted((p for p in row["pallas"] if "us" in p), key=lambda p: p["us"])
        for p in ok[:3]:
            p.update(timed(lambda x, w, t=tuple(p["tiling"]): gemv(x, w, *t), traces=3), retimed=True)
        row["xla_reduction"] = timed(row_reduction, traces=3)
        best = min(ok[:3], key=lambda p: p["us"])
        print(f"{name}: XLA's row reduction {row['xla_reduction']['us']:.2f} µs; the GEMV's best {best}", flush=True)
        result["projections"].append(row)
        save()


def attention(result: dict, save) -> None:
    for batch, paged in itertools.product((1, 2, 4, 8), (False, True)):
        q, ks, vs, attend = attention_case(batch, 1024, 512, paged, 32)
        ref = attend(q, ks[0], vs[0]).astype(F32)
        us = {}
        for chunk in (None, 64, 128, 256):
            fn = functools.partial(attend, chunk=chunk)
            assert float(jnp.linalg.norm(fn(q, ks[0], vs[0]).astype(F32) - ref) / jnp.linalg.norm(ref)) < 1e-2
            run = jax.jit(functools.partial(chain, fn=fn))
            jax.block_until_ready(run(q, ks, vs))
            us[str(chunk)] = min(sum(sum(t) for t in trace_kernels(lambda: run(q, ks, vs)).values()) / len(ks)
                                 for _ in range(3))
        print(f"attention B={batch} {'paged' if paged else 'rows'}: "
              + ", ".join(f"chunk {c}: {u:.2f} µs" for c, u in us.items()), flush=True)
        result["attention"].append(dict(batch=batch, paged=paged, us=us))
        save()


def model(result: dict, save) -> None:
    config = llama3_8b(32)
    model_def, params = random_model(config)
    for batch, chunks in ((1, (None, 256, 128, 64)), (8, (None, 256, 128)), (2, (None, 256, 128)),
                          (4, (None, 256, 128))):
        stored = engine_layout(model_def, params, batch)
        cache, call = base_decode(config, batch, 1024, 512, False)
        runs = {str(c): (lambda cc, c=c, stored=stored: forward(*stored, call, cc, None,
                                                                StepOptions(16, "auto", attention_chunk=c)))
                for c in chunks}
        times, cache = time_alternating(runs, cache, rounds=7)
        ms = {c: statistics.median(t) * 1e3 for c, t in times.items()}
        print(f"model B={batch}: " + ", ".join(f"chunk {c}: {v:.3f} ms" for c, v in ms.items()), flush=True)
        result["model"].append(dict(batch=batch, ms=ms))
        save()
        del cache, stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="attention,model,projections")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    result = {"device": jax.devices()[0].device_kind, "copy_bandwidth": copy_bandwidth(), "projections": [],
              "attention": [], "model": []}
    print(f"# {result['device']}: copy bandwidth {result['copy_bandwidth'] / 1e12:.2f} TB/s", flush=True)
    os.makedirs(args.out, exist_ok=True)

    def save() -> None:
        with open(os.path.join(args.out, "batch_one_probes.json"), "w") as f:
            json.dump(result, f, indent=1)

    parts = {"attention": attention, "model": model, "projections": projections}
    for part in args.parts.split(","):
        parts[part](result, save)


if __name__ == "__main__":
    main()
