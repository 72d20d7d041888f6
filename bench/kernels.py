"""Kernel benchmark: pallas vs reference vs ragged vs the memory-bandwidth floor, side by side in one run.

Timing follows DESIGN §5 / the kernels issue: one jitted function calls the op 32 times over 8 weight stacks
and 32 distinct input sets (cold memory, as across layers; distinct so XLA cannot merge calls). Outputs
that add into a base are chained through the calls (`y = op(..., base=y)`), as a layer adds into the
base projection's fresh output, so the in-place kernels get an intermediate to write into rather than
a jit argument XLA would first copy. Several runs are dispatched back to back before blocking, so host
dispatch hides behind the GPU; the time is divided by the calls made. The floor counts x (or s) read
once, the used adapters' weights read once (only their rank rows), the output written (and read, when
adding into it), over the copy bandwidth measured in the same run. The reference's shrink can beat that
floor: XLA merges the einsums of calls that share a weight stack into one GEMM (8 cuBLAS GEMMs for the 32
calls on an H200), which the Pallas calls cannot be.

  python bench/kernels.py [--quick] [--backends pallas,gather,reference,ragged] [--out bench/results]
  python bench/kernels.py --resume   # the full table, keeping the rows an earlier run already wrote to
                                     # kernels_full.json (it is saved after every row, so a run cut off by a
                                     # time limit loses at most the row it was on)
  python bench/kernels.py --crossover   # pallas vs gather on the model's decode projections, T = 16..256
  python bench/kernels.py --sweep shrink,expand,linear   # pallas tiles on the target rows (and the model's
                                                         # decode projections for linear, and r=32 / 64
                                                         # decode rows); best per row. Op names
                                                         # (down_shrink) pick single ops; --rank 64 only
                                                         # the r=64 rows
  python bench/kernels.py --profile   # the target rows' device kernel time from a profiler trace
Decode rows (T <= 256) are launch-bound in wall time when jitted kernels run outside a CUDA graph, so the
table also reports their device time from a profiler trace, the figure comparable to the peers' graphs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jlora
from common import copy_bandwidth, gpu_facts, pyplot, trace_kernels
from jlora import LoRABatchInfo
from jlora.runner import row_tile

CALLS, STACKS, RUNS, REPEATS = 32, 8, 4, 5
REQUEST_LEN = 128  # prefill tokens per request
SLOTS, HIDDEN, KV, INTER = 32, 4096, 1024, 14336
OPS = {  # name: (kind, K or None, slice sizes)
    "shrink": ("shrink", HIDDEN, (HIDDEN,)),
    "expand": ("expand", None, (HIDDEN,)),
    "qkv_shrink": ("shrink", HIDDEN, (HIDDEN, KV, KV)),
    "qkv_expand": ("expand", None, (HIDDEN, KV, KV)),
    "gate_up_expand": ("expand", None, (INTER, INTER)),
    "down_shrink": ("shrink", INTER, (HIDDEN,)),
    "qkv_linear": ("linear", HIDDEN, (HIDDEN, KV, KV)),
    "o_linear": ("linear", HIDDEN, (HIDDEN,)),
    "gate_up_linear": ("linear", HIDDEN, (INTER, INTER)),
    "down_linear": ("linear", INTER, (HIDDEN,)),
}
# The full table's ops (the kernels issue's list); the other linears are in the crossover table.
FULL_OPS = ("shrink", "expand", "qkv_shrink", "qkv_expand", "gate_up_expand", "down_shrink", "qkv_linear")
# The kernels issue's target table: (op, T, adapters in batch, rank): (best peer µs, target µs).
TARGETS = {
    ("shrink", 64, 8, 16): (5.6, 4),
    ("expand", 64, 8, 16): (3.6, 3),
    ("qkv_linear", 64, 8, 16): (16.7, 8),
    ("gate_up_expand", 64, 8, 16): (18.0, 9),
    ("down_shrink", 64, 8, 16): (6.7, 4),
    ("shrink", 8192, 32, 64): (41.4, 28),
    ("expand", 8192, 32, 64): (133.1, 50),
    ("qkv_shrink", 8192, 32, 64): (114.7, 40),
    ("qkv_expand", 8192, 32, 64): (716.1, 76),
    ("gate_up_expand", 8192, 32, 64): (2460.0, 350),
    ("down_shrink", 8192, 32, 64): (115.3, 98),
}

# The end-to-end benchmark's decode step (bench/model.py): batch 32, each request its own r=16 adapter.
MODEL_DECODE = [(op, 32, 32, 16) for op in ("qkv_linear", "o_linear", "gate_up_linear", "down_linear")]
# Decode rows with r=32 and r=64 adapters, which the tiles were not tuned on at first (the full table showed the
# r=64 ones slow).
WIDE_RANK_DECODE = [(op, 64, n, r) for r in (32, 64) for op in ("shrink", "qkv_shrink", "down_shrink", "expand",
                                                                "qkv_expand", "gate_up_expand") for n in (8, 32)]


@dataclasses.dataclass
class Row:
    op: str
    tokens: int
    adapters: int
    rank: int
    backend: str
    us: float  # wall time per call
    device_us: float  # device kernel time per call (profiler trace)
    floor_us: float
    gbps: float  # floor bytes / device time


def make_inputs(op: str, tokens: int, adapters: int, rank: int, rng):
    """Random bf16 inputs (drawn on the device) for one row: (kind, slices, token slots, op args, floor bytes)."""
    kind, k, slices = OPS[op]
    n = sum(slices)
    keys = iter(jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4 * CALLS))
    rnd = lambda *shape: (jax.random.normal(next(keys), shape, jnp.float32) * 0.1).astype(jnp.bfloat16)
    # Tokens come in requests, as in a server: each decode token is a request of its own; prefill tokens
    # come in requests of REQUEST_LEN consecutive tokens. Each request draws one of the `adapters` adapters.
    used = rng.choice(SLOTS, adapters, replace=False)
    request_len = 1 if tokens <= 256 else REQUEST_LEN
    slots = np.repeat(used[rng.integers(0, adapters, -(-tokens // request_len))], request_len)[:tokens]
    slots[: adapters * request_len] = np.repeat(used, request_len)[:tokens]  # every adapter present
    n_used = len(np.unique(slots))
    s_width = len(slices) * rank
    if kind == "shrink":
        args = ([rnd(tokens, k) for _ in range(CALLS)], [rnd(SLOTS, s_width, k) for _ in range(STACKS)])
        nbytes = 2 * (tokens * k + n_used * s_width * k + tokens * s_width)
    elif kind == "expand":
        args = ([rnd(tokens, s_width) for _ in range(CALLS)], [rnd(SLOTS, n, rank) for _ in range(STACKS)], rnd(tokens, n))
        nbytes = 2 * (tokens * s_width + n_used * n * rank + 2 * tokens * n)
    else:
        args = (
            [rnd(tokens, k) for _ in range(CALLS)],
            [rnd(SLOTS, s_width, k) for _ in range(STACKS)],
            [rnd(SLOTS, n, rank) for _ in range(STACKS)],
            rnd(tokens, n),
        )
        nbytes = 2 * (tokens * k + n_used * s_width * k + n_used * n * rank + 2 * tokens * n)
    return kind, slices, slots, args, nbytes


def make_info(slots: np.ndarray, rank: int, block_m: int) -> LoRABatchInfo:
    return LoRABatchInfo.build(slots, np.full(SLOTS, rank), np.ones(SLOTS), block_m=block_m)


def make_fn(kind: str, slices: tuple[int, ...], backend: str, config=None):
    """The jitted 32-call function; `config` (pallas tiles) bypasses the public op to set the tiles."""
    if kind == "shrink":
        def fn(info, xs, a_stacks):
            if config is not None:
                return [jlora.pallas.shrink(x, a_stacks[i % STACKS], info, num_slices=len(slices), config=config)
                        for i, x in enumerate(xs)]
            return [jlora.lora_shrink(x, a_stacks[i % STACKS], info, num_slices=len(slices), backend=backend)
                    for i, x in enumerate(xs)]
    elif kind == "expand":
        def fn(info, ss, b_stacks, y):
            for i, s in enumerate(ss):
                if config is not None:
                    y = jlora.pallas.expand(s, b_stacks[i % STACKS], info, y, slice_sizes=slices, config=config)
                else:
                    y = jlora.lora_expand(s, b_stacks[i % STACKS], info, y, slice_sizes=slices, backend=backend)
            return y
    else:
        def fn(info, xs, a_stacks, b_stacks, y):
            for i, x in enumerate(xs):
                a, b = a_stacks[i % STACKS], b_stacks[i % STACKS]
                if config is not None:
                    y = jlora.pallas.linear(x, y, a, b, info, slice_sizes=slices, shrink_config=config[0],
                                            expand_config=config[1])
                else:
                    y = jlora.lora_linear(x, y, a, b, info, slice_sizes=slices, backend=backend)
            return y
    return jax.jit(fn)


def time_per_call(fn, *args) -> float:
    """Median seconds per op call: RUNS runs dispatched back to back, REPEATS times."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(RUNS)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t0) / (RUNS * CALLS))
    return statistics.median(samples)


