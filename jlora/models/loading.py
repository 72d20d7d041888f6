"""Hugging Face checkpoint loading: `config.json` + safetensors (single file or sharded index).

Tensors are read memory-mapped one at a time, converted (HF's [out, in] to our [in, out], q|k|v and
gate|up concatenated) and placed on the device, with a progress bar. The model is built abstractly with
`nnx.eval_shape` and filled from the converted tensors, each checked against the shape the config implies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from jlora.models.config import ModelConfig
from jlora.models.llama import Transformer
from jlora.values import is_integer, is_real

__all__ = ["GenerationDefaults", "checkpoint_files", "eos_token_ids", "generation_defaults", "load_model",
           "read_config", "read_json_object"]


def read_config(model_dir: str) -> ModelConfig:
    """The `ModelConfig` of an HF model directory."""
    if not os.path.isdir(model_dir):
        what = "is not a directory" if os.path.exists(model_dir) else "does not exist"
        raise FileNotFoundError(f"model directory {model_dir!r} {what}")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
    return ModelConfig.from_hf_config(read_json_object(path))


def eos_token_ids(model_dir: str) -> frozenset[int]:
    """The model's end-of-sequence ids (generation_config.json, else config.json): where generation stops, as
    in HF's `generate`."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            value = read_json_object(path).get("eos_token_id")
            if value is not None:
                ids = value if isinstance(value, list) else [value]
                if not all(is_integer(i) and i >= 0 for i in ids):
                    raise ValueError(f"{path}: eos_token_id must be a token id or a list of them")
                return frozenset(ids)
    return frozenset()


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """The sampling settings a model's generation_config.json recommends (None: it sets none).

    Taken as vLLM's server takes them: every one the file sets (transformers 5's `GenerationConfig.to_diff_dict`,
    its defaults all unset), `do_sample` not read. `max_tokens` is its `max_new_tokens`.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    repetition_penalty: float | None = None

    def set(self) -> dict[str, float | int]:
        """The settings it holds, by field name."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


