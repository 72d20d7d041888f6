"""jlora: multi-LoRA inference for JAX on NVIDIA GPUs.

One base model serves many LoRA adapters in the same batch, each token using its own adapter, inside
`jax.jit` with static shapes. The public API:

- `LoRABatchInfo`: the batch's static-shape metadata (tokens grouped by adapter slot, segments, ranks).
- `lora_shrink`, `lora_expand`, `lora_linear`, `lora_embedding`: the multi-LoRA ops, each with
  `backend=` in {"auto", "reference", "ragged", "gather", "pallas"}.
- `Engine`: a Hugging Face Llama-family checkpoint plus PEFT adapters: `generate` (`Generation`s, with
  `TokenLogprob`s when asked), `chat` (conversations through the model's chat template, `ChatOptions`) and
  `score` (`Score`s); its options are one `EngineConfig`.
- `step_compiler_options`: the XLA options the engine compiles a model step with (for your own `jax.jit`).
"""

import importlib

__version__ = "0.1.0"

# Each public name and the module that defines it, imported on first use (PEP 562): `import jlora` loads no JAX, so
# the command line loads it inside its `main`, which takes a Ctrl-C during those seconds without a traceback.
_EXPORTS = {
    **dict.fromkeys(["AdapterError", "PoolFullError", "check_adapter_name"], "jlora.adapters"),
    **dict.fromkeys(["LoRABatchInfo", "num_segments", "token_slots_from_requests"], "jlora.batch_info"),
    "ChatOptions": "jlora.chat",
    "step_compiler_options": "jlora.compile_options",
    **dict.fromkeys(["Engine", "Generation"], "jlora.engine"),
    "EngineConfig": "jlora.engine_config",
    **dict.fromkeys(["Score", "TokenLogprob"], "jlora.logprobs"),
    "ModelConfig": "jlora.models.config",
    **dict.fromkeys(["BACKENDS", "Backend", "lora_embedding", "lora_expand", "lora_linear", "lora_shrink"],
                    "jlora.ops"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """A public name, or a submodule (`jlora.ops`), imported when first asked for."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":  # the submodule is there: something it imports is not
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
