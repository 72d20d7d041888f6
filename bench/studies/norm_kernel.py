"""The model's RMSNorm in a Pallas kernel (`jlora.pallas.rms_norm`) against XLA's fusions of it, for #39.

A decode step runs 65 norms in series between its GEMMs. XLA runs each as one kernel at batch 32 but as two at
batch 1 (the sum of squares, then the scaling: a reduction to one value takes no epilogue). The kernel is one
program per token row.

Model: the 8B-shaped step (`bench/model.py`'s model, random weights) compiled twice, the norms in the kernel (the
shipped model) and in XLA (the decision patched while the second copy traces), timed in alternating rounds: base
decode over contiguous rows (context 1024, query at 512) at each batch, batch 32 (`--lora-batches`) with one and
with 32 r=16 adapters (`--rank`), and a base prefill of 4 x 512 tokens. Both variants' logits are compared first. JSON: norm_kernel.json.

  python bench/studies/norm_kernel.py [--batches 1,8,32,64] [--lora-batches 32] [--rank 16] [--no-prefill]
      [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import compare_patched, patched_row, row_recorder  # noqa: E402
from model import SLOTS, llama3_8b, random_lora, random_model  # noqa: E402
from split_attention import base_decode  # noqa: E402

from jlora.models import llama  # noqa: E402
from jlora.models.llama import Batch, KVCache  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402


def prefill(config, requests: int, length: int) -> tuple[KVCache, Call]:
    """(cache, call) of a base prefill: `requests` prompts of `length` tokens from position 0."""
    cache = KVCache.zeros(config, requests, 2 * length, jnp.bfloat16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (requests, length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (requests, length))
    return cache, Call(Batch.of(tokens, positions), jnp.full(requests * length, -1, jnp.int32), jnp.zeros(1, jnp.int32))


def case(model_def, params, name: str, cache, call: Call, lora=None) -> dict:
    """The step with the kernel's norms and with XLA's, alternating rounds; their logits compared first."""
    got, _ = compare_patched(model_def, params, call, cache, lora, StepOptions(16, "auto"), llama,
                             "rms_norm_supported", False, ("kernel", "xla"))
    return patched_row(name, got, ("kernel", "xla"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,64", help="base decode batch sizes")
    parser.add_argument("--lora-batches", default="32", help="decode batch sizes with one and with 32 adapters")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "norm_kernel.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    for batch in map(int, filter(None, args.batches.split(","))):
        record(case(model_def, params, f"decode B={batch}", *base_decode(config, batch, 1024, 512, False)))
    lora = random_lora(config, args.rank)
    for batch in map(int, filter(None, args.lora_batches.split(","))):
        for adapters in (1, SLOTS):
            cache, call = base_decode(config, batch, 1024, 512, False)
            slots = jnp.arange(batch, dtype=jnp.int32) % adapters
            call = Call(call.batch, slots, jnp.full(SLOTS, args.rank, jnp.int32))
            record(case(model_def, params, f"decode B={batch}, {adapters} r={args.rank}", cache, call, lora))
    if not args.no_prefill:
        record(case(model_def, params, "prefill 4 x 512", *prefill(config, 4, 512)))


if __name__ == "__main__":
    main()
