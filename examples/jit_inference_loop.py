"""A plain `jax.jit` greedy decoding loop on the model and `LoRABatchInfo` directly (no Engine).

Two requests share each step: one uses adapter slot 0, the other the base model (slot -1). The adapter
weights are a `LoRAWeights` pytree with one slot filled by hand; a real program loads PEFT adapters with
`jlora.adapters.AdapterPool`. Run: python examples/jit_inference_loop.py
"""

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora import LoRABatchInfo, testing
from jlora.models.llama import Batch, KVCache, LoRAInput
from jlora.models.loading import load_model
from jlora.models.lora_weights import LoRAWeights

model_dir = tempfile.mkdtemp()
testing.write_model(model_dir, testing.tiny_config("llama"))
model = load_model(model_dir, jnp.float32, progress=False)
config = model.config

# One adapter slot of rank 16 with random q|k|v weights; rank and scaling per slot go into the batch info.
lora = LoRAWeights.zeros(config, num_slots=1, rank=16, dtype=jnp.float32)
key_a, key_b = jax.random.split(jax.random.key(0))
layer0 = lora.layers[0]
layer0.a["qkv"] = jax.random.normal(key_a, layer0.a["qkv"].shape) * 0.1
layer0.b["qkv"] = jax.random.normal(key_b, layer0.b["qkv"].shape) * 0.1
ranks, scalings = jnp.array([16]), jnp.array([2.0])

graphdef, state = nnx.split(model)


# The cache is donated: XLA updates it in place instead of writing a new copy on every step.
@functools.partial(jax.jit, donate_argnames="cache")
def step(state, tokens, positions, cache, token_slot):
    """tokens/positions [B, S], token_slot [B·S] -> (next tokens [B], cache)."""
    info = LoRABatchInfo.build(token_slot, ranks, scalings, block_m=16)  # built inside the jitted step
    logits, cache = nnx.merge(graphdef, state)(Batch.of(tokens, positions), cache, LoRAInput(lora, info))
    return jnp.argmax(logits[:, -1], axis=-1), cache


prompts = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int32)
slots = np.array([0, -1], np.int32)  # request 0: adapter slot 0; request 1: base model
cache = KVCache.zeros(config, blocks=2, block_size=16, dtype=jnp.float32)  # request b in block b
positions = np.broadcast_to(np.arange(4, dtype=np.int32), (2, 4))
token, cache = step(state, prompts, positions, cache, np.repeat(slots, 4))
generated = [np.asarray(token)]
for pos in range(4, 12):
    token, cache = step(state, np.asarray(token)[:, None], np.full((2, 1), pos, np.int32), cache, slots)
    generated.append(np.asarray(token))
print("generated:", np.stack(generated, axis=1).tolist(), "| compilations:", step._cache_size())
