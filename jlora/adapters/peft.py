"""PEFT LoRA adapters: parse, validate and convert one adapter directory into slot-ready host arrays.

Reads `adapter_config.json` + `adapter_model.safetensors` and returns `HostAdapter`: for every target
group of every layer (and the embedding / lm_head) the A and B of one slot, zero-padded to the pool's rank
R, with the module's scaling folded into B. Everything is checked before anything reaches the device, so a
bad adapter never touches the pool.

Supported: `r`, `lora_alpha`, `use_rslora`, `target_modules` (list of names, a regex string or
"all-linear"), `rank_pattern`, `alpha_pattern`, `layers_to_transform`, `fan_in_fan_out` (for Llama's
nn.Linear layers PEFT itself resets it to False, and so do we). Anything that would change the math and
is not implemented (`use_dora`, `lora_bias`, `modules_to_save`, `bias` != "none", ...) raises.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jlora.models.config import ModelConfig
from jlora.models.lora_weights import module_shapes

__all__ = ["AdapterError", "HostAdapter", "read_adapter"]

LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_UNSUPPORTED = {  # config key: (value that is fine, what to say)
    "use_dora": (False, "DoRA (use_dora=True)"),
    "lora_bias": (False, "LoRA bias (lora_bias=True)"),
    "modules_to_save": (None, "modules_to_save (fully trained extra modules)"),
    "bias": ("none", "trained biases (bias != 'none')"),
    "layer_replication": (None, "layer_replication"),
    "use_qalora": (False, "QALoRA (use_qalora=True)"),
    "target_parameters": (None, "target_parameters (LoRA on raw parameters)"),
}
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+?)\.(?:(?P<ab>lora_[AB])(?:\.default)?\.weight|(?P<emb>lora_embedding_[AB])(?:\.default)?)$"
)
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<name>\w+)$")


class AdapterError(ValueError):
    """A PEFT adapter that cannot be loaded; the message names the adapter path and the problem."""


@dataclasses.dataclass(frozen=True)
class HostAdapter:
    """One adapter converted for a slot (float32 NumPy, scaling folded into the B side)."""

    rank: int  # the largest rank over its modules
    layers: tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]  # group -> (a [S·R, K], b [N, R])
    embed: tuple[np.ndarray, np.ndarray]  # a [R, V], b [H, R]
    lm_head: tuple[np.ndarray, np.ndarray]  # a [R, H], b [V, R]


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _targets(cfg: dict, module: str) -> bool:
    target = cfg.get("target_modules")
    name = module.rsplit(".", 1)[-1]
    if isinstance(target, str):
        if target == "all-linear":
            return name in LINEAR_MODULES
        return re.fullmatch(target, module) is not None
    return any(module == t or module.endswith("." + t) for t in (target or ()))


def _read_config(adapter_dir: str) -> dict:
    path = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(path):
        raise AdapterError(f"{adapter_dir}: adapter_config.json not found")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as err:
        raise AdapterError(f"{path}: not valid JSON ({err})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{adapter_dir}: peft_type {cfg['peft_type']!r} is not supported (only LORA)")
    for key, (fine, what) in _UNSUPPORTED.items():
        value = cfg.get(key, fine)
        if value not in (fine, [], {}) and not (fine is None and not value):
            raise AdapterError(f"{adapter_dir}: {what} is not supported")
    if "r" not in cfg or "lora_alpha" not in cfg:
        raise AdapterError(f"{adapter_dir}: adapter_config.json needs 'r' and 'lora_alpha'")
    return cfg


def _read_tensors(adapter_dir: str) -> dict[str, np.ndarray]:
    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(adapter_dir, "adapter_model.bin")):
            raise AdapterError(f"{adapter_dir}: only adapter_model.bin (a torch pickle); save with safetensors")
        raise AdapterError(f"{adapter_dir}: adapter_model.safetensors not found")
    tensors = {}
    try:
        with jax.default_device(jax.devices("cpu")[0]), safe_open(path, framework="flax") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if not np.issubdtype(t.dtype, np.floating) and t.dtype.name != "bfloat16":
                    raise AdapterError(f"{path}: tensor {key} has dtype {t.dtype}; LoRA weights must be floating")
                tensors[key] = np.asarray(t.astype(np.float32))
                if not np.isfinite(tensors[key]).all():  # one inf would make every token of the adapter inf
                    bad = int((~np.isfinite(tensors[key])).sum())
                    raise AdapterError(f"{path}: tensor {key} holds {bad} non-finite values (NaN or inf)")
    except SafetensorError as err:
        raise AdapterError(f"{path}: cannot read safetensors ({err})") from None
    return tensors


def read_adapter(adapter_dir: str, config: ModelConfig, max_rank: int, padded_rank: int) -> HostAdapter:
    """Parses and validates a PEFT adapter directory into slot arrays zero-padded to `padded_rank`.

    Raises:
      AdapterError: missing or corrupt files, unsupported features, unknown modules, ranks above
        `max_rank`, shapes that do not match the base model, or non-floating tensors.
    """
    cfg = _read_config(adapter_dir)
    tensors = _read_tensors(adapter_dir)
    layers_to_transform = cfg.get("layers_to_transform")
    if isinstance(layers_to_transform, int):
        layers_to_transform = [layers_to_transform]

    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{adapter_dir}: unexpected tensor {key!r} (not a PEFT LoRA weight)")
        pairs.setdefault(m["module"], {})[(m["ab"] or m["emb"])[-1]] = value

    groups = module_shapes(config)
    slot_of = {name: (g, i) for g, (_, outs) in groups.items() for i, (name, _) in enumerate(outs)}
    h, v, r_pad = config.hidden_size, config.vocab_size, padded_rank
    layers = [
        {g: (np.zeros((len(outs) * r_pad, k), np.float32), np.zeros((sum(n for _, n in outs), r_pad), np.float32))
         for g, (k, outs) in groups.items()}
        for _ in range(config.num_layers)
    ]
    embed = (np.zeros((r_pad, v), np.float32), np.zeros((h, r_pad), np.float32))
    lm_head = (np.zeros((r_pad, h), np.float32), np.zeros((v, r_pad), np.float32))
    rank_used = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{adapter_dir}: module {module} has lora_{'A' if 'A' in ab else 'B'} only")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{adapter_dir}: {module}: lora_A {a.shape} and lora_B {b.shape} disagree on the rank")
        rank = a.shape[0]
        expected_rank = _pattern_value(cfg.get("rank_pattern") or {}, module, cfg["r"])
        if rank != expected_rank:
            raise AdapterError(f"{adapter_dir}: {module}: rank {rank} but the config says r={expected_rank}")
        if rank > max_rank:
            raise AdapterError(f"{adapter_dir}: {module}: rank {rank} exceeds max_lora_rank={max_rank}")
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        scale = alpha / np.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        lm = _LAYER_MODULE.match(module)
        if module in ("model.embed_tokens", "lm_head"):
            (dst_a, dst_b), want = (embed, ((rank, v), (h, rank))) if module == "model.embed_tokens" else \
                (lm_head, ((rank, h), (v, rank)))
            if (a.shape, b.shape) != want:
                raise AdapterError(f"{adapter_dir}: {module}: A {a.shape}, B {b.shape}; the base model needs {want}")
            dst_a[:rank] = a
            dst_b[:, :rank] = scale * b
        elif lm and lm["name"] in slot_of and int(lm["layer"]) < config.num_layers:
            layer = int(lm["layer"])
            if layers_to_transform is not None and layer not in layers_to_transform:
                raise AdapterError(f"{adapter_dir}: {module}: weights for a layer outside layers_to_transform")
            if not _targets(cfg, module):
                raise AdapterError(f"{adapter_dir}: {module}: weights for a module outside target_modules")
            group, i = slot_of[lm["name"]]
            k, outs = groups[group]
            n = outs[i][1]
            if a.shape[1] != k or b.shape[0] != n:
                raise AdapterError(
                    f"{adapter_dir}: {module}: A {a.shape} and B {b.shape} do not fit the base layer "
                    f"(in {k}, out {n})"
                )
            ga, gb = layers[layer][group]
            col = sum(m for _, m in outs[:i])
            ga[i * r_pad : i * r_pad + rank] = a
            gb[col : col + n, :rank] = scale * b
        else:
            raise AdapterError(f"{adapter_dir}: unknown module {module!r} for a {config.model_type} model "
                               f"with {config.num_layers} layers")
        rank_used = max(rank_used, rank)
    if not pairs:
        raise AdapterError(f"{adapter_dir}: adapter_model.safetensors holds no LoRA weights")
    return HostAdapter(rank=rank_used, layers=tuple(layers), embed=embed, lm_head=lm_head)
