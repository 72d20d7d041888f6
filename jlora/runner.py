"""`ModelRunner`: the compiled model steps over a KV cache, and what they need on the host.

The model runs as one jitted pure function of (model definition, parameters, batch, cache, adapter weights);
the batch's `LoRABatchInfo` is built inside it from per-token slots, so changing the adapter mix never
recompiles, nor does loading an adapter unless it targets a part no earlier adapter did (`step_weights`). Prompt pieces come in power-of-two buckets (`bucket`), which bound the
compilations: per (rows, cache length) one decode step and one mixed step per prompt bucket, each with and
without the LoRA ops (a step of base-model tokens only skips them), with the top-p sort only when a request
asks for it, and with log-probabilities (`jlora.logprobs`) only when a request asks for them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jlora import parallel
from jlora.adapters import AdapterPool
from jlora.adapters.peft import BaseRows
from jlora.batch_info import LoRABatchInfo
from jlora.compile_options import concurrent_graphs, step_jit
from jlora.models.config import ModelConfig
from jlora.models.llama import Group, KVCache, Transformer
from jlora.logprobs import StepLogprobs, top_logprobs
from jlora.models.lora_weights import LoRAWeights
from jlora.parallel import TensorParallel
from jlora.sampling import request_keys, sample_tokens

__all__ = ["ModelDef", "ModelRunner", "bucket", "forward", "generate_step", "pack_prompts", "row_tile"]


def bucket(n: int, minimum: int = 1) -> int:
    """The power-of-two bucket (>= minimum) that holds n."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def row_tile(num_tokens: int) -> int:
    """`LoRABatchInfo.block_m` for a step of `num_tokens` tokens: 16 at decode sizes, 64 for prefill
    (bench/kernels.py --sweep: larger row tiles re-read each adapter's weights less often)."""
    return 16 if num_tokens <= 256 else 64


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """The static half of a split model, for the jitted calls: its nnx graph and the tree structure of its
    parameters.

    The parameters travel as a flat list of arrays and this object is hashed by identity: flattening an
    `nnx.State` runs Python for every parameter, and hashing a GraphDef walks the whole graph, which more than
    doubled the host's dispatch time of a decode step (docs/performance.md).
    """

    graphdef: nnx.GraphDef
    treedef: jax.tree_util.PyTreeDef

    @staticmethod
    def split(graphdef: nnx.GraphDef, state: nnx.State) -> tuple[ModelDef, list[jax.Array]]:
        """(definition, parameter leaves) of a model split by `nnx.split` (or `TensorParallel.shard_model`)."""
        leaves, treedef = jax.tree.flatten(state)
        return ModelDef(graphdef, treedef), leaves

    def state(self, params: Sequence) -> nnx.State:
        """The parameter leaves as the model's nnx.State."""
        return jax.tree.unflatten(self.treedef, params)

    def merge(self, params: Sequence[jax.Array]) -> Transformer:
        """The model with these parameter leaves (inside a jitted call: no copies)."""
        return nnx.merge(self.graphdef, self.state(params))


def _seq_len(tokens, then: Group | None) -> int:
    """Tokens per request of a step's widest group: what its compile options and `base_first` go by."""
    return max(tokens.shape[1], 0 if then is None else then.tokens.shape[1])


