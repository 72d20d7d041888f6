"""End-to-end benchmark: a Llama-3-8B-shaped model with random bf16 weights, decode and prefill.

Decode step time and tokens/s at several batch sizes for the base model (LoRA off) and with 1, 8 or 32
distinct adapters (rank 16 or 64, on every projection, the embedding and lm_head); prefill throughput at
2048 and 8192 tokens. A decode row of B requests runs the step an engine of max_batch B over contiguous cache rows
of 1024 positions runs (`engine_config`): batch 1 over the weights stored [out, in]
(`jlora.EngineConfig.weights_out_in`), the other rows over [in, out]; batch 1 and 8 with the decode attention
split over chunks of positions (`jlora.EngineConfig.attention_chunk`). The LoRA overhead is reported against the
base step and against the floor `base step + adapter bytes read / copy bandwidth`, with the bandwidth measured in
the same run.

  python bench/model.py [--quick] [--layers 32] [--backend auto] [--batches 1,8,32,64] [--out bench/results]
  python bench/model.py --batches 64 --add model.json  # one table over two processes (each device call's limit)
  python bench/model.py --tp 1,2        # tensor parallel: batch-32 decode, base and 32 r=16 adapters, per degree
  python bench/model.py --profile [--tp 2] [--batches 1,8,32]  # decode steps: GPU time by kernel class and kernel
  python bench/model.py --engine [--tp 1,2]  # Engine.generate end to end: ms per decode step vs the bare step
  python bench/model.py --features      # batch-32 decode and a 2048-token prefill with 32 DoRA / bias adapters
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import GpuMonitor, copy_bandwidth, describe_span, kernel_durations, pyplot, trace_events
from result_files import read_model_results
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine
from jlora.engine_config import EngineConfig
from jlora.runner import ModelDef, bucket, forward
from jlora.models.config import ModelConfig
from jlora.models.llama import Batch, KVCache, Transformer, with_weight_layout
from jlora.models.loading import load_model
from jlora.models.lora_weights import LoRAWeights, RowOverrides, module_shapes
from jlora.parallel import TensorParallel
from jlora.step import Call, StepOptions
from jlora.testing import tiny_config, write_adapter, write_model

SLOTS, STEPS, REPEATS, CONTEXT = 32, 8, 5, 512
BACKEND = "auto"  # the LoRA backend every call runs (--backend)


def llama3_8b_hf(layers: int) -> dict:
    """The HF config.json of a Llama-3-8B-shaped model with `layers` layers."""
    return tiny_config("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192))


def llama3_8b(layers: int) -> ModelConfig:
    return ModelConfig.from_hf_config(llama3_8b_hf(layers))


def random_model(config: ModelConfig) -> tuple[ModelDef, list[jax.Array]]:
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    keys = iter(jax.random.split(jax.random.key(0), 4096))
    filled = [(path, type(v)((jax.random.normal(next(keys), v.shape, jnp.float32) * 0.02).astype(jnp.bfloat16)))
              for path, v in nnx.to_flat_state(state)]
    return ModelDef.split(graphdef, nnx.from_flat_state(filled))


def bench_model(tiny: bool, root: str) -> tuple[Transformer, dict, jnp.dtype]:
    """A study's model, its HF config and dtype: the Llama-3-8B-shaped model with random bf16 weights, or with
    `tiny` (a smoke run on the CPU) a tiny float32 Llama written under `root`."""
    if tiny:
        cfg = tiny_config("llama", vocab_size=256)
        write_model(f"{root}/m", cfg, seed=0)
        return load_model(f"{root}/m", jnp.float32, progress=False), cfg, jnp.float32
    model_def, params = random_model(llama3_8b(32))
    return model_def.merge(params), llama3_8b_hf(32), jnp.bfloat16


def random_lora(config: ModelConfig, rank: int, slots: int = SLOTS) -> LoRAWeights:
    zeros = LoRAWeights.zeros(config, slots, rank, jnp.bfloat16)
    keys = iter(jax.random.split(jax.random.key(1), 4096))
    return jax.tree.map(lambda z: (jax.random.normal(next(keys), z.shape, jnp.float32) * 0.01).astype(z.dtype), zeros)


def shuffled_slots(batch: int, adapters: int, rng: np.random.Generator | None = None) -> jax.Array:
    """[batch] int32: `adapters` adapters over the rows, row i on slot i % adapters, the rows in a random order
    (`rng`'s, else a fixed one)."""
    rng = np.random.default_rng(0) if rng is None else rng
    return jnp.asarray(rng.permutation(np.arange(batch) % adapters), jnp.int32)


def adapter_bytes(lora: LoRAWeights, used: int, tokens: int) -> int:
    """Bytes of LoRA weights a step must read for `used` adapters (the embedding A side: only T columns)."""
    per_slot = sum(x[0].nbytes for x in jax.tree.leaves(lora)) - lora.embed_a[0].nbytes
    return used * per_slot + tokens * lora.embed_a.shape[1] * 2


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of the base weights a decode step reads: every layer's projections and the lm_head, bf16."""
    per_layer = sum(k * sum(n for _, n in outs) for k, outs in module_shapes(config).values())
    return (config.num_layers * per_layer + config.vocab_size * config.hidden_size) * 2


def kv_bytes(config: ModelConfig, batch: int, context: int = CONTEXT) -> int:
    """Bytes of K and V a decode step of `batch` requests at `context` positions reads, bf16."""
    return batch * context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2


def engine_config(batch: int, degree: int = 1) -> EngineConfig:
    """The engine a decode row of `batch` requests stands for: max_batch `batch` over contiguous cache rows of
    2 * CONTEXT positions, on `degree` devices. Its `weights_out_in` is the row's weight layout (`engine_layout`)
    and its `attention_chunk` the row's attention split."""
    return EngineConfig(max_batch=batch, max_seq_len=2 * CONTEXT, block_size=0, tensor_parallel=degree)


def engine_layout(model_def: ModelDef, params: list[jax.Array], batch: int) -> tuple[ModelDef, list[jax.Array]]:
    """The model with its weights stored as `engine_config(batch)`'s engine stores them: [out, in] at batch 1
    (transposed copies), else the model itself."""
    if not engine_config(batch).weights_out_in:
        return model_def, params
    return ModelDef.split(*nnx.split(with_weight_layout(model_def.merge(params), True)))


def model_step(model_def, params, tokens, positions, lora, token_slot, ranks, block_m, tp=None, attention_chunk=None):
    """cache -> (logits, cache): one jitted model call on these inputs."""
    call = Call(Batch.of(tokens, positions), token_slot, ranks)
    options = StepOptions(block_m, BACKEND, tp, attention_chunk=attention_chunk)
    return lambda c: forward(model_def, params, call, c, lora, options)


def time_steps(model_def, params, tokens, positions, cache, lora, token_slot, ranks, block_m, tp=None,
               attention_chunk=None):
    """(step, dispatch, cache) of `time_run` for one model call on these inputs."""
    return time_run(model_step(model_def, params, tokens, positions, lora, token_slot, ranks, block_m, tp,
                               attention_chunk), cache)


def time_run(run, cache, repeats: int = REPEATS, steps: int = STEPS, min_seconds: float = 0.4):
    """(step, dispatch, cache): median seconds per `run(cache) -> (logits, cache)` over `repeats` rounds, and the
    host's share of it: seconds per call until a round's dispatch loop returns (close to the step time means the
    host, not the GPU, sets the pace).

    A round dispatches calls back to back (cache threaded through) and blocks once: at least `steps` calls and
    at least `min_seconds` of them, as timed by the second of two blocked warm-up calls. Its clock also holds
    the first call's host dispatch, before the GPU starts (about 2 ms for the 8B-shaped step, which a serving
    loop hides behind the step before): over 8 calls that read 0.2-0.35 ms per step slow; over the 50-60 calls
    of a decode round it is under 1 %. (The difference between rounds of 16 and 8 calls, tried instead, read
    the batch-32 LoRA steps 0.4 ms below 64-call rounds in one process and scattered by 5 %.)"""
    logits, cache = run(cache)  # compiles on a first call
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    logits, cache = run(cache)
    jax.block_until_ready(logits)
    calls = max(steps, math.ceil(min_seconds / (time.perf_counter() - t0)))
    walls, dispatches = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            logits, cache = run(cache)
        dispatches.append((time.perf_counter() - t0) / calls)
        jax.block_until_ready((logits, cache))
        walls.append((time.perf_counter() - t0) / calls)
    return statistics.median(walls), statistics.median(dispatches), cache


def time_alternating(runs: dict, cache, rounds: int = REPEATS, steps: int = STEPS,
                     dispatch: dict | None = None) -> tuple[dict, object]:
    """({name: [seconds per call, per round]}, cache) of `run(cache) -> (logits, cache)` for each of `runs`, timed
    in `rounds` alternating rounds (one `time_run` round each, of at least `steps` calls), so that drift in the
    GPU's clocks reaches every case alike and the ratios between them hold. `dispatch`, when given, gets each
    case's host seconds per call, per round (`time_run`'s)."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            sec, host, cache = time_run(run, cache, repeats=1, steps=steps)
            times[name].append(sec)
            if dispatch is not None:
                dispatch.setdefault(name, []).append(host)
    return times, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 32 decode and T=2048 prefill only")
    parser.add_argument("--batches", default="1,8,32,64", help="decode batch sizes (prefill runs with 32)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tp", help="comma-separated tensor-parallel degrees to compare (e.g. 1,2)")
    parser.add_argument("--profile", action="store_true",
                        help="where decode steps spend their time (batches 1, 8, 32 unless --batches; "
                             "model_profile.json, or model_profile_b<batches>_r<rank>.json for other batches or ranks)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank in --profile")
    parser.add_argument("--engine", action="store_true", help="Engine.generate end to end against the bare step")
    parser.add_argument("--features", action="store_true",
                        help="32 DoRA, LoRA-bias and added-token adapters against 32 plain ones")
    parser.add_argument("--backend", default="auto",
                        help="LoRA backend (auto: gather below 32 tokens while tokens x rank <= 512, else pallas)")
    parser.add_argument("--add", metavar="FILE",
                        help="a result of an earlier process on a card of the same kind: its rows of the batches "
                             "(and prefill) this run does not time go into this run's table, its processes listed")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    global BACKEND
    BACKEND = args.backend
    config = llama3_8b(args.layers)
    device = jax.devices()[0].device_kind
    bandwidth = copy_bandwidth()
    print(f"# {device}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; Llama-3-8B shape, {args.layers} layers, bf16",
          flush=True)
    model_def, params = random_model(config)
    rng = np.random.default_rng(0)
    if args.profile:
        batches = (1, 8, 32) if args.batches == parser.get_default("batches") else args.batches.split(",")
        batches = tuple(int(b) for b in batches)
        name = ("model_profile" if (batches, args.rank) == ((1, 8, 32), 16)
                else f"model_profile_b{'-'.join(map(str, batches))}_r{args.rank}")
        return profile(config, model_def, params, int(args.tp or 1), batches, bandwidth, device,
                       os.path.join(args.out, name + ".json"), args.rank)
    if args.features:
        return features(config, model_def, params, device, args.out)
    if args.engine:
        for degree in (args.tp or "1").split(","):
            engine_throughput(config, model_def, params, bandwidth, device, args.out, int(degree))
        return
    if args.tp:
        return tensor_parallel(config, model_def, params, [int(t) for t in args.tp.split(",")], bandwidth, device,
                               args.out)
    batches = (32,) if args.quick else tuple(int(b) for b in args.batches.split(","))
    ranks_tested = (16,) if args.quick else (16, 64)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "model" + "_quick" * args.quick + ("" if BACKEND == "auto" else f"_{BACKEND}"))
    monitor = GpuMonitor()  # the card and its clocks while each batch runs: what tells two runs' tables apart
    print(f"# {monitor.facts}", flush=True)
    process = {"copy_bandwidth_Bps": bandwidth, "gpu": monitor.facts, "batches": list(batches)}
    earlier, rows = ([], []) if args.add is None else earlier_rows(args.add, device, batches, args.layers, BACKEND)
    processes = earlier + [process]

    def save() -> None:  # after every row, so a run cut short keeps what it measured
        with open(stem + ".json", "w") as f:
            json.dump({"device": device, "copy_bandwidth_Bps": bandwidth, "layers": args.layers, "backend": BACKEND,
                       "gpu": monitor.facts, **({"processes": processes} if earlier else {}), "rows": rows}, f,
                      indent=1)
        plot(rows, stem + ".png", device)

    def timed(runs: dict, cache, **options):
        """`time_alternating` under `monitor.span()`, each step compiled before it (so the span holds no compile's
        idle GPU): (times, cache, what the GPU's clocks and power read)."""
        for run in runs.values():
            logits, cache = run(cache)
            jax.block_until_ready(logits)
        with monitor.span() as gpu:
            times, cache = time_alternating(runs, cache, **options)
        print(f"# {len(runs)} steps timed{describe_span(gpu)}", flush=True)
        return times, cache, gpu

    def record(kind, batch, tokens, rank, adapters, sec, base_sec, lora=None, host=None, gpu=None):
        floor = None if lora is None else base_sec + adapter_bytes(lora, adapters, tokens) / bandwidth
        # the base step's own floor (decode: its weights and KV read once at the copy bandwidth)
        base_floor = (weight_bytes(config) + kv_bytes(config, batch)) / bandwidth if kind == "decode" else None
        row = dict(kind=kind, batch=batch, tokens=tokens, rank=rank, adapters=adapters, ms=sec * 1e3,
                   tokens_per_s=tokens / sec, overhead_vs_base=sec / base_sec,
                   floor_ms=None if floor is None else floor * 1e3,
                   vs_floor=None if floor is None else sec / floor,
                   base_floor_ms=None if base_floor is None else base_floor * 1e3,
                   base_vs_floor=None if base_floor is None else base_sec / base_floor,
                   # the host's time to dispatch a call: near `ms`, the host may be what sets the pace
                   dispatch_ms=None if host is None else host * 1e3,
                   gpu=gpu)  # the clocks and power while the row's batch was timed (`GpuMonitor.span`)
        rows.append(row)
        save()
        extra = "" if floor is None else f"  floor {floor * 1e3:7.3f} ms  x{sec / floor:5.2f} of floor"
        extra += "" if host is None else f"  host dispatch {host * 1e3:6.3f} ms"
        print(f"{kind:7s} B={batch:3d} T={tokens:5d} r={rank or '-':>2} n={adapters:2d}  {sec * 1e3:8.3f} ms  "
              f"{tokens / sec:9.0f} tok/s  x{sec / base_sec:5.2f} of base{extra}", flush=True)

    def decode(batch: int) -> None:  # one token per request at position CONTEXT
        cache = KVCache.zeros(config, batch, 2 * CONTEXT, jnp.bfloat16)
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, 1)), jnp.int32)
        positions = jnp.full((batch, 1), CONTEXT, jnp.int32)
        loras = {rank: random_lora(config, rank) for rank in ranks_tested}
        cases = {(0, 0): (None, jnp.full(batch, -1, jnp.int32), jnp.zeros(SLOTS, jnp.int32))}
        for rank in ranks_tested:
            for adapters in (a for a in (1, 8, 32) if a <= batch):
                slots = shuffled_slots(batch, adapters, rng)
                cases[rank, adapters] = (loras[rank], slots, jnp.full(SLOTS, rank, jnp.int32))
        stored, chunk = engine_layout(model_def, params, batch), engine_config(batch).attention_chunk(config.num_kv_heads)
        host = {}
        times, cache, gpu = timed({case: model_step(*stored, tokens, positions, *args, 16, None, chunk)
                                   for case, args in cases.items()}, cache, dispatch=host)
        secs = {case: statistics.median(t) for case, t in times.items()}
        for (rank, adapters), sec in secs.items():
            record("decode", batch, batch, rank, adapters, sec, secs[0, 0], loras.get(rank),
                   statistics.median(host[rank, adapters]), gpu)
        del loras, cache, stored

    def prefill(total: int) -> None:  # requests of 512 tokens
        batch, seq = total // 512, 512
        cache = KVCache.zeros(config, batch, seq, jnp.bfloat16)
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        lora = random_lora(config, 16)
        slots = jnp.repeat(jnp.arange(batch) % SLOTS, seq).astype(jnp.int32)
        cases = {"base": (None, jnp.full(total, -1, jnp.int32), jnp.zeros(SLOTS, jnp.int32)),
                 "lora": (lora, slots, jnp.full(SLOTS, 16, jnp.int32))}
        times, cache, gpu = timed({case: model_step(model_def, params, tokens, positions, *args, 64)
                                   for case, args in cases.items()}, cache)
        secs = {case: statistics.median(t) for case, t in times.items()}
        record("prefill", batch, total, 0, 0, secs["base"], secs["base"], gpu=gpu)
        record("prefill", batch, total, 16, min(batch, SLOTS), secs["lora"], secs["base"], lora, gpu=gpu)
        del lora, cache

    # The target row (batch 32) first, then prefill, then the other batch sizes, so a run cut short by a
    # time limit keeps the most important figures (every row is saved as it is measured).
    try:
        if 32 in batches:
            decode(32)
            for total in (2048,) if args.quick else (2048, 8192):
                prefill(total)
        for batch in [b for b in batches if b != 32]:
            decode(batch)
    finally:
        monitor.close()


