"""Whether a request's bits depend on the requests beside it: the ops alone, then whole generations.

`tests/test_batch_invariance.py` checks tokens in float32, where the step's numbers may differ in the last bits
from batch to batch and greedy tokens still agree. Here:
- *ops*: the first token row's result of the projection product (`llama.project`, [M, K] x [K, N]) at M rows,
  and the first request's of the prompt attention (`llama._masked_attention`) among B requests: the sizes that
  give it the same bits, grouped, and the largest difference between the groups.
- *engine*: a request generated alone, then beside other requests (longer prompts, prefilled in pieces while it
  decodes, and rows refilled as they end), greedy: the first token where it departs from its run alone and the
  largest log-probability difference before it, per trial, in each dtype; and whether the same call run twice
  gives the same bits.
- On a GPU, the projection product again compiled under XLA options that could fix its reduction order.
- *fixed order* (`--gemm`): what a product with one reduction order at every M costs. A Pallas GEMM whose
  program (n, m, s) computes a [BM, BN] f32 block over K split s of a fixed `splits`, BK columns a step, with the
  rows padded to BM whatever M is, and the splits added in their order: its first row's bits over M = 1-2048,
  and its device time per call against XLA's (`x @ w`, 32 calls over distinct weights and activations) at decode
  and prefill sizes, bf16.

JSON: bit_invariance.json (bit_invariance_gemm.json for `--gemm`).

  python bench/studies/bit_invariance.py [--dtypes bfloat16,float32] [--trials 6] [--out DIR]  # GPU or CPU
  python bench/studies/bit_invariance.py --gemm [--out DIR]                                       # GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from kernels import CALLS, device_time_per_call  # noqa: E402

from jlora import testing  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from jlora.models.llama import _masked_attention, project  # noqa: E402


def classes(rows: dict[int, jax.Array]) -> dict:
    """The sizes whose first row has the same bits, grouped, and the largest difference between two groups."""
    groups: list[tuple[np.ndarray, list[int]]] = []
    for size, row in rows.items():
        row = np.asarray(row, np.float32)
        match = next((g for g in groups if np.array_equal(g[0], row)), None)
        if match is None:
            groups.append((row, [size]))
        else:
            match[1].append(size)
    spread = max(float(np.abs(g[0] - groups[0][0]).max()) for g in groups)
    return {"same_bits": [g[1] for g in groups], "max_abs": spread}


# XLA options that could fix a product's reduction order whatever its rows: no split of K, no autotuning
OPTIONS = {"no_split_k": {"xla_gpu_enable_split_k_autotuning": False}, "autotune_0": {"xla_gpu_autotune_level": 0}}


def ops_rows(dtype, options: dict | None = None) -> dict:
    rng = np.random.default_rng(0)
    out = {"project": {}, "attention": {}}
    for k, n in ((4096, 6144), (14336, 4096)):
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
        x = jnp.asarray(rng.standard_normal((1024, k)), dtype)
        f = jax.jit(lambda a: project(a, w, False))
        sizes = (1, 2, 4, 8, 16, 32, 36, 40, 64, 72, 136, 264, 520, 1024)
        if options is not None:
            try:
                rows = {m: f.lower(x[:m]).compile(compiler_options=options)(x[:m])[0] for m in sizes}
            except Exception as err:  # an option this XLA does not have
                return {"error": f"{type(err).__name__}: {err}"[:300]}
            out["project"][f"{k}x{n}"] = classes(rows)
            continue
        out["project"][f"{k}x{n}"] = classes({m: f(x[:m])[0] for m in sizes})
    s, kv, g, d, t = 64, 8, 4, 128, 1024
    q = jnp.asarray(rng.standard_normal((8, s, kv, g, d)), dtype)
    keys = jnp.asarray(rng.standard_normal((8, kv, t, d)), dtype)
    values = jnp.asarray(rng.standard_normal((8, kv, t, d)), dtype)
    pos = jnp.broadcast_to(jnp.arange(s)[None], (8, s))
    f = jax.jit(lambda *a: _masked_attention(*a, None))
    out["attention"] = classes({b: f(q[:b], keys[:b], values[:b], pos[:b])[0] for b in (1, 2, 4, 8)})
    return out


def fixed_order_matmul(x: jax.Array, w: jax.Array, *, block_m: int = 64, block_n: int = 128, block_k: int = 64,
                       splits: int = 1) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] f32, each row's sums in one order whatever M is: rows padded to `block_m`, K in
    `splits` parts of `block_k`-column steps, the parts added in order."""
    m, k_dim = x.shape
    n_dim = w.shape[1]
    mp = -(-m // block_m) * block_m
    k_split = k_dim // splits

    def kernel(x_ref, w_ref, o_ref):
        s = pl.program_id(2)

        def step(j, acc):
            ks = pl.ds(pl.multiple_of(s * k_split + j * block_k, block_k), block_k)
            return acc + pltriton.dot(x_ref[:, ks], w_ref[ks, :])

        o_ref[0] = jax.lax.fori_loop(0, k_split // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))

    partials = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((splits, mp, n_dim), jnp.float32),
        grid=(n_dim // block_n, mp // block_m, splits),
        in_specs=[pl.BlockSpec((block_m, k_dim), lambda n, i, s: (i, 0)),
                  pl.BlockSpec((k_dim, block_n), lambda n, i, s: (0, n))],
        out_specs=pl.BlockSpec((1, block_m, block_n), lambda n, i, s: (s, i, n)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=jax.default_backend() != "gpu", name="fixed_order_matmul",
    )(jnp.pad(x, ((0, mp - m), (0, 0))), w)
    out = partials[0]
    for part in range(1, splits):  # in order, element by element
        out = out + partials[part]
    return out[:m]


def per_call_us(fn, xs, ws) -> float:
    """Device µs per call of `fn` over `CALLS` distinct (x, w) pairs in one jitted program (`kernels.py`'s
    measurement, from a profiler trace)."""
    run = jax.jit(lambda xs, ws: [fn(xs[i], ws[i]) for i in range(CALLS)])
    return device_time_per_call(run, xs, ws)[0] * 1e6


def gemm_rows() -> dict:
    out = {}
    for k, n in ((4096, 6144), (14336, 4096)):
        kw, kx = jax.random.split(jax.random.key(k))
        ws = (jax.random.normal(kw, (CALLS, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        xs = jax.random.normal(kx, (CALLS, 2048, k), jnp.float32).astype(jnp.bfloat16)
        shape = out.setdefault(f"{k}x{n}", {})
        for splits in (1, 4):
            f = jax.jit(functools.partial(fixed_order_matmul, splits=splits))
            shape[f"splits {splits} same_bits"] = classes({m: f(xs[0, :m], ws[0])[0]
                                                           for m in (1, 8, 32, 64, 136, 520, 2048)})["same_bits"]
        for m in (8, 32, 512, 2048):
            xla = per_call_us(lambda x, w: project(x, w, False), xs[:, :m], ws)
            row = {"xla_us": round(xla, 1)}
            for splits in (1, 4):
                t = per_call_us(functools.partial(fixed_order_matmul, splits=splits), xs[:, :m], ws)
                row[f"splits {splits} us"] = round(t, 1)
                row[f"splits {splits} x xla"] = round(t / xla, 3)
            shape[f"M {m}"] = row
            print(k, n, m, row, flush=True)
    return out


def engine_trials(dtype: str, trials: int, root: str) -> list[dict]:
    eng = Engine.from_pretrained(root, dtype=dtype, max_batch=4, max_seq_len=1024, prefill_chunk=256, max_loras=1,
                                 progress=False)
    rng = np.random.default_rng(1)
    rows = []
    for trial in range(trials):
        a = [int(t) for t in rng.integers(0, 32000, 16)]
        alone = eng.generate([a], [None], 200, logprobs=0)[0]
        others = [[int(t) for t in rng.integers(0, 32000, n)] for n in (600, 40, 300, 90, 500)]
        beside = eng.generate([a, *others], [None] * 6, 200, logprobs=0)[0]
        again = eng.generate([a, *others], [None] * 6, 200, logprobs=0)[0]  # the same call: the same bits?
        first = next((i for i, (x, y) in enumerate(zip(alone, beside)) if x != y), None)
        lp = np.abs(np.array([t.logprob for t in alone.logprobs]) - np.array([t.logprob for t in beside.logprobs]))
        rows.append({"trial": trial, "first_token_differing": first,
                     "logprob_max_diff_before": float(lp[:first].max()) if first != 0 else 0.0,
                     "logprob_bits_differ_at_0": bool(lp[0] != 0),
                     "same_call_same_bits": list(again) == list(beside) and all(
                         x.logprob == y.logprob for x, y in zip(again.logprobs, beside.logprobs))})
        print(dtype, rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--gemm", action="store_true", help="the fixed-order GEMM's bits and time against XLA's only")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args()
    if args.gemm:
        result = {"device": jax.devices()[0].device_kind, "gemm": gemm_rows()}
        print(json.dumps(result), flush=True)
        with open(os.path.join(args.out, "bit_invariance_gemm.json"), "w") as f:
            json.dump(result, f, indent=1)
        return
    result = {"device": jax.devices()[0].device_kind, "ops": {}, "engine": {}}
    for dtype in args.dtypes.split(","):
        result["ops"][dtype] = ops_rows(jnp.dtype(dtype))
        print(dtype, json.dumps(result["ops"][dtype]), flush=True)
        if jax.default_backend() == "gpu":
            for name, options in OPTIONS.items():
                result["ops"][f"{dtype} {name}"] = ops_rows(jnp.dtype(dtype), options)
                print(dtype, name, json.dumps(result["ops"][f"{dtype} {name}"]), flush=True)
    with tempfile.TemporaryDirectory() as root:
        cfg = testing.tiny_config("llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                                  max_position_embeddings=4096)
        testing.write_model(root, cfg, seed=3)
        for dtype in args.dtypes.split(","):
            result["engine"][dtype] = engine_trials(dtype, args.trials, root)
    with open(os.path.join(args.out, "bit_invariance.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
