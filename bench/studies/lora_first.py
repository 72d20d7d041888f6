"""Each LoRA projection's shrink before its base GEMM in XLA's schedule, against the shipped order, for #39.

Under concurrent CUDA graphs the first kernel after a fork keeps the graph's stream and is launched first; the one
launched first takes the SMs, and the other's programs start as the first's finish. With 32 r=64 adapters at
batch 32 the shipped step puts the down and q|k|v GEMMs first: their shrinks beside them slow and q|k|v's expand
runs after its GEMM, while a build that happened to put every shrink first spanned 233.5 against 247.6 µs a layer
(bench/results/model_profile_b32_r64_*.txt). Here an optimization barrier on (x, the shrink's output) before
the GEMM puts the shrink first in the schedule; like the engine's `base_first` the barrier orders the schedule,
not the run (the GEMM reads x's buffer, not the shrink's). On the Pallas LoRA kernels (decode sizes) the shrink
is `pallas.linear`'s first kernel and its partial sums go to the expand; where the LoRA runs in XLA (gather:
batch 1-16 under `auto`) the shipped step puts every GEMM before its LoRA (`base_first`; over batch 1's row
reductions none), and at batch 8 with an r=64 adapter q|k|v's shrink, expand and add then run after its GEMM,
14.5 µs in series before the attention (bench/results/model_profile_b8_r64.txt). The variants:
- "shrink first": every projection's shrink before its GEMM;
- "q|k|v shrink first": q|k|v's alone, the others as shipped;
- "shrink beside" (XLA LoRA only): the shrink and the GEMM both before a barrier on (the GEMM's output, the
  shrink's), the expand after it.
The same operations, so the same logits.

Model: the 8B-shaped decode step (`bench/model.py`'s random model, each batch as `bench/model.py` runs it, 1024
positions a request, query at 512; the adapters' slots shuffled over the rows), shipped and each variant, timed
in alternating rounds. JSON: lora_first.json (`--json` names another).

  python bench/studies/lora_first.py [--cases 32x64x32,32x16x1,...] [--variants ...] [--json F] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from unittest import mock

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import row_recorder  # noqa: E402
from split_attention import time_lora_decodes  # noqa: E402

from jlora.models import llama  # noqa: E402
from jlora.ops import lora_expand, lora_shrink, resolve_backend  # noqa: E402
from jlora.pallas.config import delta_expand  # noqa: E402
from jlora.pallas.expand import expand  # noqa: E402
from jlora.pallas.shrink import shrink_partials  # noqa: E402

SHIPPED = llama._with_lora
ALL = ("qkv", "o", "gate_up", "down")


def reordered(proj, x, ctx, group, name, slice_sizes, row_parallel=False, *, projections=ALL, beside=False):
    """`llama._with_lora` with the shrink of each of `projections` before its GEMM in the schedule (`beside`: the
    shrink and the GEMM before the expand, in XLA's order between them). On the Pallas kernels (not `beside`) where
    they write the delta apart: `pallas.linear`'s two kernels, on weights the pool already padded; elsewhere the XLA
    backend's `lora_shrink` and `lora_expand`, which `lora_linear` calls."""
    lora, options = ctx.lora, ctx.options
    if lora is None or name not in group.a or name not in projections or options.reduce_axis is not None:
        return SHIPPED(proj, x, ctx, group, name, slice_sizes, row_parallel)
    backend = resolve_backend(options.backend, x.shape[0], group.b[name].shape[2])
    scale = None if group.scale is None else group.scale[name]
    shift = None if group.shift is None else group.shift[name]
    if backend == "pallas":
        if beside or not delta_expand(x.shape[0], True):
            return SHIPPED(proj, x, ctx, group, name, slice_sizes, row_parallel)
        partials = shrink_partials(x, group.a[name], lora.info, num_slices=len(slice_sizes))
        x_gemm, partials = jax.lax.optimization_barrier((x, partials))
        return expand(partials, group.b[name], lora.info, proj(x_gemm), slice_sizes=slice_sizes, scale=scale,
                      shift=shift, defer_add=True)
    s = lora_shrink(x, group.a[name], lora.info, num_slices=len(slice_sizes), backend=backend)
    if beside:
        out, s = jax.lax.optimization_barrier((proj(x), s))
    else:
        x_gemm, s = jax.lax.optimization_barrier((x, s))
        out = proj(x_gemm)
    return lora_expand(s, group.b[name], lora.info, out, slice_sizes=slice_sizes, backend=backend, scale=scale,
                       shift=shift)


VARIANTS = {"shrink first": dict(), "q|k|v shrink first": dict(projections=("qkv",)),
            "shrink beside": dict(beside=True)}


def patched(**how):
    @contextlib.contextmanager
    def patch():
        with mock.patch.object(llama, "_with_lora", functools.partial(reordered, **how)):
            yield
    return patch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x64x32,64x64x32,32x64x8,32x64x1,32x16x32,32x16x1",
                        help="decode batch x rank x adapters")
    parser.add_argument("--variants", default="shrink first", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--json", default="lora_first.json")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; expected some of {list(VARIANTS)}")
    _, record = row_recorder(args.out, args.json)
    time_lora_decodes(args.cases, {"shipped": None, **{v: patched(**VARIANTS[v]) for v in variants}}, record=record)


if __name__ == "__main__":
    main()