def earlier_rows(path: str, device: str, batches: tuple[int, ...], layers: int,
                 backend: str) -> tuple[list[dict], list[dict]]:
    """(the processes, the rows) that `--add`'s result `path` gives a run of `batches` on `device`: its rows of the
    decode batches this run does not time, and its prefill rows unless this run times batch 32 (which runs them).
    Exits with a message where `path` is no bench/model.py result or was measured on another kind of card, model
    depth or LoRA backend (a file without one: "auto"), whose rows would not belong in one table."""
    results = read_model_results(path)
    if results is None or len(results) != 1:
        raise SystemExit(f"--add {path}: not one bench/model.py result")
    (result,) = results
    their_device, their_layers, their_backend = result["device"], result.get("layers"), result.get("backend", "auto")
    if (their_device, their_layers, their_backend) != (device, layers, backend):
        raise SystemExit(f"--add {path}: measured on {their_device} with {their_layers} layers and backend "
                         f"{their_backend}; this run is on {device} with {layers} and {backend}")
    rows = [r for r in result["rows"] if r["kind"] == "decode"]
    keep = [r for r in result["rows"] if (r["batch"] not in batches if r["kind"] == "decode" else 32 not in batches)]
    processes = result.get("processes") or [{"copy_bandwidth_Bps": result["copy_bandwidth_Bps"],
                                             "gpu": result.get("gpu"), "batches": sorted({r["batch"] for r in rows})}]
    kept = {r["batch"] for r in keep if r["kind"] == "decode"}
    processes = [dict(p, batches=[b for b in p["batches"] if b in kept]) for p in processes
                 if kept.intersection(p["batches"])]  # a process whose every row this run times again goes
    print(f"# from {path}: {len(keep)} rows of {len(result['rows'])}", flush=True)
    return processes, keep


