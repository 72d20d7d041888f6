"""The adapters' stacked device weights, per target module, as one pytree the jitted model takes.

Every target module's weights are stacked over the `L` adapter slots and zero-padded to the pool's rank
R (a power of two >= 16, the kernels' rank): A [L, S·R, K] and B [L, N, R]. The adapter's scaling (alpha / r,
or alpha / sqrt(r) with rsLoRA, per module under rank_pattern / alpha_pattern) is folded into B at load
time, so `LoRABatchInfo.scalings` is 1 for every slot; a module an adapter does not target is all zeros, and a
group (or the embedding, the lm_head) that no adapter in the pool targets is not held at all.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jlora.models.config import ModelConfig

__all__ = ["LayerLoRA", "LoRAWeights", "RowOverrides", "module_shapes"]


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, tuple[tuple[str, int], ...]]]:
    """group -> (input dim K, ((module name, output dim), ...)) for the decoder layers' fused groups."""
    h, i = config.hidden_size, config.intermediate_size
    return {
        "qkv": (h, (("q_proj", config.q_size), ("k_proj", config.kv_size), ("v_proj", config.kv_size))),
        "o": (config.q_size, (("o_proj", h),)),
        "gate_up": (h, (("gate_proj", i), ("up_proj", i))),
        "down": (i, (("down_proj", h),)),
    }


@functools.partial(jax.tree_util.register_dataclass, data_fields=["a", "b", "scale", "shift"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerLoRA:
    """One fused group of one layer: `a` [L, S·R, K], `b` [L, N, R] (slices stacked along N), and the optional
    per-slot column affine `scale`, `shift` [L, N] (DoRA, LoRA bias; None when no loaded adapter has one)."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scale: dict[str, jax.Array] | None = None
    shift: dict[str, jax.Array] | None = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["embed_ids", "embed_rows", "lm_head_ids",
                                                                  "lm_head_rows"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RowOverrides:
    """Per slot, up to E embedding and lm_head rows that replace the base model's (their LoRA folded in):
    token ids [L, E] int32 (-1: unused) and rows [L, E, H]. Ids from V up are tokens the adapter adds."""

    embed_ids: jax.Array
    embed_rows: jax.Array
    lm_head_ids: jax.Array
    lm_head_rows: jax.Array

    @property
    def extra_vocab(self) -> int:
        return self.embed_ids.shape[1]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["layers", "embed_a", "embed_b", "lm_head_a", "lm_head_b", "lm_head_scale", "lm_head_shift", "rows",
                 "rope_factor"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class LoRAWeights:
    """All adapter slots' weights. `layers[l].a[group]` etc.; embedding and lm_head apart. The optional parts
    (None when no loaded adapter uses them, so a step without them compiles and costs as before): the lm_head's
    column affine, row overrides, and the LongLoRA RoPE factor per slot [L] f32."""

    layers: tuple[LayerLoRA, ...]
    embed_a: jax.Array | None  # [L, R, V] lora_embedding_A (None: no adapter targets the embedding)
    embed_b: jax.Array | None  # [L, H, R] lora_embedding_B (scaled)
    lm_head_a: jax.Array | None  # [L, R, H] (None: no adapter targets the lm_head)
    lm_head_b: jax.Array | None  # [L, V, R] (scaled)
    lm_head_scale: jax.Array | None = None  # [L, V]
    lm_head_shift: jax.Array | None = None  # [L, V]
    rows: RowOverrides | None = None
    rope_factor: jax.Array | None = None  # [L]

    @staticmethod
    def zeros(config: ModelConfig, num_slots: int, rank: int, dtype, targets=None) -> LoRAWeights:
        """Empty slots: every weight zero, no optional part; only the groups (and "embed", "lm_head") in
        `targets` when given, the others absent (an empty dict, None), as no adapter targets them."""
        z = lambda *shape: jnp.zeros(shape, dtype)
        held = lambda part: targets is None or part in targets
        groups = {g: shape for g, shape in module_shapes(config).items() if held(g)}
        layer = lambda: LayerLoRA(
            a={g: z(num_slots, len(outs) * rank, k) for g, (k, outs) in groups.items()},
            b={g: z(num_slots, sum(n for _, n in outs), rank) for g, (k, outs) in groups.items()},
        )
        v, h = config.vocab_size, config.hidden_size
        return LoRAWeights(
            layers=tuple(layer() for _ in range(config.num_layers)),
            embed_a=z(num_slots, rank, v) if held("embed") else None,
            embed_b=z(num_slots, h, rank) if held("embed") else None,
            lm_head_a=z(num_slots, rank, h) if held("lm_head") else None,
            lm_head_b=z(num_slots, v, rank) if held("lm_head") else None,
        )
