"""The LoRA backend chosen per projection at decode, for #39 (GPU only).

`auto` picks one backend for every LoRA call of a step from its shape (tokens, rank). On their own the gather
forms are 2-4x faster than the Pallas kernels at 32 tokens on every projection (docs/kernels.md, § Why `auto`
switches where it does), yet in the step the Pallas kernels win with up to 16 adapters: they run beside the
base GEMMs. A profile of batch 32 with one r=16 adapter puts the step's LoRA cost unevenly over a layer's
projections (o 3 µs, gate|up 5.7, down 1.7, q|k|v 3.1), so the best backend may differ by projection.

Model: the 8B-shaped step (`bench/model.py`'s model, random weights) over contiguous rows (context 1024, query at
512), the adapters' slots shuffled over the rows. Each variant names the projections whose LoRA runs the gather
forms (with the engine's barrier before gate|up's where gate|up is one of them); the rest and the lm_head run the
Pallas kernels. The variants of a batch size are compiled once and timed in alternating rounds per adapter count,
one process; each variant's logits are compared with the all-Pallas step's. JSON: backend_by_projection.json.

  python bench/studies/backend_by_projection.py [--cases 32x16x1,32x16x8,32x16x32,64x16x32]
      [--variants pallas,o,qkv,o+qkv,down,o+qkv+down,gate_up,gather]
"""

from __future__ import annotations

import argparse
import copy
import contextlib
import os
import sys
from unittest import mock

import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import row_recorder, time_variants, variants_row  # noqa: E402
from model import SLOTS, llama3_8b, random_lora, random_model, shuffled_slots  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora import ops  # noqa: E402
from jlora.models import llama  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def projection(config, x, slice_sizes: tuple[int, ...]) -> str:
    """Which of a layer's projections (or "lm_head") a LoRA call of input x and output slices is."""
    if len(slice_sizes) == 3:
        return "qkv"
    if len(slice_sizes) == 2:
        return "gate_up"
    if x.shape[1] == config.intermediate_size:
        return "down"
    return "o" if slice_sizes[0] == config.hidden_size else "lm_head"


def gathered(variant: str) -> frozenset[str]:
    """The projections a variant's name runs on the gather forms."""
    names = {"pallas": (), "gather": PROJECTIONS}.get(variant, tuple(variant.split("+")))
    assert set(names) <= set(PROJECTIONS), variant
    return frozenset(names)


def patch(config, gather: frozenset[str]):
    """A context manager factory: the LoRA of the projections in `gather` on the gather forms, the rest as the
    step's backend; the barrier before gate|up's LoRA where the engine puts it (where that LoRA runs in XLA)."""
    original = ops._linear

    def linear(x, base, a, b, info, scale=None, shift=None, *, slice_sizes, backend, defer_add=False):
        chosen = "gather" if projection(config, x, slice_sizes) in gather else backend
        return original(x, base, a, b, info, scale, shift, slice_sizes=slice_sizes, backend=chosen, defer_add=defer_add)

    def barrier(backend, *_):
        return "gather" if "gate_up" in gather else backend

    @contextlib.contextmanager
    def patched():
        with mock.patch.object(ops, "_linear", linear), mock.patch.object(llama, "resolve_backend", barrier):
            yield

    return patched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x16x1,32x16x8,32x16x32,64x16x32", help="batch x rank x adapters")
    parser.add_argument("--variants", default="pallas,o,qkv,o+qkv,down,o+qkv+down,gate_up,gather")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "backend_by_projection.json")
    print("# the LoRA backend per projection (gather on those named, Pallas elsewhere)", flush=True)
    config = llama3_8b(32)
    model_def, params = random_model(config)
    variants = args.variants.split(",")
    defs, loras = {}, {}  # defs: (batch, rank, variant) -> its model def, so that each compiles once per shape
    for case in args.cases.split(","):
        batch, rank, used = map(int, case.split("x"))
        lora = loras.setdefault(rank, random_lora(config, rank))
        cache, call = base_decode(config, batch, 1024, 512, False)
        slots = shuffled_slots(batch, used)
        call = Call(call.batch, slots, jnp.full(SLOTS, rank, jnp.int32))
        steps = {name: (defs.setdefault((batch, rank, name), copy.copy(model_def)), StepOptions(16, "pallas"),
                        patch(config, gathered(name))) for name in variants}
        got, cache = time_variants(params, call, cache, lora, steps)
        record(variants_row(f"decode B={batch} r={rank} adapters={used}", got, batch=batch, rank=rank, adapters=used))


if __name__ == "__main__":
    main()