GATHER_MAX_ROW = 256  # gather reads every token's weights: run it on decode rows only


def cases(mode: str):
    if mode == "quick":
        yield from ((op, t, n, r) for (op, t, n, r) in TARGETS)
        return
    if mode == "crossover":  # where "auto" should switch from gather to pallas (jlora.ops.GATHER_MAX_TOKEN_RANK)
        for op in ("qkv_linear", "o_linear", "gate_up_linear", "down_linear"):
            for tokens in (16, 32, 64, 128, 256):
                for adapters in sorted({min(tokens, 8), min(tokens, 32)}):
                    yield op, tokens, adapters, 16
        return
    for op in FULL_OPS:
        for rank in (16, 64):
            for adapters in (1, 8, 32):
                for tokens in (1, 16, 64, 256, 2048, 8192):
                    if adapters <= max(tokens, 1):
                        yield op, tokens, adapters, rank


def sweep_configs(kind: str, k: int | None, width: int, tokens: int):
    """(block_m, config) candidates for one row: row tiles, split-K / block_n and warps; for a decode
    `linear`, (shrink, expand) config pairs."""
    block_ms = (16,) if tokens <= 256 else (64, 128)
    if kind == "linear":
        splits = (2, 4, 8, 16) if k % 7 else (7, 14, 28)
        for split, block_k, stages, block_n in itertools.product(splits, (64, 128), (2, 3), (128, 256)):
            if k % (split * block_k) == 0:
                yield 16, (jlora.pallas.ShrinkConfig(block_k=block_k, k_splits=split, split_slices=True,
                                                     num_warps=1, num_stages=stages),
                           jlora.pallas.ExpandConfig(block_n=block_n, num_warps=2, num_stages=2))
    elif kind == "shrink" and tokens <= 256:
        for bm, split, warps, block_k, stages in itertools.product(block_ms, (8, 14, 16, 28, 32), (1, 2, 4), (64, 128),
                                                                   (2, 3, 4)):
            if k % (split * block_k) == 0 and stages <= k // (split * block_k) + 1:
                yield bm, jlora.pallas.ShrinkConfig(block_k=block_k, k_splits=split, num_warps=warps,
                                                    num_stages=stages, split_slices=True)
    elif kind == "shrink":
        for bm, split, warps, block_k, stages in itertools.product(block_ms, (1, 2), (4, 8), (64, 128), (3, 4)):
            if k % (split * block_k) == 0 and stages * (bm + width) * block_k * 2 <= 200 * 1024:
                yield bm, jlora.pallas.ShrinkConfig(block_k=block_k, k_splits=split, num_warps=warps,
                                                    num_stages=stages)
    elif kind == "expand" and tokens <= 256:
        for bn, warps in itertools.product((128, 256, 512, 1024), (2, 4, 8)):
            yield 16, jlora.pallas.ExpandConfig(block_n=bn, num_warps=warps)
    elif kind == "expand":
        for rows, group, warps, stages in itertools.product((16, 32, 64), (2, 4, 8), (4, 8), (2, 3)):
            if warps == 4 or rows == 32:
                yield 64, jlora.pallas.ExpandConfig(block_n=128, group=group, block_rows=rows, num_warps=warps,
                                                    num_stages=stages)