# generation_config.json's key -> (GenerationDefaults field, the values it may take)
_GENERATION_KEYS = {
    "temperature": ("temperature", lambda v: is_real(v) and 0 <= v < math.inf, "a number >= 0"),
    "top_p": ("top_p", lambda v: is_real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", lambda v: is_integer(v) and v >= 0, "an integer >= 0"),
    "min_p": ("min_p", lambda v: is_real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "max_new_tokens": ("max_tokens", lambda v: is_integer(v) and v >= 1, "an integer >= 1"),
    "repetition_penalty": ("repetition_penalty", lambda v: is_real(v) and 0 < v <= 2, "a number in (0, 2]"),
}


def generation_defaults(model_dir: str) -> GenerationDefaults:
    """The sampling defaults of the model's generation_config.json (`GenerationDefaults`; none without the file).

    Raises:
      ValueError: a setting outside the values it may take, naming the file and the key.
    """
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return GenerationDefaults()
    given, found = read_json_object(path), {}
    for key, (field, valid, what) in _GENERATION_KEYS.items():
        value = given.get(key)
        if value is None:
            continue
        if not valid(value):
            raise ValueError(f"{path}: {key} must be {what}, got {value!r:.40}")
        found[field] = int(value) if field in ("top_k", "max_tokens") else float(value)
    return GenerationDefaults(**found)


def read_json_object(path: str) -> dict:
    """The JSON object in `path` (a model directory's config files); ValueError naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def _safetensors(path: str):
    """`safe_open` of a checkpoint file; a file that cannot be read is a ValueError naming it."""
    try:
        return safe_open(path, framework="flax")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: cannot read safetensors ({type(err).__name__}: {str(err)[:200]})") from None


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file holding it."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} must hold a 'weight_map' object of tensor names to file names")
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    if os.path.isfile(single):
        with _safetensors(single) as f:
            return {name: single for name in f.keys()}
    if any(n.endswith(".bin") or n.endswith(".pt") for n in os.listdir(model_dir)):
        raise ValueError(
            f"{model_dir} holds only PyTorch pickle weights (*.bin); jlora loads safetensors only "
            "(convert with `model.save_pretrained(dir, safe_serialization=True)`)"
        )
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _param_sources(config: ModelConfig) -> dict[tuple, tuple[list[str], Callable]]:
    """Our parameter path -> (HF tensor names, how to combine them)."""
    cat = lambda *ws: jnp.concatenate(ws)
    # the projections' [out, in] tensors -> [sum(out), in] as they are (weights_out_in), else -> [in, sum(out)]
    t = cat if config.weights_out_in else lambda *ws: jnp.concatenate([w.T for w in ws], axis=1)
    same = lambda w: w
    sources = {("embed",): (["model.embed_tokens.weight"], same), ("norm", "weight"): (["model.norm.weight"], same)}
    if not config.tie_word_embeddings:
        sources[("lm_head", "weight")] = (["lm_head.weight"], t)
    for i in range(config.num_layers):
        hf = f"model.layers.{i}."
        attn = [hf + f"self_attn.{m}_proj" for m in "qkv"]
        sources[("layers", i, "input_norm", "weight")] = ([hf + "input_layernorm.weight"], same)
        sources[("layers", i, "post_attn_norm", "weight")] = ([hf + "post_attention_layernorm.weight"], same)
        sources[("layers", i, "attn", "qkv", "weight")] = ([a + ".weight" for a in attn], t)
        if config.qkv_bias:
            sources[("layers", i, "attn", "qkv", "bias")] = ([a + ".bias" for a in attn], cat)
        sources[("layers", i, "attn", "o", "weight")] = ([hf + "self_attn.o_proj.weight"], t)
        sources[("layers", i, "mlp", "gate_up", "weight")] = ([hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"], t)
        sources[("layers", i, "mlp", "down", "weight")] = ([hf + "mlp.down_proj.weight"], t)
    return sources


_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors' names


def load_model(model_dir: str, dtype=jnp.bfloat16, *, progress: bool = True, out_in: bool = False) -> Transformer:
    """Builds the `Transformer` of an HF directory and fills it from its safetensors, on the default device; with
    `out_in`, its projections' weights [out, in] as the checkpoint stores them (`ModelConfig.weights_out_in`).

    Raises:
      FileNotFoundError: missing directory, config or weights.
      ValueError: unsupported model type, pickle-only weights, a missing tensor or a shape mismatch.
    """
    config = dataclasses.replace(read_config(model_dir), weights_out_in=out_in)
    files = checkpoint_files(model_dir)
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    sources = _param_sources(config)
    handles: dict[str, object] = {}
    loaded = []
    try:
        for path, var in tqdm(nnx.to_flat_state(state), desc=f"loading {os.path.basename(model_dir)}",
                              disable=not progress, unit="tensor"):
            names, combine = sources[path]
            tensors = []
            for name in names:
                if name not in files:
                    raise ValueError(f"tensor {name!r} is missing from the checkpoint in {model_dir}")
                handle = handles.get(files[name])
                if handle is None:
                    handle = handles[files[name]] = _safetensors(files[name])
                stored = handle.get_slice(name).get_dtype()  # fp8 or integer weights hold scales elsewhere
                if stored not in _FLOAT_DTYPES:
                    raise ValueError(f"tensor {name!r} is {stored}: jlora loads BF16, F16 or F32 weights")
                tensors.append(handle.get_tensor(name))
            value = combine(*tensors).astype(dtype)
            if value.shape != var.shape:
                shapes = " + ".join(str(tuple(t.shape)) for t in tensors)
                raise ValueError(f"{' + '.join(names)}: shape {shapes} does not match the config (expected "
                                 f"{var.shape} after conversion)")
            loaded.append((path, type(var)(value)))
    finally:
        handles.clear()
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))
