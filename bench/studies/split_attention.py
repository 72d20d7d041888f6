"""Decode attention split over fixed chunks of positions (flash-decoding) against jlora's kernel (#39: the kernel
reads the KV cache at 3.0 TB/s at batch 32 and 0.2 TB/s at batch 1, where it runs one program per request and KV
head: 8 programs on 132 SMs).

The split kernel runs one program per (request, KV head, chunk of `chunk` positions); a program whose chunk lies
past its request's position exits, and XLA combines the chunks' partial softmax sums. Chunks are fixed position
ranges, never a function of the batch, so a request's result does not depend on the requests beside it (the
engine's batch invariance). Every variant's output is checked against jlora's kernel (‖out − ref‖ / ‖ref‖ <
1e-2) before it is timed: device time per layer over 32 layers with distinct caches, and the KV bytes the
requests can see over that time. Cases: 8B-shaped heads (8 KV heads of 4 queries, head_dim 128); batch 1 with
max_seq 1024 at position 512 (`bench/model.py`'s batch-1 decode rows) and 4096 at 4000; batch 8 and 32 with
max_seq 512 at position 511, batch 32 with 4096 at 511 and 4000 (request 0 at position 70 where batch > 1).
Chunkings that leave more than 16 chunks are not run: at 64 chunks XLA's combine alone took 100-140 µs.
JSON: split_attention.json, written after each row.

  python bench/studies/split_attention.py [--batches 1,8,32] [--out bench/results]  # GPU
  python bench/studies/split_attention.py --smoke                 # CPU, interpret mode, one small case
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import trace_kernels  # noqa: E402

from jlora.pallas.common import dot_dim, dot_precision  # noqa: E402
from jlora.pallas.decode_attention import _NEG, _block_t, _heads, decode_attention, online_softmax  # noqa: E402

KV, GROUPS, HEAD_DIM, LAYERS = 8, 4, 128, 32
CASES = [(1, 1024, 512), (1, 4096, 4000), (8, 512, 511), (32, 512, 511), (32, 4096, 511),  # batch, max_seq, pos
         (32, 4096, 4000)]
CHUNKS, STAGES = (64, 128, 256), (1, 2, 3)


def _kernel(pos_ref, rows_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, groups: int, tile: int,
            block_t: int, chunk_blocks: int, **options):
    """Program (b, h, c): request b's KV head h over the key blocks of chunk c up to its position; writes the
    chunk's weighted values, running max and sum of exponentials (f32) to row c of the partials."""
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos, row = pos_ref[b], rows_ref[b]
    heads = _heads(b, h, groups, tile)
    first = c * chunk_blocks
    last = jnp.maximum(jnp.minimum(first + chunk_blocks, pos // block_t + 1), first)

    def load(j):
        t = pl.ds(pl.multiple_of(j * block_t, block_t), block_t)
        return k_ref[row, h, t, :], v_ref[row, h, t, :]

    m, l, acc = online_softmax(q_ref[heads, :], load, pos, first, last, block_t=block_t, window=None, **options)
    acc_ref[c, heads, :] = acc
    m_ref[c, heads] = m[:, 0]
    l_ref[c, heads] = l[:, 0]


def split_attention(q, k, v, positions, rows, *, chunk: int, stages: int) -> jax.Array:
    """q [B, KV, G, D] over caches [R, KV, max_seq, D] as `decode_attention`, in chunks of `chunk` positions."""
    batch, kv, groups, d = q.shape
    max_seq = k.shape[2]
    block_t, chunks = _block_t(chunk), max_seq // chunk
    kernel = functools.partial(_kernel, groups=groups, tile=dot_dim(groups), block_t=block_t,
                               chunk_blocks=chunk // block_t, scale=1 / math.sqrt(d), precision=dot_precision(q.dtype))
    flat = q.reshape(batch * kv * groups, d)
    n = flat.shape[0]
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((chunks, n, d), jnp.float32), jax.ShapeDtypeStruct((chunks, n), jnp.float32),
                   jax.ShapeDtypeStruct((chunks, n), jnp.float32)),
        grid=(batch, kv, chunks),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=stages),
        interpret=jax.default_backend() != "gpu",
        name="split_decode_attention",
    )(positions.astype(jnp.int32), rows.astype(jnp.int32), flat, k, v)
    # Chunks past a request's position never ran: masked, never read as numbers. Summed in chunk order.
    valid = jnp.arange(chunks)[:, None] * chunk <= jnp.repeat(positions, kv * groups)[None, :]
    m = jnp.where(valid, m, _NEG)
    weight = jnp.where(valid, jnp.exp(m - m.max(0)), 0.0)
    num, den = jnp.zeros((n, d), jnp.float32), jnp.zeros((n,), jnp.float32)
    for c in range(chunks):
        num = num + jnp.where(valid[c][:, None], weight[c][:, None] * acc[c], 0.0)
        den = den + jnp.where(valid[c], weight[c] * l[c], 0.0)
    return (num / den[:, None]).astype(q.dtype).reshape(q.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one small case and one variant (interpret mode on CPU)")
    parser.add_argument("--batches", default="1,8,32", help="the cases of these batch sizes")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    batches = {int(b) for b in args.batches.split(",")}
    cases, layers, chunks, stages = [c for c in CASES if c[0] in batches], LAYERS, CHUNKS, STAGES
    if args.smoke:
        cases, layers, chunks, stages = [(2, 128, 100)], 1, (64,), (1,)
    gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0].device_kind
    print(f"# {device}", flush=True)
    result, key = {"device": device, "rows": []}, jax.random.key(0)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "split_attention_smoke.json" if args.smoke else "split_attention.json")

    def save(result: dict) -> None:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    for batch, max_seq, pos in cases:
        shape = (batch, KV, max_seq, HEAD_DIM)
        ks = [jax.random.normal(jax.random.fold_in(key, 2 * i), shape, jnp.bfloat16) for i in range(layers)]
        vs = [jax.random.normal(jax.random.fold_in(key, 2 * i + 1), shape, jnp.bfloat16) for i in range(layers)]
        q = jax.random.normal(jax.random.fold_in(key, 2 * layers), (batch, KV, GROUPS, HEAD_DIM), jnp.bfloat16)
        positions = jnp.full((batch,), pos, jnp.int32).at[0].set(min(pos, 70) if batch > 1 else pos)
        rows = jnp.arange(batch, dtype=jnp.int32)
        ref = decode_attention(q, ks[0], vs[0], positions, rows).astype(jnp.float32)
        kv_bytes = 2 * KV * HEAD_DIM * 2 * int(jnp.sum(positions + 1))  # K and V, bf16, the positions seen
        variants = {"jlora": functools.partial(decode_attention, positions=positions, rows=rows)}
        for chunk, stage in ((c, s) for c in chunks for s in stages if max_seq // c <= 16 or args.smoke):
            variants[f"split {chunk} stages {stage}"] = functools.partial(
                split_attention, positions=positions, rows=rows, chunk=chunk, stages=stage)
        for name, fn in variants.items():
            try:
                out = jax.jit(fn)(q, ks[0], vs[0]).astype(jnp.float32)
            except Exception as err:  # a variant Triton cannot lower: noted, not timed
                print(f"B={batch} max_seq={max_seq}: {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            error = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            if error >= 1e-2:
                raise AssertionError(f"B={batch} max_seq={max_seq} {name}: relative error {error:.3g}")
            row = dict(batch=batch, max_seq=max_seq, position=pos, variant=name, error=error)
            if gpu:
                run = jax.jit(lambda q, ks, vs, fn=fn: [fn(q, k, v) for k, v in zip(ks, vs)])
                jax.block_until_ready(run(q, ks, vs))
                kernels = trace_kernels(lambda: run(q, ks, vs))
                row["us_per_layer"] = sum(sum(d) for d in kernels.values()) / layers
                row["kernels_per_layer"] = sum(map(len, kernels.values())) / layers
                row["TBps"] = kv_bytes / row["us_per_layer"] / 1e6
            result["rows"].append(row)
            save(result)
            timing = (f"{row['us_per_layer']:6.1f} µs per layer ({row['TBps']:.2f} TB/s), "
                      f"{row['kernels_per_layer']:.0f} kernels, " if gpu else "")
            print(f"B={batch:2d} max_seq={max_seq} pos={pos}: {name:18s} {timing}error {error:.1e}", flush=True)
        del ks, vs


if __name__ == "__main__":
    main()
