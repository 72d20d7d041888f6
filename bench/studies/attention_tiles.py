"""The decode attention kernel's launch parameters (#39): cache positions per key block (`block_t`), key blocks
loaded per loop step (`step_blocks`), Triton's warps per program (2, 4, 8) and pipeline stages, swept over the
8B shape (8 KV heads of 4 query heads, head_dim 128) at the batches and contexts the model step runs, over
contiguous rows and over the paged cache (16-position blocks in a random order), unsplit and split as the engine
splits (`split_chunk`).

Each case: device µs per layer over layers with distinct caches, each layer's query the layer before's output
(as in the model), as many layers as make their caches 4x the 50 MB L2 (at least 8), so no run finds a layer's
keys still in L2 from the run before; and the visible KV bytes over that time; every setting's output is checked
against the shipped setting's (‖out − ref‖ / ‖ref‖ < 1e-2) first, and whether its bits equal them is recorded
(≠ in the printed line where not). A setting that does not compile (shared memory) is recorded as such. JSON:
attention_tiles.json, written after each case.

A key block adopted must be one for every batch of an engine: it sets the online softmax's order of operations,
so a request's bits alone and in a batch stay equal only when every batch size runs the same one. The blocks a
step loads, the warps and the stages may follow the grid where their bits are equal (the shipped ones do:
`decode_attention._stages` and `_step_blocks`).

Model (`--model-batches`): the 8B-shaped base decode step (`bench/model.py`'s model, context 1024 with the query
at 512 unless `--model-context` says otherwise) as shipped against the step with one of the kernel's grid rules
replaced (`--model-variant`: three stages at every grid, one key block a loop step, or two warps), in
alternating rounds, over rows and over the paged cache split as the engine splits it.

  python bench/studies/attention_tiles.py [--cases rows,paged,split] [--model-batches 32,64,128]
      [--model-variant stages|step_blocks|warps] [--model-context 4096/4000] [--model-layouts paged] [--out DIR]  # GPU
  python bench/studies/attention_tiles.py --smoke                                  # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import patched_model, trace_kernels  # noqa: E402
from model import llama3_8b, random_model, time_alternating  # noqa: E402
from split_attention import GROUPS, HEAD_DIM, KV, PAGE, base_decode  # noqa: E402

from jlora.pallas.decode_attention import _call, _kernel, _paged_kernel, split_chunk  # noqa: E402
from jlora.runner import forward  # noqa: E402
from jlora.step import StepOptions  # noqa: E402

MIN_LAYERS, CACHES_BYTES = 8, 200 << 20  # the layers' caches together: 4x the H100 / H200's 50 MB L2
# None: the kernel's rules of the grid (decode_attention._warps, _stages, and _step_blocks over pages; one over rows)
SHIPPED = dict(block_t=64, num_warps=None, num_stages=None, step_blocks=None)
SETTINGS = [dict(block_t=b, num_warps=w, num_stages=s, step_blocks=n)
            for b, w, s, n in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2, 4)) if b * n <= 256]
ATTENTION = importlib.import_module("jlora.pallas.decode_attention")  # the module: jlora.pallas names the function
CASES = {  # layout -> (batch, cache positions, query position)
    "rows": [(1, 1024, 512), (8, 1024, 512), (16, 1024, 512), (32, 1024, 512), (64, 1024, 512), (128, 1024, 512),
             (32, 4096, 4000)],
    "paged": [(16, 1024, 512), (32, 1024, 512), (64, 1024, 512), (128, 1024, 512), (32, 4096, 4000)],
    "split": [(1, 1024, 512), (8, 1024, 512), (16, 1024, 512), (32, 1024, 512), (64, 1024, 512),
              (1, 4096, 4000), (32, 4096, 4000)],  # paged, split as the engine splits
}


def label(setting: dict) -> str:
    """block_t/warps/stages/step_blocks, as `--settings` names a setting."""
    return "/".join(str(setting[k]) for k in ("block_t", "num_warps", "num_stages", "step_blocks"))


def attention(layout: str, batch: int, max_seq: int, pos: int):
    """(fn(q, k, v, **setting), caches' shape, the call's extra arrays) for one case."""
    positions = jnp.full((batch,), pos, jnp.int32)
    if layout == "rows":
        def fn(q, k, v, *, block_t, step_blocks, **launch):  # step_blocks None: one, as decode_attention
            return _call(_kernel, "decode_attention", q, positions, jnp.arange(batch, dtype=jnp.int32), k, v,
                         block_t=block_t, window=None, chunk=None, limit=max_seq, step_blocks=step_blocks or 1,
                         **launch)
        return fn, (batch, KV, max_seq, HEAD_DIM)
    blocks = batch * max_seq // PAGE
    tables = jnp.asarray(np.random.default_rng(0).permutation(blocks).reshape(batch, -1), jnp.int32)
    chunk = split_chunk(max_seq, PAGE) if layout == "split" else None

    def fn(q, k, v, *, block_t, **launch):
        return _call(functools.partial(_paged_kernel, page=PAGE), "paged_decode_attention", q, positions,
                        tables, k.reshape(-1, HEAD_DIM), v.reshape(-1, HEAD_DIM), block_t=block_t, window=None,
                        chunk=chunk, limit=max_seq, **launch)
    return fn, (blocks, KV, PAGE, HEAD_DIM)


def case_rows(layout: str, batch: int, max_seq: int, pos: int, layers: int, settings: list[dict]) -> list[dict]:
    fn, shape = attention(layout, batch, max_seq, pos)
    key = jax.random.key(batch * max_seq)
    ks = [jax.random.normal(jax.random.fold_in(key, 2 * i), shape, jnp.bfloat16) for i in range(layers)]
    vs = [jax.random.normal(jax.random.fold_in(key, 2 * i + 1), shape, jnp.bfloat16) for i in range(layers)]
    q = jax.random.normal(jax.random.fold_in(key, 2 * layers), (batch, KV, GROUPS, HEAD_DIM), jnp.bfloat16)
    ref = jax.jit(functools.partial(fn, **SHIPPED))(q, ks[0], vs[0]).astype(jnp.float32)
    kv_bytes = 2 * KV * HEAD_DIM * 2 * batch * (pos + 1)
    rows = []
    for setting in settings:
        row = dict(layout=layout, batch=batch, max_seq=max_seq, position=pos, layers=layers, **setting,
                   shipped=setting == SHIPPED)
        one = jax.jit(functools.partial(fn, **setting))
        try:
            out = one(q, ks[0], vs[0]).astype(jnp.float32)
        except Exception as err:  # noqa: BLE001 - a setting past the shared memory fails to compile
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            rows.append(row)
            continue
        row["rel_error"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        row["bit_equal"] = bool(jnp.array_equal(out, ref))
        if row["rel_error"] >= 1e-2:
            raise AssertionError(f"{row}: relative error {row['rel_error']:.3g} against the shipped setting")

        def chain(q, ks, vs):
            for k, v in zip(ks, vs):
                q = fn(q, k, v, **setting)
            return q

        if jax.default_backend() == "gpu":
            run = jax.jit(chain)
            jax.block_until_ready(run(q, ks, vs))
            kernels = trace_kernels(lambda: run(q, ks, vs))
            row["us_per_layer"] = sum(sum(d) for d in kernels.values()) / layers
            row["TBps"] = kv_bytes / row["us_per_layer"] / 1e6
        rows.append(row)
    return rows


VARIANTS = {  # --model-variant -> (its name, the rule patched while it traces, what the patch returns)
    "stages": ("three stages", "_stages", 3),
    "step_blocks": ("one key block a step", "_step_blocks", 1),
    "warps": ("two warps", "_warps", 2),
}


def model_rows(model_def, params, batch: int, paged: bool, variant: str, max_seq: int = 1024,
               pos: int = 512) -> dict:
    """The base decode step at `batch` as shipped and with one of the kernel's grid rules replaced by a constant
    (`VARIANTS`), alternating rounds. The variant traces its own step: a copy of the model's definition is a new
    jit cache key, and the rule is patched while it traces (`patched_model`)."""
    cache, call = base_decode(llama3_8b(32), batch, max_seq, pos, paged)
    chunk = split_chunk(max_seq, PAGE) if paged else None
    options = StepOptions(16, "auto", attention_chunk=chunk)
    name, rule, value = VARIANTS[variant]
    other, patched, traced = patched_model(model_def, ATTENTION, rule, value)

    def variant_step(c):
        with patched():
            return forward(other, params, call, c, None, options)

    runs = {"shipped": lambda c: forward(model_def, params, call, c, None, options), name: variant_step}
    times, _ = time_alternating(runs, cache)
    assert traced or jax.default_backend() != "gpu", f"the {name} step did not trace the Pallas attention"
    ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    row = dict(batch=batch, max_seq=max_seq, position=pos, paged=paged, split=chunk, variant=name,
               shipped_ms=ms["shipped"], variant_ms=ms[name], ratio=ms["shipped"] / ms[name])
    print(f"model B={batch:3d} {pos}/{max_seq} {'paged, split' if paged else 'rows'}: shipped {ms['shipped']:.3f} ms, "
          f"{name} {ms[name]:.3f} ms ({row['ratio']:.3f}x)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one small case per layout (interpret mode on CPU)")
    parser.add_argument("--cases", default="rows,paged,split", help="the layouts to sweep")
    parser.add_argument("--batches", default=None, help="only these batch sizes (e.g. 1,32); default all")
    parser.add_argument("--settings", default=None,
                        help="only these settings, block_t/warps/stages/step_blocks (e.g. 64/4/3/1,64/4/3/2); default all")
    parser.add_argument("--model-batches", default="", help="the base step's batch sizes (e.g. 32,64,128)")
    parser.add_argument("--model-variant", default="stages", choices=sorted(VARIANTS),
                        help="the rule the base step is compared without")
    parser.add_argument("--model-context", default="1024/512", help="cache positions/query position of the base step")
    parser.add_argument("--model-layouts", default="rows,paged", help="rows, paged (split as the engine splits)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    print(f"# {device}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention_tiles_smoke.json" if args.smoke else "attention_tiles.json")
    result = {"device": device, "shipped": SHIPPED, "rows": [], "model": []}
    for layout in filter(None, args.cases.split(",")):  # "" : the model rows alone
        cases = [(2, 256, 200)] if args.smoke else CASES[layout]
        if args.batches:
            cases = [c for c in cases if c[0] in {int(b) for b in args.batches.split(",")}]
        for batch, max_seq, pos in cases:
            settings = [SHIPPED] + ([dict(block_t=32, num_warps=4, num_stages=2, step_blocks=2)] if args.smoke else [
                s for s in SETTINGS if not args.settings or label(s) in args.settings.split(",")])
            per_layer = 2 * batch * KV * max_seq * HEAD_DIM * 2  # K and V, bf16
            layers = 1 if args.smoke else max(MIN_LAYERS, -(-CACHES_BYTES // per_layer))
            start = time.monotonic()
            rows = case_rows(layout, batch, max_seq, pos, layers, settings)
            result["rows"] += rows
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            timed = [r for r in rows if "us_per_layer" in r]
            if timed:
                best, shipped = min(timed, key=lambda r: r["us_per_layer"]), next(r for r in timed if r["shipped"])
                print(f"{layout:5s} B={batch:2d} {pos}/{max_seq} ({layers} layers, {time.monotonic() - start:.0f} s): "
                      f"shipped {shipped['us_per_layer']:6.1f} µs ({shipped['TBps']:.2f} TB/s), "
                      f"best {best['us_per_layer']:6.1f} µs ({best['TBps']:.2f} TB/s) "
                      f"at {label(best)}; " + " ".join(
                          f"{'shipped' if r['shipped'] else label(r)}:{r['us_per_layer']:.1f}{'' if r['bit_equal'] else '≠'}"
                          for r in timed),
                      flush=True)

    if args.model_batches and not args.smoke:
        model_def, params = random_model(llama3_8b(32))
        max_seq, pos = map(int, args.model_context.split("/"))
        for batch in map(int, args.model_batches.split(",")):
            for layout in args.model_layouts.split(","):
                result["model"].append(model_rows(model_def, params, batch, layout == "paged", args.model_variant,
                                                  max_seq, pos))
                with open(path, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
