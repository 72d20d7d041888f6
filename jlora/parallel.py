"""Megatron-style tensor parallelism over a 1-D device mesh (axis "tp"), with multi-LoRA, via `shard_map`.

Layout (every device runs the same model code on its shard, built from a *local* config):
- q|k|v and gate|up are column-parallel: each device holds its heads' q, k, v columns (and its slice of the
  intermediate dimension for gate and up), reordered at load time so a plain even split of the fused
  weight gives every device a contiguous [q_d | k_d | v_d] (or [gate_d | up_d]) block.
- o and down are row-parallel: each device holds the rows of its heads (intermediate slice) and the partial
  outputs are summed with one `psum` per layer and projection.
- KV heads are split across devices; with fewer KV heads than devices, each device holds a copy of the one
  KV head its query heads use (the weights are replicated, so the cache holds `tp` KV heads in all).
- The lm_head is vocab-parallel: each device holds V / tp of its columns and computes those logits, which
  leave `shard_map` split along the vocabulary (sampling inside the jitted step works on them as they are; XLA
  adds the small reductions an argmax needs). At batch 32 the lm_head is one of the largest reads of a decode
  step (1.05 GB for Llama-3-8B), so replicating it would cost every device the whole read. With tied word
  embeddings, or a vocabulary that `tp` does not divide, it stays replicated. The embedding is replicated: a
  lookup reads only the batch's rows, so splitting it would save memory but add a collective per step.

LoRA follows vLLM's fully sharded LoRA: for the column-parallel layers A is replicated (every device computes
the small [T, S·R] shrink) and B is split along its output rows like the base weight; for the row-parallel
layers A is split along its input dim and B is replicated. vLLM all-reduces the partial [T, R] shrink results
before the expand; here each device expands its own partial shrink into its partial base output (the expand
is linear in the shrink), so the layer's one all-reduce of the base output carries the LoRA deltas too and
LoRA adds no collective (the expand's work is the same: every device expanded the full N either way). The
Pallas kernels run per shard inside `shard_map`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jlora.adapters.peft import HostAdapter
from jlora.models.config import ModelConfig
from jlora.models.llama import Transformer
from jlora.models.lora_weights import LayerLoRA, LoRAWeights, RowOverrides, module_shapes

__all__ = ["TensorParallel"]

AXIS = "tp"


@dataclasses.dataclass(frozen=True, eq=False)
class TensorParallel:
    """How a model of `config` is split over `mesh` (see the module docstring)."""

    mesh: Mesh
    config: ModelConfig  # the checkpoint's
    local: ModelConfig  # one device's shard: heads / tp, KV heads / tp (or 1), intermediate / tp, lm_head's vocab
    layout: ModelConfig  # the global (all devices) shapes of the TP layout: KV heads tp x local
    qkv_perm: np.ndarray  # [tp · (q_l + 2 kv_l)] columns of the checkpoint's fused q|k|v, device by device
    gate_up_perm: np.ndarray  # [2 · intermediate] columns of gate|up, device by device
    vocab_parallel: bool  # the lm_head (and its LoRA B) split along the vocabulary

    def logits_spec(self, rank: int = 3) -> P:
        """PartitionSpec of the model's logits ([B, S, V], or [N, V] at rank 2) as they leave `shard_map`."""
        return P(*[None] * (rank - 1), AXIS) if self.vocab_parallel else P()

    @classmethod
    def create(cls, config: ModelConfig, size: int, devices=None) -> TensorParallel:
        """Checks that `config` splits `size` ways and builds the layout; `devices` default to the first `size`."""
        devices = list(devices if devices is not None else jax.devices()[:size])
        if len(devices) != size:
            raise ValueError(f"tensor_parallel={size} needs {size} devices, found {len(jax.devices())}")
        h, kv, inter, d = config.num_heads, config.num_kv_heads, config.intermediate_size, config.head_dim
        if h % size or inter % size:
            raise ValueError(f"tensor_parallel={size} must divide num_heads={h} and intermediate_size={inter}")
        if kv % size and size % kv:
            raise ValueError(f"tensor_parallel={size} and num_key_value_heads={kv}: one must divide the other")
        h_l, kv_l, inter_l, group = h // size, max(1, kv // size), inter // size, h // kv
        q_cols, kv_cols, gate_up = [], [], []
        for dev in range(size):
            heads = range(dev * h_l, (dev + 1) * h_l)
            kv_heads = sorted({q // group for q in heads})  # one copy each; several devices may share one
            assert len(kv_heads) == kv_l, (kv_heads, kv_l)
            q_cols.append(np.concatenate([np.arange(q * d, (q + 1) * d) for q in heads]))
            kv_cols.append(np.concatenate([np.arange(j * d, (j + 1) * d) for j in kv_heads]))  # same for k, v
            own = np.arange(dev * inter_l, (dev + 1) * inter_l)
            gate_up += [own, inter + own]
        q_size, kv_size = h * d, kv * d
        qkv_perm = np.concatenate([np.concatenate([q, q_size + k_or_v, q_size + kv_size + k_or_v])
                                   for q, k_or_v in zip(q_cols, kv_cols)])
        vocab_parallel = not config.tie_word_embeddings and config.vocab_size % size == 0
        local = dataclasses.replace(config, num_heads=h_l, num_kv_heads=kv_l, intermediate_size=inter_l,
                                    vocab_size=config.vocab_size // size if vocab_parallel else config.vocab_size)
        layout = dataclasses.replace(config, num_kv_heads=size * kv_l)
        return cls(Mesh(np.array(devices), (AXIS,)), config, local, layout, qkv_perm, np.concatenate(gate_up),
                   vocab_parallel)

    # ---- base weights ------------------------------------------------------------------------------------------
    def state_spec(self, path: tuple) -> P:
        """PartitionSpec of a model parameter by its path: a weight split along its outputs or its inputs, which
        are its columns or rows as the model stores them (`ModelConfig.weights_out_in`)."""
        name = ".".join(str(p) for p in path)
        rows, columns = P(AXIS, None), P(None, AXIS)
        outputs, inputs = (rows, columns) if self.config.weights_out_in else (columns, rows)
        column_parallel = name.endswith(("attn.qkv.weight", "mlp.gate_up.weight"))
        if column_parallel or (self.vocab_parallel and name == "lm_head.weight"):
            return outputs
        if name.endswith("attn.qkv.bias"):
            return P(AXIS)
        if name.endswith(("attn.o.weight", "mlp.down.weight")):
            return inputs
        return P()

    def shard_model(self, model: Transformer) -> tuple[nnx.GraphDef, nnx.State]:
        """The local model's graphdef and the full model's parameters, reordered and placed on the mesh."""
        abstract = nnx.eval_shape(lambda: Transformer(self.local, dtype=model.embed[...].dtype, rngs=nnx.Rngs(0)))
        graphdef, _ = nnx.split(abstract)
        _, state = nnx.split(model)
        placed, outputs = [], 0 if self.config.weights_out_in else -1  # a weight's output axis
        for path, var in nnx.to_flat_state(state):
            value = var[...]
            name = ".".join(str(p) for p in path)
            if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
                value = jnp.take(value, self.qkv_perm, axis=outputs if name.endswith("weight") else -1)
            elif name.endswith("mlp.gate_up.weight"):
                value = jnp.take(value, self.gate_up_perm, axis=outputs)
            placed.append((path, type(var)(jax.device_put(value, NamedSharding(self.mesh, self.state_spec(path))))))
        return graphdef, nnx.from_flat_state(placed)

    def state_specs(self, state: nnx.State):
        return nnx.from_flat_state([(path, self.state_spec(path)) for path, _ in nnx.to_flat_state(state)])

    # ---- adapters ----------------------------------------------------------------------------------------------
    def lora_specs(self, like: LoRAWeights | None = None) -> LoRAWeights:
        """PartitionSpecs of the stacked adapter weights (with the optional parts `like` holds): B of
        column-parallel layers (and of a vocab-parallel lm_head) split along N, and so their column affine; A of
        row-parallel layers split along K; the rest replicated."""
        columns = P(None, AXIS)  # no trailing None: the spec an adapter write's jit returns, so loads never recompile
        split = {"qkv": columns, "o": P(), "gate_up": columns, "down": P()}
        inputs = {"qkv": P(), "o": P(None, None, AXIS), "gate_up": P(), "down": P(None, None, AXIS)}
        kept = lambda specs, parts: None if parts is None else {g: specs[g] for g in parts}  # like's groups
        layers = []
        for i in range(self.config.num_layers):
            layer = None if like is None else like.layers[i]
            layers.append(LayerLoRA(
                a=inputs if layer is None else kept(inputs, layer.a),
                b=split if layer is None else kept(split, layer.b),
                scale=None if layer is None else kept(split, layer.scale),
                shift=None if layer is None else kept(split, layer.shift)))
        lm_columns = columns if self.vocab_parallel else P()
        held = lambda part, spec: spec if like is None or getattr(like, part) is not None else None
        optional = lambda part, spec: None if like is None or getattr(like, part) is None else spec
        return LoRAWeights(layers=tuple(layers), embed_a=held("embed_a", P()), embed_b=held("embed_b", P()),
                           lm_head_a=held("lm_head_a", P()), lm_head_b=held("lm_head_b", lm_columns),
                           lm_head_scale=optional("lm_head_scale", lm_columns),
                           lm_head_shift=optional("lm_head_shift", lm_columns),
                           rows=optional("rows", RowOverrides(P(), P(), P(), P())),
                           rope_factor=optional("rope_factor", P()))

    def shard_lora(self, weights: LoRAWeights) -> LoRAWeights:
        return jax.tree.map(lambda w, s: jax.device_put(w, NamedSharding(self.mesh, s)), weights,
                            self.lora_specs(weights))

    def _perm(self, group: str) -> np.ndarray | None:
        return {"qkv": self.qkv_perm, "gate_up": self.gate_up_perm}.get(group)

    def permute_adapter(self, host: HostAdapter) -> HostAdapter:
        """Reorders an adapter's B rows of q|k|v and gate|up into the TP layout (KV rows copied if shared): B
        of the whole group, the slices of modules the adapter does not target zero (`HostAdapter.slices`)."""
        groups = module_shapes(self.config)
        layers = tuple({g: (a, b if self._perm(g) is None else host.group(i, g, groups[g][1])[1][self._perm(g)])
                        for g, (a, b) in layer.items()} for i, layer in enumerate(host.layers))
        return dataclasses.replace(host, layers=layers)

    def permute_columns(self, values: dict[tuple[int | None, str], np.ndarray]) -> dict:
        """Per (layer, group) [N] column values (a column affine) reordered into the TP layout."""
        return {key: v if self._perm(key[1]) is None else v[self._perm(key[1])] for key, v in values.items()}

    def checkpoint_columns(self, group: str) -> np.ndarray | None:
        """For a group in the TP layout, the index of each checkpoint column (None: the same order)."""
        perm = self._perm(group)
        if perm is None:
            return None
        index = np.empty(int(perm.max()) + 1, np.int64)
        index[perm] = np.arange(len(perm))  # a KV column copied to several devices: any copy
        return index

    # ---- running -----------------------------------------------------------------------------------------------
    cache_spec = P(None, AXIS, None, None)  # each layer's [B, kv_heads, max_seq, head_dim]

    def cache_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.cache_spec)

    def replicated(self) -> NamedSharding:
        """A copy on every device of the mesh."""
        return NamedSharding(self.mesh, P())
