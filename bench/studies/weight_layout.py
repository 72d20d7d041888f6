"""The base projections' weights as [N, K] (HF's layout) with a batch-1 step's products as row reductions, against
jlora's [K, N] and XLA's GEMM (#39: at batch 1 the q|k|v and o GEMMs read their weights at 2.6 TB/s).

- `--projections`: device time per call of each Llama-3-8B projection [K, N] at M = 1, 2 and 4 rows, over calls
  with distinct weights and activations (so that L2 holds no weight): `jnp.dot` on [K, N] (jlora's), one
  reduction per row over [K, N] (a column reduction) and over [N, K] (a row reduction: each output a contiguous
  row of the weight). Every output is checked against a float32 dot (relative error < 1e-2). JSON:
  weight_layout_projections.json.
- the model (default): the 8B-shaped base decode step (`bench/model.py`'s random model; contiguous rows,
  context 1024, query at 512), and a base prefill of one prompt of `--prefill` tokens, as shipped, against the
  same step with every `Linear` weight stored [N, K] and its product a row reduction at one token, an einsum over
  [N, K] above, timed in alternating rounds after the two variants' logits are compared. JSON: weight_layout.json.

  python bench/studies/weight_layout.py [--projections] [--batches 1,8,32] [--prefill 512] [--out bench/results]
      # GPU
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import copy_bandwidth, count_and_time, trace_kernels  # noqa: E402
from model import llama3_8b, random_model  # noqa: E402
from norm_kernel import prefill  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora.models import llama  # noqa: E402
from jlora.runner import forward  # noqa: E402
from jlora.step import StepOptions  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
F32 = jnp.float32


def row_products(x: jax.Array, w_nk: jax.Array) -> jax.Array:
    """x [M, K] @ w_nk [N, K].T -> [M, N] in x's dtype, one row reduction per row of x (f32 products and sums)."""
    return jnp.stack([jnp.sum(x[i][None, :].astype(F32) * w_nk.astype(F32), 1) for i in range(x.shape[0])]
                     ).astype(x.dtype)


def column_products(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N], one column reduction per row of x."""
    return jnp.stack([jnp.sum(x[i][:, None].astype(F32) * w.astype(F32), 0) for i in range(x.shape[0])]
                     ).astype(x.dtype)


FORMS = {"dot [K, N]": (lambda x, w: jnp.dot(x, w, preferred_element_type=F32).astype(x.dtype), False),
         "reduce [K, N]": (column_products, False), "reduce [N, K]": (row_products, True)}


def projections(out: str) -> None:
    bandwidth = copy_bandwidth()
    print(f"# {jax.devices()[0].device_kind}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    result, key = {"device": jax.devices()[0].device_kind, "copy_bandwidth_Bps": bandwidth, "rows": []}, jax.random.key(0)
    for (name, (k, n)), m in itertools.product(SHAPES.items(), (1, 2, 4)):
        calls = 32 if name != "lm_head" else 12  # 12 lm_heads of 1 GB, twice
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) * 0.02 for i in range(calls)]
        wts = [jnp.asarray(jax.device_get(w).T.copy()) for w in ws]
        xs = [jax.random.normal(jax.random.fold_in(key, 99 + i), (m, k), jnp.bfloat16) for i in range(calls)]
        ref = jnp.dot(xs[0].astype(F32), ws[0].astype(F32))
        row = {"shape": name, "k": k, "n": n, "m": m}
        for form, (fn, transposed) in FORMS.items():
            w_in = wts if transposed else ws
            error = float(jnp.linalg.norm(jax.jit(fn)(xs[0], w_in[0]).astype(F32) - ref) / jnp.linalg.norm(ref))
            assert error < 1e-2, (name, m, form, error)
            run = jax.jit(lambda xs, ws, fn=fn: [fn(x, w) for x, w in zip(xs, ws)])
            jax.block_until_ready(run(xs, w_in))
            seconds = sum(sum(d) for d in trace_kernels(lambda: run(xs, w_in)).values()) / calls * 1e-6
            row[form] = {"us": seconds * 1e6, "TBps": k * n * 2 / seconds / 1e12}
        result["rows"].append(row)
        print(f"{name:8s} M={m} " + " | ".join(f"{f} {row[f]['us']:7.1f} µs {row[f]['TBps']:.2f} TB/s" for f in FORMS),
              flush=True)
        del ws, wts
        with open(os.path.join(out, "weight_layout_projections.json"), "w") as f:
            json.dump(result, f, indent=1)


def transposed_call(self, x: jax.Array) -> jax.Array:
    """`Linear.__call__` over a weight stored [N, K]: a row reduction per token at one token, else an einsum."""
    w = self.weight[...]
    if x.shape[0] == 1:
        y = row_products(x, w).astype(F32)
    else:
        y = jnp.einsum("TK,NK->TN", x, w, preferred_element_type=F32, precision=llama.dot_precision(x.dtype))
    if self.bias is not None:
        y = y + self.bias[...]
    return y.astype(x.dtype)


def model(batches: list[int], prompt: int, out: str) -> None:
    device = jax.devices()[0].device_kind
    print(f"# {device}", flush=True)
    config = llama3_8b(32)
    model_def, params = random_model(config)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(model_def.state(params))[0]]
    linear = [i for i, (p, a) in enumerate(zip(paths, params)) if a.ndim == 2 and "embed" not in p]
    params_t = list(params)
    for i in linear:  # [K, N] -> [N, K], one at a time (the 8B weights twice would not fit with their copies)
        params_t[i] = jnp.asarray(params[i].T.copy())
    result = {"device": device, "linear_weights": len(linear), "rows": []}
    cases = [(f"decode B={b}", base_decode(config, b, 1024, 512, False)) for b in batches]
    for name, (cache, call) in cases + ([(f"prefill 1 x {prompt}", prefill(config, 1, prompt))] if prompt else []):
        options = StepOptions(16, "auto")
        variant = copy.copy(model_def)  # a jit cache key of its own
        with mock.patch.object(llama.Linear, "__call__", transposed_call):
            logits_t, cache = forward(variant, params_t, call, cache, None, options)
        logits, cache = forward(model_def, params, call, cache, None, options)
        runs = {"[K, N] dot": lambda c: forward(model_def, params, call, c, None, options),
                "[N, K]": lambda c: forward(variant, params_t, call, c, None, options)}
        got, cache = count_and_time(runs, cache)
        ms = got["ms"]
        row = dict(case=name, ms=ms, kernels=got["kernels"], ratio=ms["[N, K]"] / ms["[K, N] dot"],
                   logits_max_abs_diff=float(jnp.abs(logits - logits_t).max()),
                   logits_max_abs=float(jnp.abs(logits).max()))
        result["rows"].append(row)
        print(f"{name:16s}: [K, N] dot {ms['[K, N] dot']:.3f} ms, [N, K] {ms['[N, K]']:.3f} ms "
              f"({row['ratio']:.3f}x); kernels {got['kernels']}; logits max |diff| {row['logits_max_abs_diff']:.3g} "
              f"of {row['logits_max_abs']:.3g}", flush=True)
        with open(os.path.join(out, "weight_layout.json"), "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--projections", action="store_true", help="the projections alone (else the model)")
    parser.add_argument("--batches", default="1,8,32", help="the model's base decode batch sizes")
    parser.add_argument("--prefill", type=int, default=512, help="the prefill's prompt tokens (0: none)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.projections:
        projections(args.out)
    else:
        model([int(b) for b in filter(None, args.batches.split(","))], args.prefill, args.out)


if __name__ == "__main__":
    main()