def with_features(config: ModelConfig, lora: LoRAWeights, kind: str) -> LoRAWeights:
    """`lora` with every slot using a feature: "dora" (a column scale on every projection and the lm_head),
    "bias" (a column shift there) or "rows" (256 embedding and lm_head rows, as added tokens)."""
    keys = iter(jax.random.split(jax.random.key(2), 4096))
    widths = {g: sum(n for _, n in outs) for g, (_, outs) in module_shapes(config).items()}
    near_one = lambda n: 1 + 0.1 * jax.random.normal(next(keys), (SLOTS, n), jnp.float32)
    small = lambda n: 0.01 * jax.random.normal(next(keys), (SLOTS, n), jnp.float32)
    if kind == "rows":
        e, h, v = 256, config.hidden_size, config.vocab_size
        ids = jnp.broadcast_to(jnp.arange(v, v + e, dtype=jnp.int32), (SLOTS, e))
        rows = (0.02 * jax.random.normal(next(keys), (SLOTS, e, h), jnp.float32)).astype(jnp.bfloat16)
        return dataclasses.replace(lora, rows=RowOverrides(ids, rows, ids, rows))
    make, field = (near_one, "scale") if kind == "dora" else (small, "shift")
    layers = tuple(dataclasses.replace(layer, **{field: {g: make(n) for g, n in widths.items()}})
                   for layer in lora.layers)
    return dataclasses.replace(lora, layers=layers, **{f"lm_head_{field}": make(config.vocab_size)})


