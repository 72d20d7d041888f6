"""Decode attention split over chunks of positions (`decode_attention(..., chunk=256)`, the engine's
`split_attention`) against one program per request and KV head, for #39: the unsplit kernel runs B x 8 programs
of the 8B shape, 8 at batch 1 on 132 SMs, each walking its request's context in series.

Kernels: device time per layer, its combine kernel included, over `LAYERS` layers with distinct caches, each
layer's query the output of the layer before (so every layer's combine is a kernel of its own, as in the model),
and the KV bytes the requests can see over that time; contiguous caches and paged ones (16-position blocks in a
random order). Each split output is checked against the unsplit one (‖out − ref‖ / ‖ref‖ < 1e-2) first.
Chunks as the engine takes them (`split_chunk` of the cache's positions). Model: the 8B-shaped base decode step
(`bench/model.py`'s model) at batch 1-16 over a contiguous cache and a paged one, split and unsplit in
alternating rounds. JSON: split_attention.json, written after each row. The LoRA decode cases the other decode
studies time come from here too (`lora_decodes`, and `time_lora_decodes`, which times each against its variants).

  python bench/studies/split_attention.py [--batches 1,2,4,8,16,32] [--model-batches 1,4,8,16] [--out DIR]  # GPU
  python bench/studies/split_attention.py --smoke                  # CPU, interpret mode, one small case
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import time_variants, trace_kernels, variants_row  # noqa: E402
from model import (SLOTS, engine_config, engine_layout, llama3_8b, random_lora, random_model,  # noqa: E402
                   shuffled_slots, time_alternating)

from jlora.models.llama import Batch, KVCache  # noqa: E402
from jlora.models.lora_weights import LoRAWeights  # noqa: E402
from jlora.pallas.decode_attention import decode_attention, paged_decode_attention, split_chunk  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402
from jlora.runner import ModelDef, forward  # noqa: E402

KV, GROUPS, HEAD_DIM, LAYERS, PAGE = 8, 4, 128, 32, 16
CONTEXTS = [(1024, 512), (4096, 4000), (16384, 16000)]  # (cache positions, query position)
CACHE_BUDGET = 24 << 30  # bytes of K and V over all layers of one case: fewer layers above it


def attention_case(batch: int, max_seq: int, pos: int, paged: bool, layers: int):
    """(q, ks, vs, attend) of `batch` requests at position `pos`: `layers` random caches of `max_seq` positions a
    request, contiguous rows or `PAGE`-position blocks in a random order, and `attend(q, k, v, chunk=...)`."""
    key = jax.random.key(batch * max_seq)
    rows = batch if not paged else batch * (max_seq // PAGE)
    shape = (rows, KV, max_seq, HEAD_DIM) if not paged else (rows, KV, PAGE, HEAD_DIM)
    ks = [jax.random.normal(jax.random.fold_in(key, 2 * i), shape, jnp.bfloat16) for i in range(layers)]
    vs = [jax.random.normal(jax.random.fold_in(key, 2 * i + 1), shape, jnp.bfloat16) for i in range(layers)]
    q = jax.random.normal(jax.random.fold_in(key, 2 * layers), (batch, KV, GROUPS, HEAD_DIM), jnp.bfloat16)
    positions = jnp.full((batch,), pos, jnp.int32)
    if paged:
        where = jnp.asarray(np.random.default_rng(0).permutation(rows).reshape(batch, -1), jnp.int32)
        attend = functools.partial(paged_decode_attention, positions=positions, tables=where)
    else:
        attend = functools.partial(decode_attention, positions=positions, rows=jnp.arange(batch, dtype=jnp.int32))
    return q, ks, vs, attend


def chain(q, ks, vs, fn):
    """`fn` over each layer's cache in turn, each layer's query the output of the layer before."""
    for k, v in zip(ks, vs):
        q = fn(q, k, v)
    return q


def kernel_rows(batch: int, max_seq: int, pos: int, paged: bool, layers: int) -> list[dict]:
    q, ks, vs, attend = attention_case(batch, max_seq, pos, paged, layers)
    out = []
    ref = attend(q, ks[0], vs[0]).astype(jnp.float32)
    kv_bytes = 2 * KV * HEAD_DIM * 2 * batch * (pos + 1)
    for split in (False, True):
        fn = functools.partial(attend, chunk=split_chunk(max_seq, PAGE if paged else 0) if split else None)
        error = float(jnp.linalg.norm(fn(q, ks[0], vs[0]).astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        if error >= 1e-2:
            raise AssertionError(f"B={batch} max_seq={max_seq} paged={paged} split: relative error {error:.3g}")
        row = dict(batch=batch, max_seq=max_seq, position=pos, paged=paged, split=split, layers=layers, error=error)
        if jax.default_backend() == "gpu":
            run = jax.jit(functools.partial(chain, fn=fn))
            jax.block_until_ready(run(q, ks, vs))
            kernels = trace_kernels(lambda: run(q, ks, vs))
            row["us_per_layer"] = sum(sum(d) for d in kernels.values()) / layers
            row["kernels_per_layer"] = sum(map(len, kernels.values())) / layers
            row["TBps"] = kv_bytes / row["us_per_layer"] / 1e6
        out.append(row)
    return out


def base_decode(config, batch: int, max_seq: int, pos: int, paged: bool) -> tuple[KVCache, Call]:
    """(cache, call) of a base decode step: `batch` requests at position `pos` over a zero cache of `max_seq`
    positions a request, contiguous rows or `PAGE`-position blocks in a random order."""
    tables = None
    if paged:
        cache = KVCache.zeros(config, batch * max_seq // PAGE, PAGE, jnp.bfloat16)
        tables = jnp.asarray(np.random.default_rng(0).permutation(batch * max_seq // PAGE).reshape(batch, -1),
                             jnp.int32)
    else:
        cache = KVCache.zeros(config, batch, max_seq, jnp.bfloat16)
    call = Call(Batch.of(jnp.ones((batch, 1), jnp.int32), jnp.full((batch, 1), pos, jnp.int32), tables=tables),
                jnp.full(batch, -1, jnp.int32), jnp.zeros(1, jnp.int32))
    return cache, call


@dataclasses.dataclass(frozen=True)
class LoRADecode:
    """A 'BxRxA' decode case of the 8B step: `adapters` adapters of rank `rank` (`lora`) over `batch` requests at
    position 512 of rows of 1024, their slots shuffled over the rows (`call`, `cache`); the model's weights as that
    batch's engine stores them (`model_def`, `params`: `engine_layout`) and its options (`engine_config`'s attention
    split, the LoRA `backend`)."""

    batch: int
    rank: int
    adapters: int
    model_def: ModelDef
    params: list[jax.Array]
    cache: KVCache
    call: Call
    options: StepOptions
    lora: LoRAWeights


def lora_decodes(config, model_def, params, cases: str, backend: str = "auto"):
    """Each of `cases` ('BxRxA', comma-separated) as a `LoRADecode`, one random set of adapters per rank."""
    loras = {}
    for case in filter(None, cases.split(",")):
        batch, rank, used = map(int, case.split("x"))
        lora = loras.setdefault(rank, random_lora(config, rank))
        stored_def, stored = engine_layout(model_def, params, batch)
        cache, call = base_decode(config, batch, 1024, 512, False)
        call = Call(call.batch, shuffled_slots(batch, used), jnp.full(SLOTS, rank, jnp.int32))
        options = StepOptions(16, backend, attention_chunk=engine_config(batch).attention_chunk(config.num_kv_heads))
        yield LoRADecode(batch, rank, used, stored_def, stored, cache, call, options, lora)
        del stored_def, stored, cache, call  # a batch-1 layout's weight copies go before the next case's


def time_lora_decodes(cases: str, patches: dict, *, backend: str = "auto", record=None, **extra) -> None:
    """The 8B decode step of each of `cases` (`lora_decodes`' 'BxRxA') compiled once per entry of `patches` (a name
    -> a context manager factory inside which that variant's step traces, or None: as shipped), timed in
    alternating rounds (`time_variants`), the first the logits' reference; each case's row printed
    (`variants_row`, with the case's batch, rank and adapters and `extra`) and given to `record` where one is."""
    config = llama3_8b(LAYERS)
    model_def, params = random_model(config)
    for case in lora_decodes(config, model_def, params, cases, backend):
        got, _ = time_variants(case.params, case.call, case.cache, case.lora, {
            name: (case.model_def if patch is None else copy.copy(case.model_def), case.options, patch)
            for name, patch in patches.items()})
        row = variants_row(f"decode B={case.batch}, {case.adapters} r={case.rank}", got, batch=case.batch,
                           rank=case.rank, adapters=case.adapters, **extra)
        if record is not None:
            record(row)
        del case


def model_rows(model_def, params, batches: list[int], max_seq: int, pos: int, paged: bool) -> list[dict]:
    """The 8B base decode step at each batch, split and unsplit, in alternating rounds."""
    config = llama3_8b(LAYERS)
    rows, chunk = [], split_chunk(max_seq, PAGE if paged else 0)
    for batch in batches:
        cache, call = base_decode(config, batch, max_seq, pos, paged)
        runs = {split: (lambda c, split=split: forward(
            model_def, params, call, c, None, StepOptions(16, "auto", attention_chunk=chunk if split else None)))
                for split in (False, True)}
        times, cache = time_alternating(runs, cache)
        ms = {split: statistics.median(t) * 1e3 for split, t in times.items()}
        rows.append(dict(batch=batch, max_seq=max_seq, position=pos, paged=paged, step_ms=ms[False],
                         split_step_ms=ms[True], ratio=ms[True] / ms[False]))
        print(f"model B={batch:2d} max_seq={max_seq} pos={pos} {'paged' if paged else 'rows '}: unsplit {ms[False]:.3f} ms, split {ms[True]:.3f} ms "
              f"({ms[True] / ms[False]:.3f}x)", flush=True)
        del cache
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one small case (interpret mode on CPU), no model")
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="the kernel cases' batch sizes ('' for none)")
    parser.add_argument("--model-batches", default="1,4,8,16,32", help="the model step's batch sizes ('' for none)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    print(f"# {device}", flush=True)
    result = {"device": device, "kernels": [], "model": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "split_attention_smoke.json" if args.smoke else "split_attention.json")

    def save() -> None:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    cases = [(2, 512, 300, paged) for paged in (False, True)] if args.smoke else [
        (b, n, p, paged) for n, p in CONTEXTS for b in map(int, filter(None, args.batches.split(","))) for paged in (False, True)]
    for batch, max_seq, pos, paged in cases:
        per_layer = 2 * batch * KV * max_seq * HEAD_DIM * 2
        layers = 1 if args.smoke else min(LAYERS, CACHE_BUDGET // per_layer)
        if layers < 4 and not args.smoke:
            continue
        rows = kernel_rows(batch, max_seq, pos, paged, layers)
        result["kernels"] += rows
        save()
        if "us_per_layer" in rows[0]:
            a, b = rows
            print(f"B={batch:2d} max_seq={max_seq:5d} pos={pos:5d} {'paged' if paged else 'rows '}: unsplit "
                  f"{a['us_per_layer']:7.1f} µs ({a['TBps']:.2f} TB/s), split {b['us_per_layer']:7.1f} µs "
                  f"({b['TBps']:.2f} TB/s, {b['kernels_per_layer']:.0f} kernels): {b['us_per_layer'] / a['us_per_layer']:.2f}x",
                  flush=True)
    if args.smoke or not args.model_batches:
        return
    model_def, params = random_model(llama3_8b(LAYERS))
    for max_seq, pos in ((1024, 512), (4096, 4000)):
        for paged in (True, False):
            result["model"] += model_rows(model_def, params, [int(b) for b in args.model_batches.split(",")],
                                          max_seq, pos, paged)
            save()


if __name__ == "__main__":
    main()
