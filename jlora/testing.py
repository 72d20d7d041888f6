"""Random Hugging Face checkpoints and PEFT adapters in the real file formats, for tests and the demo.

`write_model` writes `config.json` + `model.safetensors` (or shards with an index) with HF key names;
`write_adapter` writes `adapter_config.json` + `adapter_model.safetensors` with PEFT key names. The
weights are small random float32 values; the LoRA B side is non-zero so adapters change the output.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
from safetensors.numpy import save_file

__all__ = ["tiny_config", "write_model", "write_adapter", "write_tokenizer", "merge_adapter", "compile_prefill"]


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """An HF config.json dict of a tiny model of the given type."""
    cfg = {
        "model_type": model_type,
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
    }
    if model_type == "qwen2":
        cfg["attention_bias"] = True
    cfg.update(overrides)
    return cfg


def _module_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """PEFT module name suffix -> (in, out) of the base linear layers."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _parent(name: str) -> str:
    return "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def write_model(path: str, cfg: dict[str, Any], *, seed: int = 0, shards: int = 1) -> None:
    """Writes a random HF checkpoint of `cfg` to `path` (`shards` > 1: a sharded index)."""
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    rnd = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    tensors = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": 1 + 0.1 * rnd(h)}
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = rnd(v, h)
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        tensors[pre + "input_layernorm.weight"] = 1 + 0.1 * rnd(h)
        tensors[pre + "post_attention_layernorm.weight"] = 1 + 0.1 * rnd(h)
        for name, (din, dout) in _module_shapes(cfg).items():
            tensors[f"{pre}{_parent(name)}.{name}.weight"] = rnd(dout, din)
            if cfg["model_type"] == "qwen2" and name in ("q_proj", "k_proj", "v_proj"):  # as HF's Qwen2
                tensors[f"{pre}self_attn.{name}.bias"] = 0.1 * rnd(dout)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, os.path.join(path, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _rank_alpha(adapter_cfg: dict[str, Any], module: str) -> tuple[int, float]:
    """PEFT's per-module rank and alpha under rank_pattern / alpha_pattern."""
    def pick(patterns, default):
        for key, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default
    return (pick(adapter_cfg.get("rank_pattern"), adapter_cfg["r"]),
            pick(adapter_cfg.get("alpha_pattern"), adapter_cfg["lora_alpha"]))


def write_adapter(path: str, base_cfg: dict[str, Any], *, r: int, alpha: float, seed: int,
                  target_modules: list[str] | str = ("q_proj", "v_proj"), embeddings: bool = False,
                  lm_head: bool = False, **extra: Any) -> dict[str, Any]:
    """Writes a random PEFT LoRA adapter for a model of `base_cfg`; returns its adapter_config dict.

    `extra` goes into adapter_config.json (use_rslora, rank_pattern, alpha_pattern, layers_to_transform...).
    """
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    targets = list(target_modules) if not isinstance(target_modules, str) else target_modules
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
           "task_type": "CAUSAL_LM", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, **extra}
    if embeddings or lm_head:
        extra_targets = (["embed_tokens"] if embeddings else []) + (["lm_head"] if lm_head else [])
        cfg["target_modules"] = (targets + extra_targets) if isinstance(targets, list) else targets
    layers = cfg.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers
    tensors = {}
    for layer in range(base_cfg["num_hidden_layers"]):
        if layers is not None and layer not in layers:
            continue
        for name, (din, dout) in _module_shapes(base_cfg).items():
            module = f"model.layers.{layer}.{_parent(name)}.{name}"
            matched = (re.fullmatch(targets, module) is not None) if isinstance(targets, str) else name in targets
            if not matched:
                continue
            rank, _ = _rank_alpha(cfg, module)
            tensors[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((rank, din)).astype(np.float32) / np.sqrt(din)
            tensors[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((dout, rank)).astype(np.float32) / 4
    h, v = base_cfg["hidden_size"], base_cfg["vocab_size"]
    if embeddings:
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = rng.standard_normal((r, v)).astype(np.float32)
        tensors["base_model.model.model.embed_tokens.lora_embedding_B"] = rng.standard_normal((h, r)).astype(np.float32) / 4
    if lm_head:
        tensors["base_model.model.lm_head.lora_A.weight"] = rng.standard_normal((r, h)).astype(np.float32) / np.sqrt(h)
        tensors["base_model.model.lm_head.lora_B.weight"] = rng.standard_normal((v, r)).astype(np.float32) / 4
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return cfg


def merge_adapter(model_dir: str, adapter_dir: str, out_dir: str) -> None:
    """Writes `model_dir`'s checkpoint with the adapter merged in: W + scaling · B @ A per module
    (embedding: E + scaling · (B @ A)ᵀ). The oracle of the LoRA tests, independent of jlora's loaders."""
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        base_cfg = json.load(f)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    lora = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    for key, a in lora.items():
        m = re.match(r"base_model\.model\.(.+)\.(lora_A\.weight|lora_embedding_A)$", key)
        if not m:
            continue
        module = m[1]
        b = lora[key.replace("lora_A", "lora_B").replace("lora_embedding_A", "lora_embedding_B")]
        rank, alpha = _rank_alpha(cfg, module)
        scale = alpha / np.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        delta = scale * (b.astype(np.float64) @ a.astype(np.float64))
        if module == "model.embed_tokens":
            weights[module + ".weight"] = (weights[module + ".weight"] + delta.T).astype(np.float32)
        else:
            weights[module + ".weight"] = (weights[module + ".weight"] + delta).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(base_cfg, f)
    save_file(weights, os.path.join(out_dir, "model.safetensors"))


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def write_tokenizer(path: str, vocab_size: int, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Writes a word-level `tokenizer.json` of `vocab_size` made-up words (w0, w1, ...; a few English ones,
    and the chat roles), and a `tokenizer_config.json` with `chat_template` (None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "system", "user", "assistant"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(len(words), vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(os.path.join(path, "tokenizer.json"))
    if chat_template is not None:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": chat_template, "unk_token": "<unk>"}, f)


def compile_prefill(engine, prompts: list[list[int]]) -> None:
    """Runs `engine`'s prefill of `prompts` with and without the LoRA ops (the two variants `prefill_logits`
    compiles per shape), the LoRA one with every token on slot 0 whether or not an adapter is loaded there: what
    a test compiles before it loads more adapters and checks that nothing recompiles. The LoRA variant holds the
    parts the adapters installed so far target (`AdapterPool.step_weights`): load one of each kind first."""
    from jlora.runner import pack_prompts

    engine.prefill_logits(prompts, [None] * len(prompts))
    tokens, positions, token_slot, _ = pack_prompts(prompts, [0] * len(prompts))
    engine.runner.run(tokens, positions, token_slot.reshape(-1), engine.runner.new_cache(*tokens.shape))