def features(config, model_def, params, device, out_dir, batch: int = 32, prefill_tokens: int = 2048) -> None:
    """Batch-32 decode and a 2048-token prefill with 32 r=16 adapters, each adapter plain LoRA, DoRA, LoRA bias
    or with added-token rows, timed in alternating rounds in one process; rows to model_features.json."""
    rng = np.random.default_rng(0)
    lora = random_lora(config, 16)
    variants = {"lora": lora, **{kind: with_features(config, lora, kind) for kind in ("dora", "bias", "rows")}}
    ranks = jnp.full(SLOTS, 16, jnp.int32)
    rows = []
    for kind, seq, n in (("decode", 1, batch), ("prefill", 512, prefill_tokens // 512)):
        cache = KVCache.zeros(config, n, max(2 * CONTEXT, seq), jnp.bfloat16)
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (n, seq)), jnp.int32)
        positions = (jnp.full((n, 1), CONTEXT, jnp.int32) if seq == 1
                     else jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (n, seq)))
        slots = jnp.repeat(shuffled_slots(n, SLOTS, rng), seq)
        runs = {"base": model_step(model_def, params, tokens, positions, None, jnp.full(n * seq, -1, jnp.int32),
                                   jnp.zeros(SLOTS, jnp.int32), 16 if seq == 1 else 64)}
        runs |= {name: model_step(model_def, params, tokens, positions, w, slots, ranks, 16 if seq == 1 else 64)
                 for name, w in variants.items()}
        times, cache = time_alternating(runs, cache)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        for name, value in ms.items():
            rows.append(dict(kind=kind, batch=n, tokens=n * seq, adapters=SLOTS, variant=name, ms=value,
                             vs_lora=value / ms["lora"], vs_base=value / ms["base"]))
            print(f"{kind:7s} B={n:3d} T={n * seq:5d} {name:5s} {value:8.3f} ms  x{value / ms['lora']:5.3f} of plain "
                  f"LoRA  x{value / ms['base']:5.2f} of base", flush=True)
        del cache
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "model_features.json"), "w") as f:
        json.dump({"device": device, "layers": config.num_layers, "rows": rows}, f, indent=1)


