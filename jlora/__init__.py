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

from jlora.adapters import AdapterError, PoolFullError, check_adapter_name
from jlora.batch_info import LoRABatchInfo, num_segments, token_slots_from_requests
from jlora.chat import ChatOptions
from jlora.compile_options import step_compiler_options
from jlora.engine import Engine, Generation
from jlora.engine_config import EngineConfig
from jlora.logprobs import Score, TokenLogprob
from jlora.models.config import ModelConfig
from jlora.ops import BACKENDS, Backend, lora_embedding, lora_expand, lora_linear, lora_shrink

__version__ = "0.1.0"

__all__ = [
    "AdapterError",
    "BACKENDS",
    "Backend",
    "ChatOptions",
    "Engine",
    "EngineConfig",
    "Generation",
    "LoRABatchInfo",
    "ModelConfig",
    "PoolFullError",
    "Score",
    "TokenLogprob",
    "check_adapter_name",
    "lora_embedding",
    "lora_expand",
    "lora_linear",
    "lora_shrink",
    "num_segments",
    "step_compiler_options",
    "token_slots_from_requests",
]
