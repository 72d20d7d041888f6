"""Steps whose LoRA tokens all use one adapter, through dense dots on that adapter's weights, for #39.

With one adapter in a step the segmented forms still gather or segment per token: the gather backend reads
A[slot(t)] and B[slot(t)] once per token (from L2), the Pallas kernels run their grids over the slots. A step
known to use one slot could instead slice that slot's A and B once and run two plain dots per projection,
`x @ A[s]ᵀ` and `s @ B[s]ᵀ` ([T, K] x [K, S·R], [T, R] x [R, N]), which XLA fuses and tiles as small GEMMs.

Model: the 8B-shaped step (`bench/model.py`'s model, random weights) compiled twice, as shipped (backend
`auto`) and with `jlora.ops._linear` replaced by the dense one-slot form while the copy traces, timed in
alternating rounds: decode over contiguous rows (context 1024, query at 512), every token on slot 0, at each
batch of `--batches` and rank of `--ranks`. Both variants' logits are compared first. JSON: one_slot.json.

  python bench/studies/one_slot.py [--batches 1,8,32,64] [--ranks 16] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
from unittest import mock

import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import row_recorder, time_variants, variants_row  # noqa: E402
from model import SLOTS, llama3_8b, random_lora, random_model  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora import ops, reference  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402

F32 = jnp.float32


def one_slot_linear(x, base, a, b, info, scale=None, shift=None, *, slice_sizes, backend, defer_add=False):
    """`ops._linear` for a step whose LoRA tokens all use one slot: that slot's A [S·R, K] and B [N, R] sliced
    once, two dots, the rows and masks as `reference.scale_rows` and `add_deltas` give them."""
    del backend, defer_add
    slot = jnp.maximum(jnp.max(info.token_slot), 0)
    rank = b.shape[2]
    y = jnp.dot(x, a[slot].T, preferred_element_type=F32)  # [T, S·R]
    s = reference.scale_rows(y, info, rank, len(slice_sizes)).astype(x.dtype)
    used = (info.token_slot >= 0)[:, None]
    deltas, start = [], 0
    for i, n in enumerate(slice_sizes):
        d = jnp.dot(s[:, i * rank:(i + 1) * rank], b[slot, start:start + n, :].T, preferred_element_type=F32)
        deltas.append(jnp.where(used, d, 0.0).astype(base.dtype))
        start += n
    return reference.add_deltas(base, deltas, info, scale, shift)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--ranks", default="16")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "one_slot.json")
    print("# one adapter, the shipped step against dense one-slot dots", flush=True)
    config = llama3_8b(32)
    model_def, params = random_model(config)
    for rank in map(int, args.ranks.split(",")):
        lora = random_lora(config, rank)
        for batch in map(int, args.batches.split(",")):
            cache, call = base_decode(config, batch, 1024, 512, False)
            call = Call(call.batch, jnp.zeros(batch, jnp.int32), jnp.full(SLOTS, rank, jnp.int32))
            options = StepOptions(16, "auto")
            steps = {"shipped": (model_def, options, None),
                     "one_slot": (copy.copy(model_def), options,
                                  functools.partial(mock.patch.object, ops, "_linear", one_slot_linear))}
            got, cache = time_variants(params, call, cache, lora, steps)
            record(variants_row(f"decode B={batch} r={rank}", got, batch=batch, rank=rank))
        del lora


if __name__ == "__main__":
    main()