def sweep(rng, names: list[str], min_tokens: int, max_tokens: int, ranks: set[int]) -> None:
    """Times the pallas tile candidates of each row whose op or op kind is in `names`; prints the best."""
    for op, tokens, adapters, rank in [*TARGETS, *MODEL_DECODE, *WIDE_RANK_DECODE]:
        kind, k, slices = OPS[op]
        if (kind not in names and op not in names) or not min_tokens <= tokens <= max_tokens or rank not in ranks:
            continue
        results = []
        kind, slices, slots, inputs, _ = make_inputs(op, tokens, adapters, rank, rng)
        for bm, cfg in sweep_configs(kind, k, len(slices) * rank, tokens):
            # Decode rows are timed on the device: their wall time is host launch overhead.
            timer = (lambda *a: device_time_per_call(*a)[0]) if tokens <= 256 else time_per_call
            try:
                sec = timer(make_fn(kind, slices, "pallas", cfg), make_info(slots, rank, bm), *inputs)
            except Exception as err:
                print(f"  {op} T={tokens} bm={bm} {cfg}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                continue
            results.append((sec * 1e6, bm, cfg))
            print(f"  {op} T={tokens} bm={bm} {cfg}: {sec * 1e6:.1f} µs", flush=True)
        if results:
            default = timer(make_fn(kind, slices, "pallas"), make_info(slots, rank, row_tile(tokens)), *inputs)
            print(f"DEFAULT {op} T={tokens} n={adapters} r={rank}: {default * 1e6:.1f} µs (heuristic tiles)",
                  flush=True)
            best = min(results, key=lambda r: r[0])
            print(f"BEST {op} T={tokens} n={adapters} r={rank}: {best[0]:.1f} µs block_m={best[1]} {best[2]}", flush=True)
        del inputs


def device_time_per_call(fn, *args) -> tuple[float, dict[str, list[float]]]:
    """Device seconds per op call from a profiler trace of one run (kernel durations on the GPU streams,
    summed, divided by the calls), and the kernels' durations by name in µs."""
    jax.block_until_ready(fn(*args))
    kernels = trace_kernels(lambda: fn(*args))
    return sum(sum(d) for d in kernels.values()) / CALLS * 1e-6, kernels


def profile(rng) -> None:
    """Device kernel time per call of the pallas target rows."""
    for op, tokens, adapters, rank in TARGETS:
        kind, slices, slots, inputs, _ = make_inputs(op, tokens, adapters, rank, rng)
        info = make_info(slots, rank, row_tile(tokens))
        sec, kernels = device_time_per_call(make_fn(kind, slices, "pallas"), info, *inputs)
        parts = ", ".join(f"{n[:40]} x{len(d)} {sum(d) / len(d):.1f}" for n, d in sorted(kernels.items()))
        print(f"PROFILE {op} T={tokens} n={adapters} r={rank}: device {sec * 1e6:.1f} µs per call [{parts}]",
              flush=True)
        del inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the kernels issue's target rows")
    parser.add_argument("--crossover", action="store_true",
                        help="pallas vs gather on the model's decode projections at T = 16..256")
    parser.add_argument("--sweep", metavar="KINDS", help="time pallas tile settings on the target rows of "
                        "these op kinds or ops (comma-separated: shrink,expand,linear or e.g. down_shrink)")
    parser.add_argument("--rank", type=int, action="append", help="--sweep only rows of this rank (repeatable)")
    parser.add_argument("--min-tokens", type=int, default=0, help="--sweep only rows with T >= this")
    parser.add_argument("--max-tokens", type=int, default=1 << 30, help="--sweep only rows with T <= this")
    parser.add_argument("--profile", action="store_true", help="device kernel times of the target rows")
    parser.add_argument("--backends", default="pallas,gather,reference,ragged")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --out's JSON for this "
                        "mode, time only the missing ones")
    args = parser.parse_args()
    if args.sweep:
        ranks = set(args.rank or (16, 32, 64))
        return sweep(np.random.default_rng(0), args.sweep.split(","), args.min_tokens, args.max_tokens, ranks)
    if args.profile:
        return profile(np.random.default_rng(0))
    mode = "quick" if args.quick else "crossover" if args.crossover else "full"
    backends = ["pallas", "gather"] if args.crossover else args.backends.split(",")
    bandwidth = copy_bandwidth()
    device = jax.devices()[0].device_kind
    print(f"# {device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    rows, bandwidths = load_results(args.out, mode, device) if args.resume else ([], [])
    bandwidths.append(bandwidth)
    done = {(r.op, r.tokens, r.adapters, r.rank, r.backend) for r in rows}
    rng = np.random.default_rng(0)
    for op, tokens, adapters, rank in cases(mode):
        todo = [b for b in backends if (op, tokens, adapters, rank, b) not in done
                and not (b == "gather" and tokens > GATHER_MAX_ROW)]
        if not todo:
            continue
        kind, slices, slots, inputs, nbytes = make_inputs(op, tokens, adapters, rank, rng)
        info = make_info(slots, rank, row_tile(tokens))
        floor = nbytes / bandwidth
        for backend in todo:
            fn = make_fn(kind, slices, backend)
            try:
                sec = time_per_call(fn, info, *inputs)
                dev, _ = device_time_per_call(fn, info, *inputs)
            except Exception as err:  # a backend that cannot run a shape (e.g. out of memory) is reported
                print(f"{op} T={tokens} {backend}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            r = Row(op, tokens, adapters, rank, backend, sec * 1e6, dev * 1e6, floor * 1e6, nbytes / dev / 1e9)
            rows.append(r)
            print(f"{op:15s} T={tokens:5d} n={adapters:2d} r={rank:2d} {backend:9s} {r.us:9.1f} µs wall "
                  f"{r.device_us:9.1f} µs device, floor {r.floor_us:7.1f} µs ({r.floor_us / r.device_us:5.1%}) "
                  f"{r.gbps:7.0f} GB/s", flush=True)
            save_json(rows, device, bandwidths, args.out, mode)
        del inputs
    write_results(rows, device, bandwidths, args.out, mode)


_card = functools.cache(gpu_facts)  # the card, read once: save_json runs after every row


def save_json(rows: list[Row], device: str, bandwidths: list[float], out_dir: str, tag: str) -> None:
    """kernels_{tag}.json: the rows and the copy bandwidth of each run that measured some of them."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"kernels_{tag}.json"), "w") as f:
        json.dump({"device": device, "copy_bandwidths_Bps": bandwidths, "jax": jax.__version__,
                   "host": platform.node(), "gpu": _card(), "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


def load_results(out_dir: str, tag: str, device: str) -> tuple[list[Row], list[float]]:
    """The rows and bandwidths an earlier run saved to kernels_{tag}.json ([] if none); refuses another device's."""
    path = os.path.join(out_dir, f"kernels_{tag}.json")
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        saved = json.load(f)
    if saved["device"] != device:
        raise SystemExit(f"--resume: {path} holds rows measured on {saved['device']}, this is {device}; "
                         "move it away to start afresh")
    rows = [Row(**r) for r in saved["rows"]]
    print(f"# resuming {path}: {len(rows)} rows kept", flush=True)
    return rows, saved.get("copy_bandwidths_Bps") or [saved["copy_bandwidth_Bps"]]


def write_results(rows: list[Row], device: str, bandwidths: list[float], out_dir: str, tag: str) -> None:
    save_json(rows, device, bandwidths, out_dir, tag)
    stem = os.path.join(out_dir, f"kernels_{tag}")
    by_key = {(r.op, r.tokens, r.adapters, r.rank, r.backend): r for r in rows}
    low, high = min(bandwidths) / 1e12, max(bandwidths) / 1e12
    measured = (f"{low:.2f} TB/s" if f"{low:.2f}" == f"{high:.2f}"
                else f"{low:.2f}-{high:.2f} TB/s over {len(bandwidths)} runs")
    lines = [f"Device: {device}; copy bandwidth {measured}; bf16, {SLOTS} slots; µs per call: "
             "device kernel time (profiler), wall time in parentheses.", "",
             "| op | T | adapters | r | floor µs | pallas µs | floor / pallas | gather µs | reference µs "
             "| ragged µs | reference / pallas | best peer µs | target µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r.op, r.tokens, r.adapters, r.rank) for r in rows):
        get = lambda b: by_key.get(key + (b,))
        p, gat, ref, rag = get("pallas"), get("gather"), get("reference"), get("ragged")
        any_row = p or gat or ref or rag
        peer, target = TARGETS.get(key, ("", ""))
        fmt = lambda r: f"{r.device_us:.1f} ({r.us:.1f})" if r else "—"
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {any_row.floor_us:.1f} | {fmt(p)} | "
            f"{f'{p.floor_us / p.device_us:.0%}' if p else '—'} | {fmt(gat)} | {fmt(ref)} | {fmt(rag)} | "
            f"{f'{ref.device_us / p.device_us:.1f}x' if p and ref else '—'} | {peer} | {target} |"
        )
    table = "\n".join(lines)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    plot(rows, statistics.median(bandwidths), stem + ".png", device)


def plot(rows: list[Row], bandwidth: float, path: str, device: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    keys = list(dict.fromkeys((r.op, r.tokens, r.adapters, r.rank) for r in rows))
    fig, ax = plt.subplots(figsize=(max(12, 0.16 * len(keys)), 5))
    names = ("pallas", "gather", "reference", "ragged")
    for i, backend in enumerate(names):
        xs = [j for j, k in enumerate(keys) if any(r.backend == backend and (r.op, r.tokens, r.adapters, r.rank) == k
                                                   for r in rows)]
        ys = [r.gbps for k in keys for r in rows if r.backend == backend and (r.op, r.tokens, r.adapters, r.rank) == k]
        ax.bar([x + (i - 1.5) * 0.2 for x in xs], ys, width=0.2, label=backend)
    ax.axhline(bandwidth / 1e9, color="k", linestyle="--", label="copy bandwidth (floor)")
    ax.set_xticks(range(len(keys)), [f"{o} T={t} n={n} r={r}" for o, t, n, r in keys], rotation=75, fontsize=7)
    ax.set_ylabel("achieved GB/s (floor bytes / device time)")
    ax.set_yscale("log")
    ax.set_title(f"jlora kernels on {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