def _model_call(model_def: ModelDef, params, tokens, positions, cache, lora, token_slot, ranks, block_m, backend,
                valid=None, rows=None, tp: TensorParallel | None = None, base_first: bool | None = None,
                then: Group | None = None, logits_at=None):
    """The model on one device, or under `shard_map` over the tensor-parallel mesh. `base_first` (None: whether
    the step runs concurrent CUDA graphs, `concurrent_graphs`): see `Transformer.__call__`."""
    base_first = concurrent_graphs(_seq_len(tokens, then)) if base_first is None else base_first

    def run(params, tokens, positions, cache, lora, token_slot, ranks, valid, rows, then, logits_at):
        scalings = jnp.ones(ranks.shape, jnp.float32)
        info = LoRABatchInfo.build(token_slot, ranks, scalings, block_m=block_m)
        head_info = None if logits_at is None else LoRABatchInfo.build(
            token_slot[logits_at], ranks, scalings, block_m=row_tile(logits_at.shape[0]))
        return model_def.merge(params)(tokens, positions, cache, lora, info, valid=valid, rows=rows, then=then,
                                       logits_at=logits_at, head_info=head_info, backend=backend,
                                       reduce_axis=None if tp is None else parallel.AXIS, base_first=base_first)

    args = (params, tokens, positions, cache, lora, token_slot, ranks, valid, rows, then, logits_at)
    if tp is None:
        return run(*args)
    rep = P()
    cache_spec = KVCache(tp.cache_spec, tp.cache_spec)
    param_specs = jax.tree.leaves(tp.state_specs(model_def.state(params)), is_leaf=lambda x: isinstance(x, P))
    optional = lambda x: None if x is None else rep
    in_specs = (param_specs, rep, rep, cache_spec, None if lora is None else tp.lora_specs(lora), rep, rep,
                optional(valid), optional(rows), optional(then), optional(logits_at))
    logits_rank = 2 if logits_at is not None else 3
    return jax.shard_map(run, mesh=tp.mesh, in_specs=in_specs, out_specs=(tp.logits_spec(logits_rank), cache_spec),
                         check_vma=False)(*args)


@step_jit(static_argnames=("model_def", "block_m", "backend", "tp", "base_first"), donate_argnames=("cache",))
def forward(model_def: ModelDef, params, tokens, positions, cache, lora, token_slot, ranks, *, block_m: int,
            backend: str, tp: TensorParallel | None = None, base_first: bool | None = None):
    """One jitted model call: tokens/positions [B, S], token_slot [B·S] -> (logits [B, S, V] f32, cache).
    `base_first` overrides the scheduling rule of `_model_call` (for benchmarks compiled under other options)."""
    return _model_call(model_def, params, tokens, positions, cache, lora, token_slot, ranks, block_m, backend, tp=tp,
                       base_first=base_first)


@step_jit(static_argnames=("model_def", "block_m", "backend", "tp", "nucleus", "logprobs"),
          donate_argnames=("cache",), seq_len=lambda tokens, kwargs: _seq_len(tokens, kwargs.get("prefill")))
def generate_step(model_def: ModelDef, params, tokens, positions, valid, cache, lora, token_slot, ranks, seeds,
                  token_index, temperature, top_p, *, prefill: Group | None = None, prefill_last=None,
                  prefill_next=None, block_m: int, backend: str, tp: TensorParallel | None = None,
                  nucleus: bool = False, logprobs: int = 0):
    """One step of the engine over its R cache rows: every row's decode token (tokens, positions, valid
    [R, 1]; rows that do not decode are not valid), and, when given, the `prefill` group: prompt pieces
    written into other rows, `prefill_last` [Bp] the index in its piece of the token whose logits give that
    row its first token (-1: none, the prompt goes on in a later step, or a padding request). token_slot
    [R + Bp·Sp]: the decode tokens' slots, then the pieces'.

    Row r samples its next token with its own key, `request_keys(seeds, token_index)` ([R] each; `nucleus`:
    see `sample_tokens`). Returns (next tokens [R, 1] int32, shaped as the next step's `tokens`, the cache,
    and with `logprobs` (a `top_width`; 0: none) a `StepLogprobs`, else None): with a prefill group the logits of every piece token
    are computed, and `prefill_next` [Bp, Sp] names the prompt token each one predicts (-1: none). The key
    folding and that layout live here so the engine's pipelined loop dispatches nothing else per step.
    """
    r = tokens.shape[0]
    at = None  # decode alone: every token's logits
    if prefill is not None:  # the R decode tokens' logits, then each piece's last token's (or all its tokens')
        bp, sp = prefill.tokens.shape
        last = jnp.arange(bp) * sp + jnp.maximum(prefill_last, 0)
        at = jnp.concatenate([jnp.arange(r), r + (jnp.arange(bp * sp) if logprobs else last)])
    logits, cache = _model_call(model_def, params, tokens, positions, cache, lora, token_slot, ranks, block_m,
                                backend, valid, None, tp, then=prefill, logits_at=at)
    logits = logits.reshape(-1, logits.shape[-1])  # [R (+ Bp or Bp·Sp), V]
    pieces = None
    if prefill is not None:  # a finished piece's row takes its logits
        pieces = logits[r:]
        target = jnp.where(prefill_last >= 0, prefill.rows, r)  # r: out of range, dropped
        logits = logits[:r].at[target].set(pieces[last] if logprobs else pieces, mode="drop")
    keys = request_keys(seeds, token_index)
    next_tokens = sample_tokens(logits, keys, temperature, top_p, nucleus=nucleus)
    lp = None
    if logprobs:
        lp = StepLogprobs(top_logprobs(logits, next_tokens, logprobs),
                          None if prefill is None else top_logprobs(pieces, prefill_next.reshape(-1), logprobs))
    return next_tokens[:, None], cache, lp


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_row(cache: KVCache, source, row) -> KVCache:
    """The cache with row `row` holding row `source`'s keys and values (every layer and position)."""
    return jax.tree.map(lambda x: x.at[row].set(x[source]), cache)


