"""`jlora demo`: the whole path on a small random model, with no downloads.

Writes a small random Llama-family model (with a word-level tokenizer) and several random PEFT adapters of
different ranks and targets in the real HF / PEFT file formats to a temporary directory, loads them through
the public path (`Engine.from_pretrained`, `load_adapter`), generates for a batch that mixes the adapters
and the base model, and checks every request against the base model with that adapter's weights merged
(`W + scaling · B @ A`): the same greedy tokens and the same logits. Runs in float32 so the check is tight;
on a GPU it uses the Pallas kernels.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import jax
import numpy as np

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine

__all__ = ["run_demo"]

ADAPTERS = {  # name: write_adapter arguments
    "chat-r8": dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"]),
    "code-r16": dict(r=16, alpha=16, target_modules=LINEAR_MODULES, use_rslora=True),
    "math-r4": dict(r=4, alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], rank_pattern={"down_proj": 2}),
    "style-r8": dict(r=8, alpha=8, target_modules=["k_proj", "o_proj"], embeddings=True, lm_head=True),
}
PROMPTS = [
    ("the quick brown fox", "chat-r8"),
    ("the lazy dog jumps over the fox", "code-r16"),
    ("brown dog", None),
    ("quick quick fox jumps", "math-r4"),
    ("the dog", "style-r8"),
    ("over the lazy brown dog the fox jumps quick", "code-r16"),
    ("fox", None),
    ("lazy fox jumps", "chat-r8"),
]
TOLERANCE = 1e-3


def run_demo(max_new_tokens: int = 16, out_dir: str | None = None) -> bool:
    """Runs the demo; with `out_dir`, the model (`out_dir/model`) and adapters (`out_dir/<name>`) stay there,
    e.g. to serve them."""
    cfg = testing.tiny_config("llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=4)
    if out_dir is not None:
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise ValueError(f"--out {out_dir!r} is not a directory")
        os.makedirs(out_dir, exist_ok=True)
        where = contextlib.nullcontext(out_dir)
    else:
        where = tempfile.TemporaryDirectory(prefix="jlora-demo-")
    with where as root:
        model_dir = os.path.join(root, "model")
        testing.write_model(model_dir, cfg, seed=0)
        testing.write_tokenizer(model_dir, cfg["vocab_size"])
        for i, (name, kw) in enumerate(ADAPTERS.items()):
            testing.write_adapter(os.path.join(root, name), cfg, seed=100 + i, **kw)
        print(f"wrote a random {cfg['model_type']} model ({cfg['num_hidden_layers']} layers, hidden "
              f"{cfg['hidden_size']}) and {len(ADAPTERS)} PEFT adapters to {root}")

        engine = Engine.from_pretrained(model_dir, max_loras=4, max_lora_rank=16, dtype="float32", max_batch=4)
        for name in ADAPTERS:
            engine.load_adapter(name, os.path.join(root, name))
        prompts = [p for p, _ in PROMPTS]
        adapters = [a for _, a in PROMPTS]
        engine.generate(prompts, adapters, max_new_tokens=max_new_tokens)  # compile the buckets
        start = time.perf_counter()
        outputs = engine.generate(prompts, adapters, max_new_tokens=max_new_tokens)
        elapsed = time.perf_counter() - start

        merged = {}
        for name in ADAPTERS:
            testing.merge_adapter(model_dir, os.path.join(root, name), os.path.join(root, f"merged-{name}"))
            merged[name] = Engine.from_pretrained(os.path.join(root, f"merged-{name}"), dtype="float32", progress=False)
        print(f"\n{'#':>2} {'adapter':9s} {'prompt':>6s} {'new':>4s}  {'max |Δlogit| vs merged':>22s}  check  output")
        ok = True
        for i, ((text, adapter), out) in enumerate(zip(PROMPTS, outputs)):
            ids = engine.encode([text])[0] + list(out)
            lora_logits = engine.prefill_logits([ids], [adapter])[0]
            ref = (merged[adapter] if adapter else engine).prefill_logits([ids], [None])[0]
            diff = float(np.abs(lora_logits - ref).max())
            greedy_same = list(ref[len(ids) - len(out) - 1 : -1].argmax(-1)) == list(out)
            passed = diff < TOLERANCE and greedy_same
            ok &= passed
            print(f"{i:2d} {adapter or '(base)':9s} {len(ids) - len(out):6d} {len(out):4d}  {diff:22.2e}  "
                  f"{'ok' if passed else 'FAIL':5s}  {out.text[:48]!r}")
        new_tokens = sum(len(o) for o in outputs)
        print(f"\n{len(PROMPTS)} requests, {new_tokens} tokens in {elapsed:.2f} s: {new_tokens / elapsed:.0f} tokens/s "
              f"on {jax.devices()[0].device_kind} ({engine.runner.backend} backend, "
              f"max_batch={engine.config.max_batch})")
        print("all requests match their merged-weight models" if ok else "MISMATCH against merged weights")
        return ok
