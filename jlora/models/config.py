"""Model configuration of the Llama family (HF model types `llama`, `mistral`, `qwen2`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jlora.values import is_integer, is_real

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# config.json's fields that every model of these types has, each a positive integer
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The fields of an HF `config.json` the model uses; every field is used."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Llama-3 rope scaling as (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    rope_llama3: tuple[float, float, float, int] | None
    qkv_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None  # attend to at most this many most recent positions (Mistral v0.1) ...
    sliding_layers: frozenset[int] = frozenset()  # ... in these layers (Mistral: all; Qwen2: as its config says)
    max_position_embeddings: int | None = None  # the context it was trained for (LongLoRA scales from it)
    # How the model stores its projections' weights (jlora's choice, not the checkpoint's): [in, out], or HF's own
    # [out, in], whose one-token products run as row reductions (`jlora.models.llama.project`).
    weights_out_in: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to every earlier position)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a parsed HF `config.json`; unsupported model types and rope scalings raise ValueError."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        for key in (*_POSITIVE_INTS, "num_key_value_heads", "head_dim"):  # the last two may be absent or null
            value = hf.get(key)
            if value is None and key in _POSITIVE_INTS:
                raise ValueError(f"config.json has no {key!r}")
            if value is not None and not (is_integer(value) and value >= 1):
                raise ValueError(f"config.json: {key!r} must be a positive integer, got {value!r:.40}")
        heads = hf["num_attention_heads"]
        if hf.get("num_key_value_heads") and heads % hf["num_key_value_heads"]:
            raise ValueError(f"config.json: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={hf['num_key_value_heads']}")
        if not hf.get("head_dim") and hf["hidden_size"] % heads:
            raise ValueError(f"config.json: hidden_size={hf['hidden_size']} is not a multiple of "
                             f"num_attention_heads={heads}, and no head_dim is given")
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs `rope_scaling`.
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or None
        rope_theta = hf.get("rope_theta") or (scaling or {}).get("rope_theta", 10000.0)
        rope_llama3 = None
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                values = [scaling.get(k) for k in keys]
                if not all(is_real(v) and 0 < v < float("inf") for v in values) or not is_integer(values[3]):
                    raise ValueError(f"config.json: llama3 rope scaling needs finite positive numbers "
                                     f"{', '.join(keys)} (the last an integer), got {values}")
                rope_llama3 = (*map(float, values[:3]), int(values[3]))
            elif kind not in ("default", None):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
        if quantization := hf.get("quantization_config"):
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            raise ValueError(f"config.json: a quantized checkpoint ({method or 'quantization_config'}) is not "
                             "supported; load its unquantized bf16, fp16 or fp32 weights")
        activation = hf.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"config.json: hidden_act {activation!r:.40} is not supported (only 'silu')")
        for key in ("mlp_bias", "attention_bias") if model_type == "llama" else ():
            if hf.get(key):  # HF's Llama then has biases jlora's model lacks (o_proj's; the MLP's)
                raise ValueError(f"config.json: {key} true is not supported for llama (its "
                                 f"{'o_proj' if key == 'attention_bias' else 'MLP'} bias)")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        window, sliding = _sliding_window(model_type, hf)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_llama3=rope_llama3,
            qkv_bias=model_type == "qwen2",  # HF's Qwen2 always has q|k|v biases; Llama's only refused above
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=window,
            sliding_layers=sliding,
            max_position_embeddings=hf.get("max_position_embeddings"),
        )


def _sliding_window(model_type: str, hf: dict[str, Any]) -> tuple[int | None, frozenset[int]]:
    """(the window, the layers that use it) as HF's models read config.json: Llama has none; Mistral slides in
    every layer when `sliding_window` is set; Qwen2 only with `use_sliding_window` (default false), in the layers
    `layer_types` names "sliding_attention", or without them from layer `max_window_layers` (default 28) on."""
    window = hf.get("sliding_window")
    layers = range(hf["num_hidden_layers"])
    if model_type == "llama" or window is None:
        return None, frozenset()
    if not (is_integer(window) and window >= 1):
        raise ValueError(f"config.json: 'sliding_window' must be a positive integer or null, got {window!r:.40}")
    if model_type == "mistral":
        return window, frozenset(layers)
    if not hf.get("use_sliding_window", False):
        return None, frozenset()
    types = hf.get("layer_types")
    if types is not None:
        if not (isinstance(types, list) and len(types) == len(layers)
                and set(types) <= {"full_attention", "sliding_attention"}):
            raise ValueError(f"config.json: 'layer_types' must list 'full_attention' or 'sliding_attention' for "
                             f"each of the {len(layers)} layers")
        sliding = frozenset(i for i in layers if types[i] == "sliding_attention")
    else:
        first = hf.get("max_window_layers", 28)
        if not (is_integer(first) and first >= 0):
            raise ValueError(f"config.json: 'max_window_layers' must be an integer >= 0, got {first!r:.40}")
        sliding = frozenset(i for i in layers if i >= first)
    return (window, sliding) if sliding else (None, frozenset())
