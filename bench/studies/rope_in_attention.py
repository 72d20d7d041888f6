"""RoPE and the cache write in the decode-attention kernel (`jlora.pallas.decode_attention.NewToken`) against
them in XLA before it, for #39.

Between a decode step's q|k|v projection and its attention, XLA ran RoPE on q and k and the two cache writes as
small kernels of their own in series (about 2.7 µs a layer at batch 1 on an H200). With a `NewToken` the
attention kernel rotates q and the token's key itself and writes the key and value before it reads the cache.
`llama.rope_in_attention` decides where.

Model: the 8B-shaped decode step (`bench/model.py`'s random model, 1024 positions a request, query at 512), each
batch as `bench/model.py` runs it (`engine_config`: its weight layout and attention split; with `--paged`, a
batch over 16-position blocks in a random order too), compiled twice, as shipped and with the decision
patched to the other answer while the second copy traces, timed in alternating rounds; both variants' logits
compared first. The base step at each batch, and one r=16 adapter (`--rank`) at batch 1 and 32. JSON:
rope_in_attention.json.

  python bench/studies/rope_in_attention.py [--batches 1,8,32] [--paged 8] [--rank 16] [--out DIR]  # GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import compare_patched, patched_row, row_recorder  # noqa: E402
from model import SLOTS, engine_config, engine_layout, llama3_8b, random_lora, random_model  # noqa: E402
from split_attention import PAGE, base_decode  # noqa: E402

from jlora.models import llama  # noqa: E402
from jlora.ops import resolve_backend  # noqa: E402
from jlora.pallas.config import delta_expand  # noqa: E402
from jlora.step import Call, StepOptions  # noqa: E402

LABELS = ("in kernel", "apart")


def case(model_def, params, name: str, batch: int, paged: bool = False, lora=None, rank: int = 16) -> dict:
    """The step as shipped and with `rope_in_attention` answering the other way, alternating rounds."""
    config = model_def.merge(params).config
    cache, call = base_decode(config, batch, 1024, 512, paged)
    if lora is not None:  # one adapter for every row
        call = Call(call.batch, jnp.zeros(batch, jnp.int32), jnp.full(SLOTS, rank, jnp.int32))
    engine = engine_config(batch)
    if paged:  # the engine over blocks
        engine = dataclasses.replace(engine, block_size=PAGE)
    chunk = engine.attention_chunk(config.num_kv_heads)
    options = StepOptions(16, "auto", attention_chunk=chunk)
    shipped = _shipped(batch, lora, rank)
    labels = LABELS if shipped else LABELS[::-1]
    got, _ = compare_patched(model_def, params, call, cache, lora, options, llama, "rope_in_attention", not shipped,
                             labels)
    return patched_row(name, got, LABELS, shipped=labels[0], paged=paged, chunk=chunk)


def _shipped(batch: int, lora, rank: int) -> bool:
    """`llama.rope_in_attention`'s answer for the step: whether the Pallas LoRA kernels write q|k|v's delta apart."""
    apart = lora is not None and resolve_backend("auto", batch, rank) == "pallas" and delta_expand(batch, True)
    return llama.rope_in_attention(apart)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32", help="base decode batch sizes over contiguous rows")
    parser.add_argument("--paged", default="8", help="base decode batch sizes over blocks")
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank at batch 1 and 32")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    _, record = row_recorder(args.out, "rope_in_attention.json")
    config = llama3_8b(32)
    model_def, params = random_model(config)
    cases = [(b, False) for b in map(int, filter(None, args.batches.split(",")))]
    cases += [(b, True) for b in map(int, filter(None, args.paged.split(",")))]
    for batch, paged in cases:
        stored = engine_layout(model_def, params, batch)
        record(case(*stored, f"decode B={batch}" + (" paged" if paged else ""), batch, paged))
        if batch in (1, 32) and not paged:
            record(case(*stored, f"decode B={batch}, 1 r={args.rank}", batch, False,
                        random_lora(config, args.rank), args.rank))
        del stored


if __name__ == "__main__":
    main()
