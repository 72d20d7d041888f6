"""The decode step with the Pallas LoRA kernels' tiles overridden, against the shipped tiles, for #39.

Each variant names fields of `ShrinkConfig` and `ExpandConfig` to set on the tiles the heuristics pick
(`jlora.pallas.config`), for every projection's `lora_linear` of the step, e.g. `--variants
'late={"expand": {"segments_first": true}}'`: the expand's grid as one axis with the used segments' programs first,
so the programs that find no segment launch after the others instead of among them.

Model: the 8B-shaped decode step (`bench/model.py`'s model and adapters, 32 slots; each batch as `bench/model.py`
runs it), the slots shuffled over the rows, on the Pallas LoRA backend; timed in alternating rounds, one process;
each variant's logits compared with the shipped step's. JSON: decode_tiles.json.

  python bench/studies/decode_tiles.py --variants NAME=JSON[;NAME=JSON] [--cases 32x16x1,32x16x32,32x64x1]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from unittest import mock

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from common import row_recorder  # noqa: E402
from split_attention import time_lora_decodes  # noqa: E402

from jlora import ops, pallas  # noqa: E402
from jlora.pallas.config import expand_config, shrink_config  # noqa: E402


def tiled_linear(x, base, a, b, info, scale=None, shift=None, *, slice_sizes, backend, defer_add=False,
                 overrides: tuple):
    """`ops._linear` on the Pallas kernels with `overrides` ((("shrink" | "expand", field), value), ...) set on
    the shipped tiles."""
    assert backend == "pallas", backend
    num_tokens, k = x.shape
    rank, slices = b.shape[2], len(slice_sizes)
    tiles = {"shrink": shrink_config(num_tokens, k, slices * rank, info.block_m, x.dtype.itemsize, slices),
             "expand": expand_config(num_tokens, slice_sizes, info.block_m, rank, defer_add)}
    for (kernel, field), value in overrides:
        tiles[kernel] = dataclasses.replace(tiles[kernel], **{field: value})
    return pallas.linear(x, base, a, b, info, slice_sizes=slice_sizes, scale=scale, shift=shift,
                         shrink_config=tiles["shrink"], expand_config=tiles["expand"], defer_add=defer_add)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", required=True, help="NAME=JSON pairs joined by ';'")
    parser.add_argument("--cases", default="32x16x1,32x16x32,32x64x1", help="batch x rank x adapters")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    variants = {}
    for item in args.variants.split(";"):
        name, spec = item.split("=", 1)
        variants[name] = tuple(((kernel, field), value) for kernel, fields in json.loads(spec).items()
                               for field, value in fields.items())
    _, record = row_recorder(args.out, "decode_tiles.json")
    patches = {"shipped": None}
    for name, overrides in variants.items():
        linear = jax.jit(functools.partial(tiled_linear, overrides=overrides),
                         static_argnames=("slice_sizes", "backend", "defer_add"))
        patches[name] = functools.partial(mock.patch.object, ops, "_linear", linear)
    time_lora_decodes(args.cases, patches, backend="pallas", record=record,
                      overrides={n: [[kernel, field, value] for (kernel, field), value in o]
                                 for n, o in variants.items()})


if __name__ == "__main__":
    main()
