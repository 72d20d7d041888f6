"""XLA's GEMM against Pallas small-M GEMMs on the 8B decode step's projections (#39: where the base step loses
against its weight floor, the q|k|v and o GEMMs ran at 2.9 TB/s at batch 1).

For each projection [K, N] of a Llama-3-8B layer (q|k|v 4096 x 6144, o 4096 x 4096, gate|up 4096 x 28672, down
14336 x 4096) and M = 1, 8 and 32 rows of bf16 activations: device time per call of `x @ w` under XLA, and of
each Pallas kernel below at its best tiling, over 32 calls with distinct weights and activations (so that L2
holds no weight and XLA merges no two calls), with the weight bytes over that time against the copy bandwidth
measured in the same run. The Pallas kernels:
- `triton` (Pallas on Triton): program (n, s) computes a [16, BN] f32 block of the rows (padded to 16, Triton's
  smallest dot) over K split s of `splits`, BK columns at a time;
- `mosaic` (Pallas on Mosaic GPU, Hopper only): the same split, each program streaming its [BK, BN] weight tiles
  and the rows' [64, BK] tiles (padded to 64, wgmma's M) through shared memory by TMA, `steps` tiles in flight,
  into a wgmma accumulator in registers (each tiling compiles 32 kernels: 24 tilings of one shape took 9 minutes
  on an H200);
- `streamk` (Pallas on Triton, persistent): a fixed grid of one or two programs per SM, each taking an equal
  share of the [N / BN column blocks x K / BK steps] iterations in order, so no wave is left part-full; a program
  writes an f32 [Mp, BN] partial (Mp: the rows padded to a multiple of 16) for each column block its share
  touches (at most `segments`).
- `residual` (`--residual`): `jlora.pallas.matmul_add`, the decode step's o and down projections as the model
  rounds them, `r + bf16(x @ w)` with the residual r [M, N], in one kernel with K unsplit: program n computes its
  [Mp, BN] block over all of K (`num_stages` weight tiles in flight) and adds its block of r, where XLA runs a
  split-K GEMM and sums the splits with the add in a second kernel (`xla` is then that pair, both kernels counted).
For `--residual` each row also records `span`: µs a call from the first kernel's start to the last one's end, the
gaps between kernels counted (XLA's pair has one a call).
XLA then sums the splits (counted in their time), the stream-K partials in program order through a static gather.
`read` times the faster of XLA's two sums of the weight (over either axis), a plain read of its bytes: the floor a
GEMM of that size could reach, where the copy bandwidth is measured over 512 MiB arrays. Every tiling's output is
checked against a float32 `jnp.dot` (‖out − ref‖ / ‖ref‖ < 1e-2) before it is timed. JSON: small_gemm.json
(small_gemm_mosaic.json for `--kernels mosaic`, small_gemm_streamk.json for `--kernels streamk`, and so on).

  python bench/studies/small_gemm.py [--shapes qkv,o,gate_up,down] [--rows 1,8,32] [--kernels triton,mosaic,streamk]
                                     [--out bench/results]         # GPU (mosaic: Hopper)
  python bench/studies/small_gemm.py --shapes kv_b32 --kernels ''  # the attention's bytes, read only
  python bench/studies/small_gemm.py --kernels streamk --rows 8,32 # the persistent kernel alone
  python bench/studies/small_gemm.py --residual --shapes o,down --rows 8,32,64 --kernels residual
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
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import copy_bandwidth, gpu_facts, trace_events  # noqa: E402
from kernels import CALLS, device_time_per_call  # noqa: E402

from jlora.pallas.config import num_sms  # noqa: E402
from jlora.pallas.projections import matmul_add  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "kv_b32": (8192, 4096)}
READ_ONLY = {"kv_b32"}  # the batch-32 step's K and V caches at context 512 (67 MB), the attention's bytes: read only
ROWS = (1, 8, 32)
WEIGHTS = CALLS  # distinct weights per shape, one per call: XLA merges dots that share an operand
TILES = {"triton": [dict(block_n=bn, block_k=bk, splits=s, num_warps=4)
                    for bn, bk, s in itertools.product((64, 128), (64, 128), (1, 2, 4, 8))],
         "mosaic": [dict(block_n=bn, block_k=bk, splits=s, steps=st)
                    for bn, bk, s, st in itertools.product((64, 128, 256), (64, 128), (1, 2, 4, 8), (4,))],
         "streamk": [dict(block_n=bn, block_k=bk, waves=w, num_stages=st, num_warps=nw)
                     for bn, bk, w, st, nw in itertools.product((64, 128), (64, 128), (1, 2), (3, 4, 5), (4, 8))],
         "residual": [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=4)
                      for bn, bk, st in itertools.product((16, 32, 64), (128, 256, 512), (3, 4, 5))]}
SMOKE_TILES = {"triton": [dict(block_n=64, block_k=64, splits=2, num_warps=4),
                          dict(block_n=128, block_k=64, splits=1, num_warps=4)],
               "mosaic": [dict(block_n=64, block_k=64, splits=2, steps=2), dict(block_n=128, block_k=64, splits=1,
                                                                                steps=4)],
               "streamk": [dict(block_n=64, block_k=64, waves=1, num_stages=3, num_warps=4, programs=3),
                           dict(block_n=128, block_k=64, waves=1, num_stages=3, num_warps=4, programs=5)],
               "residual": [dict(block_n=16, block_k=64, num_stages=3, num_warps=4),
                            dict(block_n=32, block_k=128, num_stages=3, num_warps=4)]}
MOSAIC_ROWS = 64  # wgmma's M: the rows are padded to it


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


def check_tiling(k_dim: int, n_dim: int, *, block_n: int, block_k: int, splits: int = 1, **_) -> None:
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


def mosaic_matmul(x: jax.Array, w: jax.Array, *, block_n: int, block_k: int, splits: int, steps: int):
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype on Mosaic GPU (M <= 64): program (n, s) pipelines K split s of
    its [K, BN] weight columns through shared memory, BK rows a tile, `steps` tiles in flight."""
    m, k_dim = x.shape
    n_dim = w.shape[1]
    if m > MOSAIC_ROWS:
        raise ValueError(f"the Mosaic GPU kernel takes at most {MOSAIC_ROWS} rows (wgmma's M), got {m}")
    check_tiling(k_dim, n_dim, block_n=block_n, block_k=block_k, splits=splits)
    xp = jnp.pad(x, ((0, MOSAIC_ROWS - m), (0, 0)))
    k_steps = k_dim // splits // block_k
    swizzle = 128  # bytes: the widest swizzle, 64 bf16 a row of a tile
    transforms = (plgpu.TilingTransform((8, swizzle // x.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))

    def accumulate(x_gmem, w_gmem, o_gmem, o_smem, acc):
        n, s = jax.lax.axis_index("n"), jax.lax.axis_index("s")

        def step(_, x_smem, w_smem):
            plgpu.wgmma(acc, x_smem, w_smem)
            plgpu.wgmma_wait(1)  # one wgmma in flight: delay_release keeps its tiles until the next step's wait

        plgpu.emit_pipeline(
            step, grid=(k_steps,), max_concurrent_steps=steps,
            in_specs=[plgpu.BlockSpec((MOSAIC_ROWS, block_k), lambda k: (0, s * k_steps + k), transforms=transforms,
                                      delay_release=1),
                      plgpu.BlockSpec((block_k, block_n), lambda k: (s * k_steps + k, n), transforms=transforms,
                                      delay_release=1)],
        )(x_gmem, w_gmem)
        plgpu.wgmma_wait(0)
        o_smem[...] = acc[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, :, pl.ds(n * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    def kernel(x_gmem, w_gmem, o_gmem, o_smem):
        # the accumulator in a scope of its own: the interpreter takes register and shared scopes apart
        pl.run_scoped(functools.partial(accumulate, x_gmem, w_gmem, o_gmem, o_smem),
                      plgpu.ACC((MOSAIC_ROWS, block_n), jnp.float32))

    partials = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, MOSAIC_ROWS, n_dim), jnp.float32),
        scratch_types=[plgpu.SMEM((MOSAIC_ROWS, block_n), jnp.float32)],
        grid=(n_dim // block_n, splits), grid_names=("n", "s"),
        interpret=plgpu.InterpretGPUParams() if jax.default_backend() != "gpu" else False,
    )(xp, w)
    return partials.sum(0)[:m].astype(x.dtype)


def stream_shares(tiles: int, steps: int, programs: int) -> np.ndarray:
    """[programs, segments] the column block of each program's segments (-1: none): program p takes iterations
    [p·I / P, (p+1)·I / P) of the I = tiles x steps, column block by column block."""
    total = tiles * steps
    starts = [p * total // programs for p in range(programs + 1)]
    blocks = [list(range(lo // steps, -(-hi // steps))) for lo, hi in zip(starts, starts[1:])]
    segments = max(len(b) for b in blocks)
    return np.array([b + [-1] * (segments - len(b)) for b in blocks], np.int32)


def _stream_kernel(x_ref, w_ref, o_ref, *, block_n: int, block_k: int, steps: int, total: int, programs: int,
                   segments: int):
    # o_ref: [programs, segments, Mp, BN] partials; program p's share of the iterations, column block by block
    p = pl.program_id(0)
    lo, hi = p * total // programs, (p + 1) * total // programs
    for seg in range(segments):
        tile = lo // steps + seg
        cols = pl.ds(pl.multiple_of(tile * block_n, block_n), block_n)

        def step(i, acc, cols=cols, tile=tile):
            k = pl.ds(pl.multiple_of((i - tile * steps) * block_k, block_k), block_k)
            return acc + pltriton.dot(x_ref[:, k], w_ref[k, cols])

        first, last = jnp.maximum(lo, tile * steps), jnp.minimum(hi, (tile + 1) * steps)
        o_ref[p, seg] = jax.lax.fori_loop(first, jnp.maximum(first, last), step,
                                          jnp.zeros((x_ref.shape[0], block_n), jnp.float32))


def stream_matmul(x: jax.Array, w: jax.Array, *, block_n: int, block_k: int, waves: int, num_stages: int,
                  num_warps: int, programs: int | None = None):
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype: `programs` (default `waves` per SM) persistent programs share
    the column blocks' K steps equally (`stream_shares`); their partials summed per block in program order."""
    m, k_dim = x.shape
    n_dim = w.shape[1]
    check_tiling(k_dim, n_dim, block_n=block_n, block_k=block_k)
    tiles, steps = n_dim // block_n, k_dim // block_k
    programs = programs or waves * num_sms()
    shares = stream_shares(tiles, steps, programs)
    segments = shares.shape[1]
    mp = -(-m // 16) * 16
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    kernel = functools.partial(_stream_kernel, block_n=block_n, block_k=block_k, steps=steps, total=tiles * steps,
                               programs=programs, segments=segments)
    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((programs, segments, mp, block_n), jnp.float32),
        grid=(programs,),
        in_specs=[pl.BlockSpec((mp, k_dim), lambda p: (0, 0)), pl.BlockSpec((k_dim, n_dim), lambda p: (0, 0))],
        out_specs=pl.BlockSpec((programs, segments, mp, block_n), lambda p: (0, 0, 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=jax.default_backend() != "gpu",
        name=f"stream_gemm_{k_dim}x{n_dim}",
    )(xp, w)
    # Each column block's partials in program order, padded with an all-zero partial: a static gather and a sum.
    flat = jnp.concatenate([partials.reshape(programs * segments, mp, block_n),
                            jnp.zeros((1, mp, block_n), jnp.float32)])
    owners = [np.flatnonzero(shares.reshape(-1) == t) for t in range(tiles)]
    width = max(len(o) for o in owners)
    index = np.array([list(o) + [programs * segments] * (width - len(o)) for o in owners], np.int32)
    blocks = flat[index].sum(1)  # [tiles, Mp, BN]
    return blocks.transpose(1, 0, 2).reshape(mp, n_dim)[:m].astype(x.dtype)


def residual_matmul(x: jax.Array, w: jax.Array, residual: jax.Array, *, block_n: int, block_k: int,
                    num_stages: int, num_warps: int):
    """`jlora.pallas.matmul_add` (residual + x @ w, K unsplit) at this tiling; its programs run 4 warps."""
    assert num_warps == 4
    return matmul_add(x, w, residual, tiling=(block_n, block_k, num_stages))


def xla_residual(x: jax.Array, w: jax.Array, residual: jax.Array) -> jax.Array:
    """What the model's XLA step computes: the projection rounded, then the residual add."""
    return residual + jnp.dot(x, w)


MATMULS = {"triton": pallas_matmul, "mosaic": mosaic_matmul, "streamk": stream_matmul}
RESIDUAL = {"residual": residual_matmul}


def relative_error(out, x, w, residual=None) -> float:
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if residual is not None:
        ref = ref + residual.astype(jnp.float32)
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes and two tilings (interpret mode on CPU)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="projections to time")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows of activations, M")
    parser.add_argument("--kernels", default=",".join(MATMULS),
                        help="Pallas kernels to time: triton, mosaic, streamk (none: the reads and XLA alone)")
    parser.add_argument("--residual", action="store_true",
                        help="time r + x @ w (the o and down projections' residual add): XLA's pair of kernels "
                             "against the `residual` kernel")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    kernels = [k for k in args.kernels.split(",") if k]
    matmuls = RESIDUAL if args.residual else MATMULS
    if args.residual and "--kernels" not in sys.argv:
        kernels = list(RESIDUAL)
    if unknown := [k for k in kernels if k not in matmuls]:
        parser.error(f"--kernels {unknown} not among {list(matmuls)}" + (" with --residual" if args.residual else ""))
    rows, tiles, weights = tuple(int(m) for m in args.rows.split(",")), TILES, WEIGHTS
    if args.smoke:
        shapes, rows, weights, tiles = {"o": (256, 128)}, (1, 8), 2, SMOKE_TILES
    gpu = jax.default_backend() == "gpu"
    bandwidth = copy_bandwidth() if gpu else None
    device = jax.devices()[0].device_kind
    print(f"# {device}" + (f": copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""), flush=True)
    result = {"device": device, "gpu": gpu_facts(), "copy_bandwidth_Bps": bandwidth, "rows": []}
    key = jax.random.key(0)
    for (name, (k_dim, n_dim)), m in itertools.product(shapes.items(), rows):
        read_only = name in READ_ONLY
        if read_only and m != rows[0]:
            continue
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k_dim, n_dim), jnp.bfloat16) * 0.02
              for i in range(weights)]
        # One activation and one weight per call: XLA merged repeated products, and dots that share an operand.
        xs = [jax.random.normal(jax.random.fold_in(key, 99 + i), (m, k_dim), jnp.bfloat16) for i in range(CALLS)]
        # The residual of each call: [M, N] of its own (--residual).
        rs = [jax.random.normal(jax.random.fold_in(key, 199 + i), (m, n_dim), jnp.bfloat16)
              for i in range(CALLS)] if args.residual else [None] * CALLS
        x, r = xs[0], rs[0]
        extra = (r,) if args.residual else ()
        nbytes = k_dim * n_dim * 2

        def timed(matmul, residual: bool = args.residual):
            if residual:
                fn = jax.jit(lambda xs, ws, rs: [matmul(x, ws[i % len(ws)], rs[i]) for i, x in enumerate(xs)])
                return device_time_per_call(fn, xs, ws, rs)[0] if gpu else None
            fn = jax.jit(lambda xs, ws: [matmul(x, ws[i % len(ws)]) for i, x in enumerate(xs)])
            return device_time_per_call(fn, xs, ws)[0] if gpu else None

        def span(matmul) -> float:
            """--residual: µs a call from the first kernel's start to the last one's end, the gaps between the
            kernels counted (XLA's pair has one a call)."""
            fn = jax.jit(lambda xs, ws, rs: [matmul(x, ws[i % len(ws)], rs[i]) for i, x in enumerate(xs)])
            jax.block_until_ready(fn(xs, ws, rs))
            events = trace_events(lambda: fn(xs, ws, rs))
            return (max(t + d for _, t, d, _, _ in events) - min(t for _, t, _, _, _ in events)) / CALLS

        row = {"shape": name, "k": k_dim, "n": n_dim, "m": m, "weight_bytes": nbytes}
        if m == rows[0]:  # the plain read, once a shape
            reads = [timed(lambda x, w, axis=axis: jnp.sum(w, axis=axis, dtype=jnp.float32), False)
                     for axis in (0, 1)]
            row["read_us"] = min(reads) * 1e6 if gpu else None
        if not read_only:
            row["xla_us"] = (t := timed(xla_residual if args.residual else jnp.dot)) and t * 1e6
        for kernel in () if read_only else kernels:
            best = None
            for tile in tiles[kernel]:
                try:
                    check_tiling(k_dim, n_dim, **tile)
                except ValueError:  # a tiling that does not divide this shape
                    continue
                matmul = functools.partial(matmuls[kernel], **tile)
                try:
                    error = relative_error(jax.jit(matmul)(x, ws[0], *extra), x, ws[0], r)
                except Exception as err:  # a tiling the backend cannot lower: noted, not timed
                    if args.smoke:
                        raise
                    print(f"  {name} M={m} {kernel} {tile}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                    continue
                if error >= 1e-2:
                    raise AssertionError(f"{name} M={m} {kernel} {tile}: relative error {error:.3g}")
                t = timed(matmul)
                if t is not None and (best is None or t < best[0]):
                    best = (t, tile)
                if args.smoke:
                    print(f"  {name} M={m} {kernel} {tile}: relative error {error:.2e}", flush=True)
            if best is not None:
                row[f"{kernel}_us"], row[f"{kernel}_tile"] = best[0] * 1e6, best[1]
        if args.residual and gpu:
            row["xla_span_us"] = span(xla_residual)
            for kernel in kernels:
                if f"{kernel}_tile" in row:
                    row[f"{kernel}_span_us"] = span(functools.partial(matmuls[kernel], **row[f"{kernel}_tile"]))
        for way in ("read", "xla", *kernels):
            if row.get(f"{way}_us"):
                row[f"{way}_TBps"] = nbytes / row[f"{way}_us"] / 1e6
                row[f"{way}_vs_copy"] = row[f"{way}_TBps"] * 1e12 / bandwidth
        result["rows"].append(row)
        if gpu:
            print(f"{name:8s} M={m:2d}: " + " | ".join(
                f"{way} {row[f'{way}_us']:6.1f} µs {row[f'{way}_TBps']:.2f} TB/s"
                + (f" (span {row[f'{way}_span_us']:.1f})" if f"{way}_span_us" in row else "")
                + f" {row.get(f'{way}_tile', '')}"
                for way in ("read", "xla", *kernels) if row.get(f"{way}_us")), flush=True)
        os.makedirs(args.out, exist_ok=True)
        stem = "small_gemm" + ("_smoke" if args.smoke else "") + (
            "" if set(kernels) == set(matmuls) and not args.residual else "_" + ("_".join(kernels) or "read"))
        with open(os.path.join(args.out, stem + ".json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
