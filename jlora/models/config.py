"""Model configuration of the Llama family (HF model types `llama`, `mistral`, `qwen2`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jlora.values import is_integer

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
    sliding_window: int | None  # attend to at most this many most recent positions (Mistral v0.1)
    max_position_embeddings: int | None = None  # the context it was trained for (LongLoRA scales from it)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

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
                rope_llama3 = (
                    float(scaling["factor"]),
                    float(scaling["low_freq_factor"]),
                    float(scaling["high_freq_factor"]),
                    int(scaling["original_max_position_embeddings"]),
                )
            elif kind not in ("default", None):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
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
            qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
            max_position_embeddings=hf.get("max_position_embeddings"),
        )
