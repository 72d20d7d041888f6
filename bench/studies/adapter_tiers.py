"""What one adapter costs each tier on the Llama-3-8B shape: its files (disk), the host tier's copy
(`AdapterPool.prepare`: time and bytes), the copy to the device (`AdapterPool.stage`, on a loader thread) and
the slot write (`AdapterPool.install`, the engine loop's share).

PEFT's default Llama targets (q_proj, v_proj) at ranks 8, 16 and 64, in a pool of max_lora_rank 64 (the
tenancy benchmark's mix): the bound on how many adapters a host tier holds and how fast adapters move.

    python3 bench/studies/adapter_tiers.py [--saved float32|bfloat16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from safetensors.numpy import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jlora import testing  # noqa: E402
from jlora.adapters import AdapterPool  # noqa: E402
from model import llama3_8b, llama3_8b_hf  # noqa: E402


def host_bytes(prepared) -> int:
    arrays = [x for layer in prepared.host.layers for ab in layer.values() for x in ab]
    arrays += [*(prepared.host.embed or ()), *(prepared.host.lm_head or ())]
    return sum(a.nbytes for a in arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--saved", default="float32", choices=("float32", "bfloat16"),
                        help="the files' dtype (PEFT saves the training dtype's)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    config, hf = llama3_8b(args.layers), llama3_8b_hf(args.layers)
    pool = AdapterPool(config, max_loras=2, max_lora_rank=64, dtype=jnp.bfloat16)
    device = jax.devices()[0].device_kind
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for rank in (8, 16, 64):
            path = f"{root}/r{rank}"
            testing.write_adapter(path, hf, r=rank, alpha=2 * rank, seed=rank, target_modules=["q_proj", "v_proj"])
            if args.saved != "float32":
                file = f"{path}/adapter_model.safetensors"
                save_file({k: v.astype(jnp.dtype(args.saved)) for k, v in load_file(file).items()}, file)
            files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            times = {"prepare": [], "stage": [], "install": []}

            def timed(stage, run):
                start = time.perf_counter()
                result = jax.block_until_ready(run())
                times[stage].append(time.perf_counter() - start)
                return result

            for i in range(4):
                prepared = timed("prepare", lambda: pool.prepare(path))
                staged = timed("stage", lambda: pool.stage(prepared))
                if len(pool.names) == pool.num_slots:
                    pool.unload(pool.names[0])
                timed("install", lambda: (pool.install(f"x{rank}-{i}", staged), pool.weights)[1])
            rows.append({"rank": rank, "file_mb": files / 2**20, "host_mb": host_bytes(prepared) / 2**20,
                         **{f"{k}_ms": statistics.median(v[1:]) * 1e3 for k, v in times.items()}})
            print(f"rank {rank:3d}: files {rows[-1]['file_mb']:7.1f} MB  host copy {rows[-1]['host_mb']:7.1f} MB  "
                  f"disk->host {rows[-1]['prepare_ms']:7.1f} ms  host->device {rows[-1]['stage_ms']:7.1f} ms  "
                  f"slot write {rows[-1]['install_ms']:7.1f} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.saved == "float32" else f"_{args.saved}"
    with open(os.path.join(args.out, f"adapter_tiers{suffix}.json"), "w") as f:
        json.dump({"device": device, "layers": args.layers, "saved": args.saved, "rows": rows}, f, indent=1)
    print(f"# {device}, {args.layers} layers, files in {args.saved}, pool max_lora_rank 64, bf16", flush=True)


if __name__ == "__main__":
    main()