def setup(config, model_def, params, degree: int, rank: int = 16, batch: int = 32):
    """Decode inputs of `batch` rows at one TP degree: (model_def, params, cache, tokens, positions, cases, tp),
    with cases = {"base": (None, slots, ranks), "lora": (LoRA weights, slots, ranks)} (request i on slot i % 32),
    the weights in `engine_layout`.

    Under TP every input is placed on the mesh first (the small ones replicated), so steps time the model,
    not a copy of uncommitted inputs from device 0 to the others on every call.
    """
    g, st = engine_layout(model_def, params, batch)
    if degree > 1:
        model = g.merge(st)
        tp = TensorParallel.create(model.config, degree)
        g, st = ModelDef.split(*tp.shard_model(model))
    else:
        tp = None
    layout = config if tp is None else tp.layout
    lora = random_lora(layout, rank)
    lora = lora if tp is None else tp.shard_lora(lora)
    cache = KVCache.zeros(layout, batch, 2 * CONTEXT, jnp.bfloat16)
    cache = cache if tp is None else jax.device_put(cache, tp.cache_sharding())
    place = (lambda x: x) if tp is None else (lambda x: jax.device_put(x, tp.replicated()))
    tokens = place(jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, 1)), jnp.int32))
    positions = place(jnp.full((batch, 1), CONTEXT, jnp.int32))
    cases = {"base": (None, place(jnp.full(batch, -1, jnp.int32)), place(jnp.zeros(SLOTS, jnp.int32))),
             "lora": (lora, place(jnp.arange(batch, dtype=jnp.int32) % SLOTS), place(jnp.full(SLOTS, rank, jnp.int32)))}
    return g, st, cache, tokens, positions, cases, tp


