"""The LoRA metadata's bin search as comparisons against jnp.searchsorted's binary search, for #39.

`LoRABatchInfo.build` finds each segment's slot, and `token_slots_from_requests` each token's request, by a search
over a cumulative count (`jlora.batch_info.bin_index`). jnp.searchsorted's default method is a binary search,
an XLA while loop of log2(E) iterations; the shipped form compares every pair at once in one fused kernel. The
gather backend reads no segment, so only steps on the Pallas LoRA kernels carry the search.

Model: the 8B-shaped step (`bench/model.py`'s random model, each decode batch as `bench/model.py` runs it, 1024
positions a request, query at 512; the adapters' slots shuffled over the rows; a prefill of requests of 512
tokens, one adapter each), as shipped and with `bin_index` patched to the binary search while the second copy
traces, timed in alternating rounds; both variants' logits compared first. JSON: segment_search.json.

  python bench/studies/segment_search.py [--cases 32x16x1,32x16x32,64x64x32] [--prefill 4x512x4] [--out DIR]
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
from split_attention import lora_decodes  # noqa: E402

from jlora import batch_info  # noqa: E402
from jlora.models.llama import Batch, KVCache  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402

LABELS = ("compare all", "binary search")
INLINE = ((batch_info, "_build"), (batch_info, "_token_slots"))  # the jitted callers of bin_index


def binary_search(edges, values):
    """`bin_index` as jnp.searchsorted's default method computes it."""
    return jnp.searchsorted(edges, values, side="right").astype(jnp.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x16x1,32x16x32,64x16x32,32x64x1,8x16x1",
                        help="decode batch x rank x adapters")
    parser.add_argument("--prefill", default="4x512x4", help="requests x tokens x adapters, r=16")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "segment_search.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    loras = {}
    for case in lora_decodes(config, model_def, params, args.cases):
        loras[case.rank] = case.lora
        got, _ = compare_patched(case.model_def, case.params, case.call, case.cache, case.lora, case.options,
                                 batch_info, "bin_index", binary_search, LABELS, INLINE)
        record(patched_row(f"decode B={case.batch}, {case.adapters} r={case.rank}", got, LABELS, kind="decode",
                           batch=case.batch, rank=case.rank, adapters=case.adapters))
        del case
    for case in filter(None, args.prefill.split(",")):
        requests, seq, used = map(int, case.split("x"))
        lora = loras.setdefault(16, random_lora(config, 16))
        cache = KVCache.zeros(config, requests, seq, jnp.bfloat16)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (requests, seq)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (requests, seq))
        slots = jnp.repeat(jnp.arange(requests) % used, seq).astype(jnp.int32)
        call = Call(Batch.of(tokens, positions), slots, jnp.full(SLOTS, 16, jnp.int32))
        got, cache = compare_patched(model_def, params, call, cache, lora, StepOptions(16, "auto"), batch_info,
                                     "bin_index", binary_search, LABELS, INLINE)
        record(patched_row(f"prefill {requests}x{seq}, {used} r=16", got, LABELS, kind="prefill", batch=requests,
                           rank=16, adapters=used))


if __name__ == "__main__":
    main()
