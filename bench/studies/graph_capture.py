"""Whether a decode step's kernels, Pallas ones included, run inside XLA's CUDA graphs (#39 asked whether the
Pallas calls launch outside them): XLA's thunk sequence of the model's decode step, as `bench/model.py` builds
it (8B shape, r=16 adapters), counted.

XLA dumps each compiled step's thunks (`--xla_dump_to`, `*.thunk_sequence_after_thunk_passes.txt`): a line per
top-level thunk, a `kCommandBuffer` (one CUDA graph) listing its commands indented beneath it, a `kWhile` its
condition's and body's thunks. Per step: the top-level thunks by kind, the kernels inside graphs, and what runs
outside them by name (a `pallas_call` kernel is named by the kernel's function: `jlora_decode_attention_*`,
`jlora_shrink_*`, ...).

  python bench/studies/graph_capture.py [--layers 32] [--batches 1,32] [--backends auto,pallas]  # GPU
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

DUMP = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} "
                           "--xla_dump_hlo_module_re=.*forward.*")

import jax  # noqa: E402  (after XLA_FLAGS)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import model  # noqa: E402


def summary(path: str) -> dict:
    """Top-level thunks by kind, the kernels inside command buffers, and what runs outside them: the thunks at the
    top level other than command buffers (a `kWhile`, say, whose iterations the host launches) and the thunks
    nested in them, by name."""
    top, inside, outside = collections.Counter(), 0, collections.Counter()
    in_graph = False
    for line in open(path):
        match = re.match(r"(\s*)\d+: (k\w+)(?: \[[^\]]*\])? ?(\S*)", line)
        if match is None:
            continue
        indent, kind, name = match.groups()
        if not indent:
            top[kind] += 1
            in_graph = kind == "kCommandBuffer"
        if indent and in_graph:
            inside += 1
        elif not in_graph:
            outside[re.sub(r"_\d+$", "", name) or kind] += 1
    return {"top_level": dict(top), "kernels_in_graphs": inside, "outside": dict(outside)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--backends", default="auto,pallas", help="LoRA backends (auto: gather for decode)")
    args = parser.parse_args()
    config = model.llama3_8b(args.layers)
    model_def, params = model.random_model(config)
    print(f"Device: {jax.devices()[0].device_kind}; {args.layers} layers")
    for batch in (int(b) for b in args.batches.split(",")):
        g, st, cache, tokens, positions, cases, _ = model.setup(config, model_def, params, 1, 16, batch)
        for backend in args.backends.split(","):
            model.BACKEND = backend
            for case, (lora, slots, ranks) in cases.items():
                if case == "base" and backend != args.backends.split(",")[0]:
                    continue
                before = set(glob.glob(f"{DUMP}/*thunk_sequence_after_thunk_passes.txt"))
                step = model.model_step(g, st, tokens, positions, lora, slots, ranks, 16)
                logits, cache = step(cache)
                jax.block_until_ready(logits)
                new = sorted(set(glob.glob(f"{DUMP}/*thunk_sequence_after_thunk_passes.txt")) - before)
                label = "base" if case == "base" else f"1 adapter per row, {backend}"
                for path in new:
                    print(f"batch {batch}, {label}: {summary(path)}", flush=True)


if __name__ == "__main__":
    main()
