"""XLA's GEMM against a Pallas small-M GEMM on the 8B decode step's projections (#39: where the base step loses
against its weight floor, the q|k|v and o GEMMs ran at 2.9 TB/s at batch 1).

For each projection [K, N] of a Llama-3-8B layer (q|k|v 4096 x 6144, o 4096 x 4096, gate|up 4096 x 28672, down
14336 x 4096) and M = 1, 8 and 32 rows of bf16 activations: device time per call of `x @ w` under XLA, and of a
Pallas (Triton) kernel for every tiling below, over 32 calls with distinct weights and activations (so that L2
holds no weight and XLA merges no two calls), with the weight bytes over that time against the copy bandwidth
measured in the same run. The Pallas kernel: program
(n, s) computes a [16, BN] f32 block of the rows (padded to 16, Triton's smallest dot) over K split s of
`splits`, BK columns at a time; XLA then sums the splits (counted in its time). Every tiling's output is checked
against a float32 `jnp.dot` (‖out − ref‖ / ‖ref‖ < 1e-2) before it is timed. JSON: small_gemm.json.

  python bench/studies/small_gemm.py [--shapes qkv,o,gate_up,down] [--rows 1,8,32] [--out bench/results]  # GPU
  python bench/studies/small_gemm.py --smoke                       # CPU, interpret mode, small shapes
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
from common import copy_bandwidth  # noqa: E402
from kernels import CALLS, device_time_per_call  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = (1, 8, 32)
WEIGHTS = CALLS  # distinct weights per shape, one per call: XLA merges dots that share an operand
TILES = [dict(block_n=bn, block_k=bk, splits=s, num_warps=4)
         for bn, bk, s in itertools.product((64, 128), (64, 128), (1, 2, 4, 8))]


def split_k_block(x_ref, w_ref, *, block_n: int, block_k: int, k_per_split: int):
    """Program (n, s)'s [Mp, BN] f32 block of x @ w: column block n over K split s, and the block's columns."""
    n, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(n * block_n, block_n), block_n)

    def step(j, acc):
        k = pl.ds(pl.multiple_of(s * k_per_split + j * block_k, block_k), block_k)
        return acc + pltriton.dot(x_ref[:, k], w_ref[k, cols])

    return jax.lax.fori_loop(0, k_per_split // block_k, step,
                             jnp.zeros((x_ref.shape[0], block_n), jnp.float32)), cols


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, k_per_split: int):
    # o_ref: this program's [1, Mp, BN] block of the [splits, Mp, N] partials
    o_ref[0], _ = split_k_block(x_ref, w_ref, block_n=o_ref.shape[-1], block_k=block_k, k_per_split=k_per_split)


def check_tiling(k_dim: int, n_dim: int, *, block_n: int, block_k: int, splits: int, **_) -> None:
    """Raises ValueError unless the tiling divides [K, N]."""
    if n_dim % block_n or k_dim % (splits * block_k):
        raise ValueError(f"N {n_dim} and K {k_dim} must divide by block_n {block_n} and splits x block_k "
                         f"{splits} x {block_k}")


def pallas_matmul(x: jax.Array, w: jax.Array, *, block_n: int, block_k: int, splits: int, num_warps: int):
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype, rows padded to a multiple of 16."""
    m, k_dim = x.shape
    n_dim = w.shape[1]
    check_tiling(k_dim, n_dim, block_n=block_n, block_k=block_k, splits=splits)
    mp = -(-m // 16) * 16
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    kernel = functools.partial(_kernel, block_k=block_k, k_per_split=k_dim // splits)
    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, mp, n_dim), jnp.float32),
        grid=(n_dim // block_n, splits),
        in_specs=[pl.BlockSpec((mp, k_dim), lambda n, s: (0, 0)), pl.BlockSpec((k_dim, n_dim), lambda n, s: (0, 0))],
        out_specs=pl.BlockSpec((1, mp, block_n), lambda n, s: (s, 0, n)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=jax.default_backend() != "gpu",
        name=f"small_gemm_{k_dim}x{n_dim}",
    )(xp, w)
    return partials.sum(0)[:m].astype(x.dtype)


def relative_error(out, x, w) -> float:
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes and two tilings (interpret mode on CPU)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="projections to time")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows of activations, M")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    rows, tiles, weights = tuple(int(m) for m in args.rows.split(",")), TILES, WEIGHTS
    if args.smoke:
        shapes, rows, weights = {"o": (256, 128)}, (1, 8), 2
        tiles = [dict(block_n=64, block_k=64, splits=2, num_warps=4), dict(block_n=128, block_k=64, splits=1,
                                                                           num_warps=4)]
    gpu = jax.default_backend() == "gpu"
    bandwidth = copy_bandwidth() if gpu else None
    device = jax.devices()[0].device_kind
    print(f"# {device}" + (f": copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""), flush=True)
    result = {"device": device, "copy_bandwidth_Bps": bandwidth, "rows": []}
    key = jax.random.key(0)
    for (name, (k_dim, n_dim)), m in itertools.product(shapes.items(), rows):
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k_dim, n_dim), jnp.bfloat16) * 0.02
              for i in range(weights)]
        # One activation and one weight per call: XLA merged repeated products, and dots that share an operand.
        xs = [jax.random.normal(jax.random.fold_in(key, 99 + i), (m, k_dim), jnp.bfloat16) for i in range(CALLS)]
        x = xs[0]
        nbytes = k_dim * n_dim * 2

        def timed(matmul):
            fn = jax.jit(lambda xs, ws: [matmul(x, ws[i % len(ws)]) for i, x in enumerate(xs)])
            return device_time_per_call(fn, xs, ws)[0] if gpu else None

        row = {"shape": name, "k": k_dim, "n": n_dim, "m": m, "weight_bytes": nbytes}
        row["xla_us"] = (t := timed(jnp.dot)) and t * 1e6
        best = None
        for tile in tiles:
            if n_dim % tile["block_n"] or k_dim % (tile["splits"] * tile["block_k"]):
                continue
            matmul = functools.partial(pallas_matmul, **tile)
            try:
                error = relative_error(jax.jit(matmul)(x, ws[0]), x, ws[0])
            except Exception as err:  # a tiling Triton cannot lower: noted, not timed
                print(f"  {name} M={m} {tile}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                continue
            if error >= 1e-2:
                raise AssertionError(f"{name} M={m} {tile}: relative error {error:.3g}")
            t = timed(matmul)
            if t is not None and (best is None or t < best[0]):
                best = (t, tile)
            if args.smoke:
                print(f"  {name} M={m} {tile}: relative error {error:.2e}", flush=True)
        if best is not None:
            row["pallas_us"], row["pallas_tile"] = best[0] * 1e6, best[1]
        for way in ("xla", "pallas"):
            if row.get(f"{way}_us"):
                row[f"{way}_TBps"] = nbytes / row[f"{way}_us"] / 1e6
                row[f"{way}_vs_copy"] = row[f"{way}_TBps"] * 1e12 / bandwidth
        result["rows"].append(row)
        if gpu:
            print(f"{name:8s} M={m:2d}: XLA {row['xla_us']:7.1f} µs {row['xla_TBps']:.2f} TB/s | Pallas "
                  + (f"{row['pallas_us']:7.1f} µs {row['pallas_TBps']:.2f} TB/s {row['pallas_tile']}"
                     if best else "-"), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "small_gemm_smoke.json" if args.smoke else "small_gemm.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