def pack_prompts(prompts: Sequence[Sequence[int]], slots: Sequence[int], starts: Sequence[int] | None = None
                 ) -> tuple[np.ndarray, ...]:
    """Prompts (or pieces of prompts starting at positions `starts`, default 0) padded into power-of-two
    buckets: tokens [B, S] int32, positions [B, S] int32, token slots [B, S] int32 (-1 on padding) and valid
    [B, S] bool (False on padding), B >= len(prompts), S >= 16."""
    batch, seq = bucket(len(prompts)), bucket(max(len(p) for p in prompts), 16)
    tokens = np.zeros((batch, seq), np.int32)
    token_slot = np.full((batch, seq), -1, np.int32)
    valid = np.zeros((batch, seq), bool)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    for i, (p, slot) in enumerate(zip(prompts, slots)):
        tokens[i, : len(p)] = p
        token_slot[i, : len(p)] = slot
        valid[i, : len(p)] = True
        if starts is not None:
            positions[i] += starts[i]
    return tokens, positions, token_slot, valid


class ModelRunner:
    """A model's parameters on the device (split over the tensor-parallel mesh when `tp` is given), its adapter
    pool, and the compiled steps over a KV cache: `run` (logits) and `step` (sampled next tokens)."""

    def __init__(self, model: Transformer, pool: AdapterPool, *, dtype, backend: str, tp: TensorParallel | None):
        self.config: ModelConfig = model.config
        self.dtype = dtype
        self.backend = backend
        self.tp = tp
        graphdef, state = nnx.split(model) if tp is None else tp.shard_model(model)
        self.model_def, self.params = ModelDef.split(graphdef, state)
        self._index = {jax.tree_util.keystr(path, simple=True, separator="."): i
                       for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0])}
        self.pool = pool
        pool.base = self  # DoRA's column norms and the embedding rows adapters override come from here
        self.rows = BaseRows(embedding=lambda: self._host(self._param("embed")),
                             lm_head=lambda: self._host(self._lm_head().T))
        self._sharded_zeros = {}  # (rows, max_seq) -> jitted maker of an empty cache split over the mesh

    def _param(self, name: str) -> jax.Array | None:
        i = self._index.get(name + ".value")
        return None if i is None else self.params[i]

    @staticmethod
    def _host(x: jax.Array) -> np.ndarray:
        return np.asarray(x.astype(jnp.float32))

    def _lm_head(self) -> jax.Array:
        """[H, V]: the lm_head's weight, or the embedding's transposed when tied."""
        w = self._param("lm_head.weight")
        return self._param("embed").T if w is None else w

    def linear(self, layer: int | None, group: str) -> tuple[jax.Array, jax.Array | None]:
        """(weight [K, N], bias [N] or None) of a layer's fused group, or of the lm_head (layer None)."""
        if group == "lm_head":
            return self._lm_head(), None
        path = f"layers.{layer}.{'attn' if group in ('qkv', 'o') else 'mlp'}.{group}"
        return self._param(path + ".weight"), self._param(path + ".bias")

    def new_cache(self, batch: int, max_seq: int) -> KVCache:
        """An empty KV cache of `batch` rows (split over KV heads under tensor parallelism)."""
        if self.tp is None:
            return KVCache.zeros(self.config, batch, max_seq, self.dtype)
        if (batch, max_seq) not in self._sharded_zeros:  # one compiled maker per bucket, not one per call
            sharding = self.tp.cache_sharding()
            make = functools.partial(KVCache.zeros, self.tp.layout, batch, max_seq, self.dtype)
            self._sharded_zeros[batch, max_seq] = jax.jit(make, out_shardings=KVCache(sharding, sharding))
        return self._sharded_zeros[batch, max_seq]()

    def lora_for(self, token_slot: np.ndarray) -> LoRAWeights | None:
        """The pool's weights for a call whose host token slots are `token_slot`, or None when no token uses an
        adapter: a call of base-model tokens only runs without the LoRA ops (a second compiled variant per
        shape), which with every slot -1 would add nothing at full cost."""
        return self.pool.step_weights if (token_slot >= 0).any() else None

    def run(self, tokens: np.ndarray, positions: np.ndarray, token_slot: np.ndarray, cache: KVCache):
        """One jitted model call on padded host arrays [B, S] (token_slot [B·S]); returns (logits [B, S, V] f32,
        cache)."""
        return forward(self.model_def, self.params, tokens, positions, cache, self.lora_for(token_slot), token_slot,
                       self.pool.ranks.copy(), block_m=row_tile(tokens.size), backend=self.backend, tp=self.tp)

    def step(self, tokens, positions, valid, cache, token_slot, seeds, token_index, temperature, top_p,
             nucleus: bool, prefill: Group | None = None, prefill_slots: np.ndarray | None = None,
             prefill_last: np.ndarray | None = None, prefill_next: np.ndarray | None = None, logprobs: int = 0):
        """Dispatches one `generate_step` (token_slot [R]: the decode tokens' slots; prefill_slots [Bp, Sp]: the
        pieces'); returns (next tokens [R, 1] on the device, cache, `StepLogprobs` or None)."""
        # Host arrays go to jit as they are: under tensor parallelism jit copies them to every device at once
        # (a jnp.asarray would land on device 0 first).
        if prefill is not None:
            token_slot = np.concatenate([token_slot, prefill_slots.reshape(-1)])
        return generate_step(
            self.model_def, self.params, tokens, positions, valid, cache, self.lora_for(token_slot), token_slot,
            self.pool.ranks.copy(), seeds, token_index, temperature, top_p, prefill=prefill, prefill_last=prefill_last,
            prefill_next=prefill_next if logprobs and prefill is not None else None,
            block_m=row_tile(token_slot.size), backend=self.backend, tp=self.tp, nucleus=nucleus, logprobs=logprobs)

    def copy_row(self, cache: KVCache, source: int, row: int) -> KVCache:
        """`copy_row` dispatched (one compilation for every pair of rows)."""
        return copy_row(cache, np.int32(source), np.int32(row))

    def like_step_outputs(self, x):
        """`x` placed as a step's outputs are: under tensor parallelism on every device of the mesh (an input
        on one device would be copied to the others on every step, and host tokens where the previous step's
        device tokens go would compile the decode step twice); as it is on one device."""
        return x if self.tp is None else jax.device_put(x, self.tp.replicated())