# Kernel classes of a profile, by name: cuBLAS / CUTLASS / XLA GEMMs and jlora's small projections
# (`jlora.pallas.projections`), the Pallas decode attention, the rest (norms, RoPE, elementwise, the gather backend's
# LoRA fusions, sampling, copies).
KERNEL_CLASSES = (("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "jlora_matmul")),
                  ("attention", ("decode_attention",)))


def kernel_class(name: str) -> str:
    lower = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in lower for k in keys)), "other")


def busy_union(events) -> float:
    """µs in which at least one kernel runs (kernels on concurrent streams counted once)."""
    total, end = 0.0, float("-inf")
    for _, ts, dur, _, _ in sorted(events, key=lambda e: e[1]):
        if ts + dur > end:
            total += ts + dur - max(ts, end)
            end = ts + dur
    return total


def profile(config, model_def, params, degree: int, batches: tuple[int, ...], bandwidth: float, device: str,
            path: str, rank: int = 16) -> None:
    """Decode steps at each batch size of `batches` with 0, 1 and 32 distinct adapters of `rank` on every module, at
    one TP degree: wall time per step; the GPU's time busy (any kernel running) and idle; kernel time by class
    (GEMMs, decode attention, the rest) with the GEMMs' bandwidth over the weight bytes and the attention's over
    the KV bytes; the floor (weights + KV at the copy bandwidth); the kernels that take the most time; a layer
    timeline. Rows go to the JSON at `path`."""
    rows = []
    for batch in batches:
        g, st, cache, tokens, positions, cases, tp = setup(config, model_def, params, degree, rank, batch)
        chunk = engine_config(batch, degree).attention_chunk(config.num_kv_heads)
        lw, slots, ranks = cases["lora"]
        weights, kv_read = weight_bytes(config) / degree, kv_bytes(config, batch) / degree  # per device
        floor = (weights + kv_read) / bandwidth
        for adapters, (lora, sl, rk) in ((0, cases["base"]), (1, (lw, jnp.zeros_like(slots), ranks)),
                                         (SLOTS, (lw, slots, ranks))):
            if adapters > batch:
                continue
            sec, dispatch, cache = time_steps(g, st, tokens, positions, cache, lora, sl, rk, 16, tp, chunk)
            run = model_step(g, st, tokens, positions, lora, sl, rk, 16, tp, chunk)

            def steps():
                nonlocal cache
                for _ in range(STEPS):
                    logits, cache = run(cache)
                return logits, cache

            events = trace_events(steps)
            if not events:
                print(f"batch {batch} adapters {adapters}: no GPU kernels in the trace (a GPU is needed)")
                continue
            per_step = STEPS * degree
            by_class: dict[str, list[float]] = {}
            for e in events:
                by_class.setdefault(kernel_class(e[4]), []).append(e[2])
            span = (max(e[1] + e[2] for e in events) - min(e[1] for e in events)) / STEPS  # per step, one GPU
            busy = busy_union([e for e in events if e[0] == events[0][0]]) / STEPS
            row = dict(batch=batch, adapters=adapters, rank=rank, tp=degree, wall_ms=sec * 1e3,
                       dispatch_ms=dispatch * 1e3, trace_span_ms=span / 1e3, busy_ms=busy / 1e3,
                       idle_ms=(span - busy) / 1e3, floor_ms=floor * 1e3, vs_floor=sec / floor,
                       kernels=sum(map(len, by_class.values())) / per_step)
            for c in ("gemm", "attention", "other"):
                row[f"{c}_ms"] = sum(by_class.get(c, [])) / per_step / 1e3
                row[f"{c}_kernels"] = len(by_class.get(c, [])) / per_step
            row["gemm_TBps"] = weights / (row["gemm_ms"] * 1e-3) / 1e12 if row["gemm_ms"] else None
            row["attention_TBps"] = (kv_read / (row["attention_ms"] * 1e-3) / 1e12 if row["attention_ms"]
                                     else None)
            rows.append(row)
            print(f"PROFILE batch {batch} adapters {adapters}: wall {row['wall_ms']:.2f} ms (floor {row['floor_ms']:.2f},"
                  f" x{row['vs_floor']:.2f}; host dispatch {row['dispatch_ms']:.2f}); GPU busy {row['busy_ms']:.2f} / "
                  f"idle {row['idle_ms']:.2f} ms of the traced step; kernels {row['kernels']:.0f}: GEMM "
                  f"{row['gemm_ms']:.2f} ms ({row['gemm_TBps'] or 0:.2f} TB/s over the weights), attention "
                  f"{row['attention_ms']:.2f} ms ({row['attention_TBps'] or 0:.2f} TB/s over the KV), other "
                  f"{row['other_ms']:.2f} ms in {row['other_kernels']:.0f} kernels", flush=True)
            kernels = kernel_durations(events)
            for kname, d in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:25]:
                print(f"  {sum(d) / per_step / 1e3:7.3f} ms  x{len(d) / per_step:5.0f}  {sum(d) / len(d):8.1f} µs  "
                      f"{kernel_class(kname):9s} {kname[:80]}", flush=True)
            if batch == max(batches):
                layer_timeline(events, config.num_layers)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:  # after every case
                json.dump({"device": device, "copy_bandwidth_Bps": bandwidth, "context": CONTEXT,
                           "weight_bytes": weight_bytes(config), "rows": rows}, f, indent=1)
        del cases, cache, st, lw


