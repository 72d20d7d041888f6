"""Does XLA's persistent compilation cache serve the engine's compiled steps to a second process?

Run it twice (or more) with the same JAX_COMPILATION_CACHE_DIR, and once without: each run loads a random
4-layer Llama-3-8B-shaped model (vocabulary 32000) written under DIR on the first run, loads one r=16 adapter
under 4 names, and times its first `Engine.generate` (8 requests of 100 tokens, 32 new tokens each, 7 on
adapters, one on the base model: the compiles of their step shapes) and a second one.

  python bench/studies/compile_cache.py DIR  # GPU; e.g. JAX_COMPILATION_CACHE_DIR=C
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 python bench/studies/compile_cache.py DIR
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the product benchmarks in bench/
from jlora import testing  # noqa: E402
from jlora.adapters.peft import LINEAR_MODULES  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from model import llama3_8b_hf  # noqa: E402


def main(root: str) -> None:
    config = {**llama3_8b_hf(4), "vocab_size": 32000}
    if not os.path.isdir(os.path.join(root, "m")):
        testing.write_model(os.path.join(root, "m"), config, seed=0)
        testing.write_adapter(os.path.join(root, "a"), config, r=16, alpha=32, seed=1, target_modules=LINEAR_MODULES)
    start = time.perf_counter()
    engine = Engine.from_pretrained(os.path.join(root, "m"), max_loras=4, max_lora_rank=16, max_batch=8,
                                    max_seq_len=512, progress=False)
    for i in range(4):
        engine.load_adapter(f"a{i}", os.path.join(root, "a"))
    loaded = time.perf_counter()
    prompts = np.random.default_rng(0).integers(0, 1000, (8, 100)).tolist()
    adapters = [f"a{i % 4}" for i in range(7)] + [None]
    engine.generate(prompts, adapters, max_new_tokens=32)
    first = time.perf_counter()
    engine.generate(prompts, adapters, max_new_tokens=32)
    second = time.perf_counter()
    print(f"cache={os.environ.get('JAX_COMPILATION_CACHE_DIR')}: load {loaded - start:.1f} s, first generate "
          f"{first - loaded:.2f} s, second {second - first:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
