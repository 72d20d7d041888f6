"""The LoRA expand in the epilogue of the base projection's GEMM (#39's list of ideas), against XLA's GEMM with
jlora's decode expand (the gather backend) after it.

For the o [4096, 4096] and down [14336, 4096] projections of a Llama-3-8B layer (`--shapes` also takes q|k|v
and gate|up, each as one output slice) at M = 1, 8 and 32 rows of bf16 activations, every row on one r=16
adapter (`--adapters 1`) or each on its own slot of 32: device time per call of
- `xla`: the base GEMM alone, XLA's;
- `xla_gather`: XLA's GEMM, then `jlora.lora_expand(..., backend="gather")` adding each row's delta s @ Bᵀ
  (rounded to bf16 as PEFT adds it);
- `fused`: a Pallas GEMM (small_gemm.py's: program (n, k) takes a [Mp, BN] block over K split k) whose K-split-0
  programs also compute their columns' delta, each row's s [R] against its slot's B rows [BN, R], as a second
  output; XLA then sums the splits, rounds, and adds the delta rounded to bf16, in the split-K reduction it runs
  anyway. Its tilings: small_gemm.json's best for the shape and M, or all of small_gemm's with `--all-tiles`.
Over 32 calls with distinct weights, activations and B stacks (small_gemm.py's method: L2 holds no weight).
Every output is checked against a float32 reference (‖out − ref‖ / ‖ref‖ < 1e-2) before it is timed.
JSON: epilogue_expand.json.

  python bench/studies/epilogue_expand.py [--shapes o,down] [--rows 1,8,32] [--adapters 1,32] [--all-tiles]
  python bench/studies/epilogue_expand.py --smoke        # CPU, interpret mode, small shapes
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth  # noqa: E402
from kernels import CALLS, device_time_per_call  # noqa: E402
from small_gemm import SHAPES, SMOKE_TILES, TILES, check_tiling, split_k_block  # noqa: E402

import jlora  # noqa: E402
from jlora.batch_info import LoRABatchInfo  # noqa: E402

RANK, SLOTS = 16, 32


def _kernel(x_ref, w_ref, s_ref, slot_ref, b_ref, o_ref, d_ref, *, block_k: int, k_per_split: int):
    # Program (n, k): small_gemm.py's block of the partials; split 0 also writes the block's delta.
    block_n, mp = o_ref.shape[-1], x_ref.shape[0]
    o_ref[0], cols = split_k_block(x_ref, w_ref, block_n=block_n, block_k=block_k, k_per_split=k_per_split)

    @pl.when(pl.program_id(1) == 0)
    def _():
        rows = jnp.arange(mp)[:, None]  # [Mp, 1]

        def row(m, delta):  # row m's s [1, R] against its slot's B [BN, R]
            b = b_ref[slot_ref[m], cols, :].astype(jnp.float32)
            d = jnp.sum(b * s_ref[pl.ds(m, 1), :].astype(jnp.float32), axis=1)  # [BN]
            return delta + jnp.where(rows == m, d[None, :], 0.0)

        d_ref[...] = jax.lax.fori_loop(0, mp, row, jnp.zeros((mp, block_n), jnp.float32))


def fused(x, w, s, slots, b, *, block_n: int, block_k: int, splits: int, num_warps: int):
    """x [M, K] @ w [K, N] plus row m's s [M, R] @ b[slots[m]] [N, R]ᵀ (slot -1: none), bf16 as PEFT rounds; x, w,
    s and b bf16."""
    m, k_dim = x.shape
    n_dim = w.shape[1]
    check_tiling(k_dim, n_dim, block_n=block_n, block_k=block_k, splits=splits)
    mp = -(-m // 16) * 16
    pad = ((0, mp - m), (0, 0))
    s = jnp.pad(jnp.where((slots >= 0)[:, None], s, jnp.zeros_like(s)), pad)  # padding and base rows: none
    slots = jnp.pad(jnp.maximum(slots, 0), (0, mp - m))
    full = lambda shape: pl.BlockSpec(shape, lambda n, k: (0,) * len(shape))  # noqa: E731
    partials, delta = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, k_per_split=k_dim // splits),
        out_shape=(jax.ShapeDtypeStruct((splits, mp, n_dim), jnp.float32),
                   jax.ShapeDtypeStruct((mp, n_dim), jnp.float32)),
        grid=(n_dim // block_n, splits),
        in_specs=[full((mp, k_dim)), full((k_dim, n_dim)), full((mp, RANK)), full((mp,)), full(b.shape)],
        out_specs=(pl.BlockSpec((1, mp, block_n), lambda n, k: (k, 0, n)),
                   pl.BlockSpec((mp, block_n), lambda n, k: (0, n))),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=jax.default_backend() != "gpu",
        name=f"epilogue_expand_{k_dim}x{n_dim}",
    )(jnp.pad(x, pad), w, s, slots, b)
    base = partials.sum(0)[:m].astype(x.dtype)
    return (base.astype(jnp.float32) + delta[:m].astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def xla_gather(x, w, s, slots, b):
    """XLA's GEMM, then jlora's gather-backend expand."""
    info = LoRABatchInfo.build(slots, jnp.full(SLOTS, RANK), jnp.ones(SLOTS))
    return jlora.lora_expand(s, b, info, jnp.dot(x, w), slice_sizes=(w.shape[1],), backend="gather")


def reference(x, w, s, slots, b) -> np.ndarray:
    x, w, s, b = (np.asarray(a, np.float32) for a in (x, w, s, b))
    slots = np.asarray(slots)
    delta = np.einsum("mr,mnr->mn", s, b[np.maximum(slots, 0)]) * (slots >= 0)[:, None]
    return x @ w + delta


def relative_error(out, ref) -> float:
    out = np.asarray(out, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes and two tilings (interpret mode on CPU)")
    parser.add_argument("--shapes", default="o,down", help="projections to time")
    parser.add_argument("--rows", default="1,8,32", help="rows of activations, M")
    parser.add_argument("--adapters", default="1,32", help="1: every row on one adapter; else each row its own")
    parser.add_argument("--all-tiles", action="store_true", help="every small_gemm.py tiling, not only its best")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    rows = tuple(int(m) for m in args.rows.split(","))
    calls, best_tiles = CALLS, {}
    if args.smoke:
        shapes, rows, calls = {"o": (256, 128)}, (1, 8), 2
        tiles = SMOKE_TILES["triton"]
    elif args.all_tiles:
        tiles = TILES["triton"]
    else:
        with open(os.path.join(os.path.dirname(__file__), "..", "results", "small_gemm.json")) as f:
            best_tiles = {(r["shape"], r["m"]): r["triton_tile"] for r in json.load(f)["rows"]}
    gpu = jax.default_backend() == "gpu"
    bandwidth = copy_bandwidth() if gpu else None
    device = jax.devices()[0].device_kind
    print(f"# {device}" + (f": copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""), flush=True)
    result = {"device": device, "copy_bandwidth_Bps": bandwidth, "rank": RANK, "slots": SLOTS, "rows": []}
    key = jax.random.key(0)
    rnd = lambda i, shape, scale: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * scale  # noqa: E731
    for (name, (k_dim, n_dim)), m, adapters in itertools.product(
            shapes.items(), rows, (int(a) for a in args.adapters.split(","))):
        ws = [rnd(i, (k_dim, n_dim), 0.02).astype(jnp.bfloat16) for i in range(calls)]
        xs = [rnd(100 + i, (m, k_dim), 1.0).astype(jnp.bfloat16) for i in range(calls)]
        bs = [rnd(200 + i, (SLOTS, n_dim, RANK), 0.05).astype(jnp.bfloat16) for i in range(calls)]
        ss = [rnd(300 + i, (m, RANK), 1.0).astype(jnp.bfloat16) for i in range(calls)]
        slots = jnp.asarray(np.arange(m) % SLOTS if adapters > 1 else np.full(m, 5), jnp.int32)
        ref = reference(xs[0], ws[0], ss[0], slots, bs[0])

        def timed(op):
            fn = jax.jit(lambda xs, ws, ss, bs: [op(x, ws[i], ss[i], slots, bs[i]) for i, x in enumerate(xs)])
            return device_time_per_call(fn, xs, ws, ss, bs)[0] * 1e6 if gpu else None

        row = {"shape": name, "k": k_dim, "n": n_dim, "m": m, "adapters": min(adapters, m)}
        for way, op in (("xla", lambda x, w, s, slots, b: jnp.dot(x, w)), ("xla_gather", xla_gather)):
            if way == "xla_gather" and (error := relative_error(jax.jit(op)(xs[0], ws[0], ss[0], slots, bs[0]),
                                                                ref)) >= 1e-2:
                raise AssertionError(f"{name} M={m} {way}: relative error {error:.3g}")
            row[f"{way}_us"] = timed(op)
        best = None
        for tile in tiles if not best_tiles else [best_tiles[name, m]]:
            if n_dim % tile["block_n"] or k_dim % (tile["splits"] * tile["block_k"]):
                continue
            op = functools.partial(fused, **tile)
            try:
                error = relative_error(jax.jit(op)(xs[0], ws[0], ss[0], slots, bs[0]), ref)
            except Exception as err:  # a tiling Triton cannot lower: noted, not timed
                print(f"  {name} M={m} {tile}: {type(err).__name__}: {str(err)[:160]}", flush=True)
                continue
            if error >= 1e-2:
                raise AssertionError(f"{name} M={m} {tile}: relative error {error:.3g}")
            if args.smoke:
                print(f"  {name} M={m} adapters {adapters} {tile}: relative error {error:.2e}", flush=True)
            t = timed(op)
            if t is not None and (best is None or t < best[0]):
                best = (t, tile)
        if best is not None:
            row["fused_us"], row["fused_tile"] = best
        result["rows"].append(row)
        if gpu:
            print(f"{name:8s} M={m:2d} adapters {row['adapters']:2d}: XLA {row['xla_us']:6.1f} µs, + gather expand "
                  f"{row['xla_gather_us']:6.1f}, fused " + (f"{best[0]:6.1f} {best[1]}" if best else "-"), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "epilogue_expand_smoke.json" if args.smoke else "epilogue_expand.json"),
                  "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