def layer_timeline(events, num_layers: int, mark: str = "decode_attention") -> None:
    """Per GPU, the layer spans of the trace's last step (from one decode-attention kernel to the next) against
    the kernel time of the layer's main stream, and the kernels of its middle layer with start, end and stream:
    where a layer's time goes beyond its kernels (GEMMs slowed by concurrent kernels, the joins of concurrent
    branches, collectives and the gaps around them)."""
    for gpu in sorted({e[0] for e in events}):
        ks = [e for e in events if e[0] == gpu]
        starts = [i for i, e in enumerate(ks) if mark in e[4]][-num_layers:]  # the last step's layers
        if len(starts) < 3:
            return  # no decode-attention kernel to mark layers (XLA's attention off GPU)
        spans = [ks[j][1] - ks[i][1] for i, j in zip(starts, starts[1:])]
        first, end = starts[len(starts) // 2], starts[len(starts) // 2 + 1]
        main = ks[first][3]
        busy = sum(e[2] for e in ks[starts[0]:starts[-1]] if e[3] == main) / (len(starts) - 1)
        print(f"  GPU {gpu}: layer span median {statistics.median(spans):.1f} µs, main stream busy {busy:.1f} µs per "
              f"layer; layer {len(starts) // 2} of the last step (start, end, µs, stream, kernel):", flush=True)
        t0 = ks[first][1]
        for _, ts, dur, stream, name in ks[first:end + 1]:
            print(f"    {ts - t0:7.1f} {ts - t0 + dur:7.1f} {dur:6.1f}  s{stream:<5} {name[:70]}", flush=True)


def tensor_parallel(config, model_def, params, degrees, bandwidth, device, out_dir) -> None:
    """Batch-32 decode of the base model and with 32 distinct r=16 adapters at each TP degree."""
    batch, rank, rows = 32, 16, []
    os.makedirs(out_dir, exist_ok=True)
    for degree in degrees:
        g, st, cache, tokens, positions, cases, tp = setup(config, model_def, params, degree, rank)
        chunk = engine_config(batch, degree).attention_chunk(config.num_kv_heads)
        base, base_dispatch, cache = time_steps(g, st, tokens, positions, cache, *cases["base"], 16, tp, chunk)
        sec, dispatch, cache = time_steps(g, st, tokens, positions, cache, *cases["lora"], 16, tp, chunk)
        lora = cases["lora"][0]
        floor = base + adapter_bytes(lora, SLOTS, batch) / (degree * bandwidth)
        rows.append(dict(tp=degree, base_ms=base * 1e3, lora_ms=sec * 1e3, base_dispatch_ms=base_dispatch * 1e3,
                         lora_dispatch_ms=dispatch * 1e3, base_tokens_per_s=batch / base,
                         lora_tokens_per_s=batch / sec, lora_overhead=sec / base, lora_vs_floor=sec / floor))
        r = rows[-1]
        print(f"TP={degree}: base {r['base_ms']:.2f} ms ({r['base_tokens_per_s']:.0f} tok/s), 32 adapters r=16 "
              f"{r['lora_ms']:.2f} ms ({r['lora_tokens_per_s']:.0f} tok/s), LoRA x{r['lora_overhead']:.2f} of base, "
              f"x{r['lora_vs_floor']:.2f} of floor; speed-up vs TP=1 {rows[0]['lora_ms'] / r['lora_ms']:.2f}x "
              f"(base {rows[0]['base_ms'] / r['base_ms']:.2f}x); host dispatch per step {r['base_dispatch_ms']:.2f} / "
              f"{r['lora_dispatch_ms']:.2f} ms", flush=True)
        del lora, cases, cache, st
        with open(os.path.join(out_dir, "model_tp.json"), "w") as f:  # after every degree: a cut run keeps them
            json.dump({"device": device, "copy_bandwidth_Bps": bandwidth, "rows": rows}, f, indent=1)


def engine_throughput(config, model_def, params, bandwidth, device, out_dir, degree: int = 1, prompt_len: int = 128,
                      new_tokens: int = 128, rank: int = 16) -> None:
    """`Engine.generate` for 32 requests (prompts of `prompt_len` random tokens, `new_tokens` greedy tokens
    each), base model and 32 r=16 adapter slots (one random adapter loaded through the PEFT path under 32
    names: 32 weight stacks, read as distinct adapters are), on `degree` GPUs: decode ms
    per step (the time of a `new_tokens` run less that of a 1-token run, which is the prefill, over the extra
    steps) against the bare jitted step at the same batch and mid-generation position, which sets the pace
    the engine can reach."""
    batch, rows = 32, []
    engine = Engine(model_def.merge(params), max_loras=SLOTS, max_lora_rank=rank, dtype=jnp.bfloat16,
                    max_batch=batch, max_seq_len=prompt_len + new_tokens, tensor_parallel=degree)
    with tempfile.TemporaryDirectory() as adapter_dir:  # one random adapter, loaded into every slot
        write_adapter(adapter_dir, llama3_8b_hf(config.num_layers), r=rank, alpha=2 * rank, seed=0, target_modules=LINEAR_MODULES)
        for i in range(SLOTS):
            engine.load_adapter(f"a{i}", adapter_dir)
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt_len)).tolist()
    cache = engine.runner.new_cache(batch, bucket(prompt_len + new_tokens, 16))
    tokens = np.zeros((batch, 1), np.int32)  # host arrays, as the engine passes them
    positions = np.full((batch, 1), prompt_len + new_tokens // 2, np.int32)
    for name, adapters, lora, slots in (
            ("base", [None] * batch, None, np.full(batch, -1, np.int32)),
            (f"{SLOTS} adapters r={rank}", [f"a{i}" for i in range(batch)], engine.pool.weights,
             np.arange(batch, dtype=np.int32) % SLOTS)):
        def run(n: int) -> float:
            t0 = time.perf_counter()
            out = engine.generate(prompts, adapters, max_new_tokens=n)
            assert all(len(o) == n for o in out), "a request stopped early"
            return time.perf_counter() - t0

        run(new_tokens)  # compiles the buckets and warms up: after a 2-token warm-up, TP=2 runs timed 5x slow
        prefill = statistics.median(run(1) for _ in range(3))
        total = statistics.median(run(new_tokens) for _ in range(3))
        step = (total - prefill) / (new_tokens - 1)
        bare, _, cache = time_steps(engine.runner.model_def, engine.runner.params, tokens, positions, cache, lora, slots,
                                    engine.pool.ranks.copy(), 16, engine.runner.tp)
        rows.append(dict(case=name, tp=degree, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                         engine_step_ms=step * 1e3, bare_step_ms=bare * 1e3, engine_vs_bare=step / bare,
                         decode_tokens_per_s=batch / step, generate_s=total))
        print(f"engine TP={degree} {name}: {step * 1e3:.2f} ms per decode step ({batch / step:.0f} tok/s), "
              f"bare jitted step {bare * 1e3:.2f} ms: engine x{step / bare:.2f}; "
              f"generate({batch} x {new_tokens} tokens) {total:.2f} s", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"model_engine{'' if degree == 1 else f'_tp{degree}'}.json"), "w") as f:
        json.dump({"device": device, "copy_bandwidth_Bps": bandwidth, "rows": rows}, f, indent=1)


def plot(rows, path: str, device: str) -> None:
    """Decode tokens/s against batch, a line per rank and adapter count (rows come in the run's batch order)."""
    plt = pyplot()
    if plt is None:
        return
    dec = [r for r in rows if r["kind"] == "decode"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for (rank, adapters) in sorted({(r["rank"], r["adapters"]) for r in dec}):
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in dec if (r["rank"], r["adapters"]) == (rank, adapters))
        label = "base" if not rank else f"r={rank}, {adapters} adapter{'s' * (adapters > 1)}"
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Llama-3-8B shape decode on {device}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
