"""`jlora.lora_linear` inside your own Flax NNX module: a fused q|k|v projection serving many adapters.

Run: python examples/lora_in_my_module.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jlora


class MultiLoRAQKV(nnx.Module):
    """A fused q|k|v projection whose tokens each add their own adapter's LoRA."""

    def __init__(self, dim: int, sizes: tuple[int, int, int], *, num_slots: int, rank: int, rngs: nnx.Rngs):
        self.sizes = sizes
        self.w = nnx.Param(jax.random.normal(rngs.params(), (dim, sum(sizes))) / np.sqrt(dim))
        # Stacked adapter weights: A [L, 3·R, K] and B [L, N, R] (PEFT's lora_A / lora_B, zero-padded to R).
        self.lora_a = nnx.Variable(jax.random.normal(rngs.params(), (num_slots, 3 * rank, dim)) / np.sqrt(dim))
        self.lora_b = nnx.Variable(jax.random.normal(rngs.params(), (num_slots, sum(sizes), rank)) * 0.1)

    def __call__(self, x: jax.Array, info: jlora.LoRABatchInfo) -> jax.Array:
        """x [T, dim] -> [T, q + k + v]."""
        base = x @ self.w[...]
        return jlora.lora_linear(x, base, self.lora_a[...], self.lora_b[...], info, slice_sizes=self.sizes)


layer = MultiLoRAQKV(64, (64, 32, 32), num_slots=4, rank=16, rngs=nnx.Rngs(0))


@nnx.jit
def forward(layer, x, token_slot, ranks, scalings):
    info = jlora.LoRABatchInfo.build(token_slot, ranks, scalings)
    return layer(x, info)


x = jnp.asarray(np.random.default_rng(0).standard_normal((10, 64)), jnp.float32)
token_slot = jnp.array([0, 0, 1, -1, 3, 3, 3, 2, -1, 1])  # per-token adapter slot, -1 = base only
ranks, scalings = jnp.array([16, 8, 4, 16]), jnp.array([2.0, 1.0, 0.5, 1.0])
y = forward(layer, x, token_slot, ranks, scalings)
print("output", y.shape, "| base-only rows unchanged:",
      bool(jnp.allclose(y[3], x[3] @ layer.w[...], atol=1e-5)))
