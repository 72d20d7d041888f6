"""`ModelRunner`: the compiled model steps over a KV cache, and what they need on the host.

The model runs as one jitted pure function of (model definition, parameters, a `Call` or `Step`, cache, adapter
weights, static `StepOptions`); the batch's `LoRABatchInfo` is built inside it from per-token slots, so
changing the adapter mix never recompiles, nor does loading an adapter unless it targets a part no earlier
adapter did (`step_weights`). Prompt pieces come in power-of-two buckets (`bucket`), which bound the
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
from jlora.models.llama import Batch, CallOptions, KVCache, LoRAInput, Transformer
from jlora.logprobs import StepLogprobs, top_logprobs
from jlora.models.lora_weights import LoRAWeights
from jlora.parallel import TensorParallel
from jlora.sampling import apply_penalties, request_keys, sample_tokens
from jlora.step import Call, Step, StepOptions

__all__ = ["HISTORY_DTYPE", "ModelDef", "ModelRunner", "bucket", "forward", "generate_step", "pack_prompts",
           "row_tile"]

# The penalties' token history's element type: its writes here, the batcher's rows and the engine's memory check.
HISTORY_DTYPE = np.int32


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


def _model_call(model_def: ModelDef, params, call: Call, cache: KVCache, lora: LoRAWeights | None,
                options: StepOptions):
    """The model on one device, or under `shard_map` over the tensor-parallel mesh; `lora` None: the base model
    alone. Builds the call's `LoRABatchInfo` from its token slots (and that of its `logits_at` tokens)."""
    tp = options.tp
    base_first = concurrent_graphs(call.seq_len) if options.base_first is None else options.base_first
    model_options = CallOptions(options.backend, None if tp is None else parallel.AXIS, base_first,
                                options.attention_chunk)

    def run(params, call, cache, lora):
        lora_input = None
        if lora is not None:
            scalings = jnp.ones(call.ranks.shape, jnp.float32)
            at = call.batch.logits_at
            info = LoRABatchInfo.build(call.token_slot, call.ranks, scalings, block_m=options.block_m)
            head_info = None if at is None else LoRABatchInfo.build(call.token_slot[at], call.ranks, scalings,
                                                                    block_m=row_tile(at.shape[0]))
            lora_input = LoRAInput(lora, info, head_info)
        return model_def.merge(params)(call.batch, cache, lora_input, model_options)

    if tp is None:
        return run(params, call, cache, lora)
    cache_spec = KVCache(tp.cache_spec, tp.cache_spec)
    param_specs = jax.tree.leaves(tp.state_specs(model_def.state(params)), is_leaf=lambda x: isinstance(x, P))
    in_specs = (param_specs, P(), cache_spec, None if lora is None else tp.lora_specs(lora))
    logits_rank = 2 if call.batch.logits_at is not None else 3
    return jax.shard_map(run, mesh=tp.mesh, in_specs=in_specs, out_specs=(tp.logits_spec(logits_rank), cache_spec),
                         check_vma=False)(params, call, cache, lora)


@step_jit(static_argnames=("model_def", "options"), donate_argnames=("cache",))
def forward(model_def: ModelDef, params, call: Call, cache: KVCache, lora: LoRAWeights | None,
            options: StepOptions):
    """One jitted model call: (logits [B, S, V] f32 of a one-group call, or [N, V] at its `logits_at`, cache)."""
    return _model_call(model_def, params, call, cache, lora, options)


@step_jit(static_argnames=("model_def", "options"), donate_argnames=("cache", "history"))
def generate_step(model_def: ModelDef, params, step: Step, cache: KVCache, lora: LoRAWeights | None,
                  options: StepOptions, history: jax.Array | None = None):
    """One `Step` of the engine over its R cache rows: every row's decode token and the prompt pieces, in one
    model call. Row r samples its next token with its own key (`request_keys` of its seed and token index;
    `step.filtered`: see `sample_tokens`), after its penalties over `history` [R, H] (with `step.penalties`; see
    `apply_penalties`). Returns (next tokens [R, 1] int32, shaped as the next step's decode tokens, the cache,
    with `step.logprobs` a `StepLogprobs`, else None, and with `step.penalties` the history holding the step's
    decode tokens, else None): with prompt pieces the logits of every piece token are computed, scored against
    `step.prefill_next`. The key folding and that layout live here so the engine's pipelined loop dispatches
    nothing else per step.
    """
    r, prefill, width = step.decode.tokens.shape[0], step.prefill, step.logprobs
    at, groups = None, (step.decode,)  # decode alone: every token's logits
    if prefill is not None:  # the R decode tokens' logits, then each piece's last token's (or all its tokens')
        bp, sp = prefill.tokens.shape
        last = jnp.arange(bp) * sp + jnp.maximum(step.prefill_last, 0)
        at = jnp.concatenate([jnp.arange(r), r + (jnp.arange(bp * sp) if width else last)])
        groups = (step.decode, prefill)
    call = Call(Batch(groups, at), step.token_slot, step.ranks)
    logits, cache = _model_call(model_def, params, call, cache, lora, options)
    logits = logits.reshape(-1, logits.shape[-1])  # [R (+ Bp or Bp·Sp), V]
    pieces = None
    if prefill is not None:  # a finished piece's row takes its logits
        pieces = logits[r:]
        target = jnp.where(step.prefill_last >= 0, prefill.rows, r)  # r: out of range, dropped
        logits = logits[:r].at[target].set(pieces[last] if width else pieces, mode="drop")
    sampling, raw = step.sampling, logits  # log-probabilities: of the logits before the penalties (vLLM's "raw")
    if step.penalties is not None:
        decode = step.decode
        logits, history = apply_penalties(logits, step.penalties, history, decode.tokens[:, 0],
                                          decode.positions[:, 0], decode.valid[:, 0])
    keys = request_keys(sampling.seeds, sampling.token_index)
    next_tokens = sample_tokens(logits, keys, sampling, filtered=step.filtered)
    lp = None
    if width:
        lp = StepLogprobs(top_logprobs(raw, next_tokens, width),
                          None if prefill is None else top_logprobs(pieces, step.prefill_next.reshape(-1), width))
    return next_tokens[:, None], cache, lp, history if step.penalties is not None else None


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_blocks(cache: KVCache, sources, targets) -> KVCache:
    """The cache with blocks `targets` [n] holding blocks `sources`' keys and values (every layer); a target out
    of range is dropped."""
    return jax.tree.map(lambda x: x.at[targets].set(x[sources], mode="drop"), cache)


@functools.partial(jax.jit, donate_argnames=("history",))
def _write_history(history: jax.Array, rows, values) -> jax.Array:
    """`history` [R, H] with rows `rows` [n] holding `values` [n, H]; a row out of range is dropped."""
    return history.at[rows].set(values, mode="drop")


@jax.jit
def _read_blocks(cache: KVCache, blocks) -> KVCache:
    return jax.tree.map(lambda x: x[blocks], cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _write_blocks(cache: KVCache, blocks, values: KVCache) -> KVCache:
    return jax.tree.map(lambda x, y: x.at[blocks].set(y.astype(x.dtype), mode="drop"), cache, values)


def _padded(blocks: Sequence[int], fill: int) -> np.ndarray:
    """Block ids [bucket(n)] int32: `blocks`, then `fill` (block 0 to read, an out-of-range id for a write to
    drop): a power-of-two count keeps the block copies' compilations few."""
    padded = np.full(bucket(len(blocks)), fill, np.int32)
    padded[: len(blocks)] = blocks
    return padded


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
    pool, and the compiled steps over a KV cache: `run` (logits) and `step` (sampled next tokens), their decode
    attention split over chunks of `attention_chunk` positions unless None (`EngineConfig.attention_chunk`)."""

    def __init__(self, model: Transformer, pool: AdapterPool, *, dtype, backend: str, tp: TensorParallel | None,
                 attention_chunk: int | None = None):
        self.config: ModelConfig = model.config
        self.dtype = dtype
        self.backend = backend
        self.tp = tp
        self.attention_chunk = attention_chunk
        graphdef, state = nnx.split(model) if tp is None else tp.shard_model(model)
        self.model_def, self.params = ModelDef.split(graphdef, state)
        self._index = {jax.tree_util.keystr(path, simple=True, separator="."): i
                       for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0])}
        self.pool = pool
        pool.base = self  # DoRA's column norms and the embedding rows adapters override come from here
        self.rows = BaseRows(embedding=lambda: self._host(self._param("embed")),
                             lm_head=lambda: self._host(self._lm_head(out_in=True)))
        self._sharded_zeros = {}  # (rows, max_seq) -> jitted maker of an empty cache split over the mesh

    def _param(self, name: str) -> jax.Array | None:
        i = self._index.get(name + ".value")
        return None if i is None else self.params[i]

    @staticmethod
    def _host(x: jax.Array) -> np.ndarray:
        return np.asarray(x.astype(jnp.float32))

    def _lm_head(self, out_in: bool = False) -> jax.Array:
        """The lm_head's weight [H, V], or [V, H] with `out_in`: the embedding's when tied, which is stored [V, H],
        as the lm_head is with `ModelConfig.weights_out_in`."""
        w = self._param("lm_head.weight")
        stored_out_in = w is None or self.config.weights_out_in
        w = self._param("embed") if w is None else w
        return w if stored_out_in == out_in else w.T

    def linear(self, layer: int | None, group: str) -> tuple[jax.Array, jax.Array | None]:
        """(weight [K, N], bias [N] or None) of a layer's fused group, or of the lm_head (layer None)."""
        if group == "lm_head":
            return self._lm_head(), None
        path = f"layers.{layer}.{'attn' if group in ('qkv', 'o') else 'mlp'}.{group}"
        w = self._param(path + ".weight")  # [N, K] as stored with `ModelConfig.weights_out_in`
        return (w.T if self.config.weights_out_in else w), self._param(path + ".bias")

    def new_cache(self, batch: int, max_seq: int) -> KVCache:
        """An empty KV cache of `batch` blocks of `max_seq` positions (split over KV heads under tensor
        parallelism)."""
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

    def options(self, num_tokens: int) -> StepOptions:
        """The static options of a call of `num_tokens` tokens."""
        return StepOptions(row_tile(num_tokens), self.backend, self.tp, attention_chunk=self.attention_chunk)

    def run(self, tokens: np.ndarray, positions: np.ndarray, token_slot: np.ndarray, cache: KVCache):
        """One jitted model call on padded host arrays [B, S] (token_slot [B·S]); returns (logits [B, S, V] f32,
        cache)."""
        call = Call(Batch.of(tokens, positions), token_slot, self.pool.ranks.copy())
        return forward(self.model_def, self.params, call, cache, self.lora_for(token_slot), self.options(tokens.size))

    def step(self, step: Step, cache: KVCache, history: jax.Array | None = None):
        """Dispatches one `generate_step` (`history`: the penalties' token history, with `step.penalties`);
        returns (next tokens [R, 1] on the device, cache, `StepLogprobs` or None, the history or None)."""
        # Host arrays go to jit as they are: under tensor parallelism jit copies them to every device at once
        # (a jnp.asarray would land on device 0 first).
        return generate_step(self.model_def, self.params, step, cache, self.lora_for(step.token_slot),
                             self.options(step.token_slot.size), history)

    def write_history(self, history: jax.Array | None, shape: tuple[int, int], rows: Sequence[int],
                      values: np.ndarray) -> jax.Array:
        """The penalties' token history [R, H] (`shape`; a new one of -1 when `history` is None) with rows `rows`
        holding `values` [len(rows), H], placed as a step's outputs; the rows padded to a power-of-two count
        (`_padded`), which keeps the write's compilations few."""
        if history is None:  # from the host: under tensor parallelism straight to every device
            placement = None if self.tp is None else self.tp.replicated()
            history = jax.device_put(np.full(shape, -1, HISTORY_DTYPE), placement)
        padded = _padded(rows, shape[0])  # out of range: dropped
        values = np.concatenate([values, np.full((len(padded) - len(rows), shape[1]), -1, HISTORY_DTYPE)])
        return _write_history(history, padded, values)

    def copy_blocks(self, cache: KVCache, sources: np.ndarray, targets: np.ndarray) -> KVCache:
        """`copy_blocks` dispatched, padded to a power-of-two count (`_padded`)."""
        return copy_blocks(cache, _padded(sources, 0), _padded(targets, cache.k[0].shape[0]))

    def read_blocks(self, cache: KVCache, blocks: Sequence[int]) -> KVCache:
        """Blocks `blocks`' keys and values copied to host memory: a `KVCache` of numpy [n, KV, P, D] per layer."""
        return jax.tree.map(lambda x: np.asarray(x)[: len(blocks)], _read_blocks(cache, _padded(blocks, 0)))

    def write_blocks(self, cache: KVCache, blocks: Sequence[int], values: KVCache) -> KVCache:
        """The cache with `values` (as `read_blocks` gives them) written into blocks `blocks`."""
        padded = _padded(blocks, cache.k[0].shape[0])  # out of range: dropped
        pad = len(padded) - len(blocks)
        values = jax.tree.map(lambda y: np.concatenate([y, np.zeros((pad, *y.shape[1:]), y.dtype)]), values)
        return _write_blocks(cache, padded, values)

    def merge_tokens(self, tokens, host: np.ndarray, from_host: np.ndarray):
        """[R, 1]: `host`'s tokens in the rows `from_host` [R] marks, the device's `tokens` in the others."""
        return jnp.where(self.like_step_outputs(from_host[:, None]), self.like_step_outputs(host), tokens)

    def like_step_outputs(self, x):
        """`x` placed as a step's outputs are: under tensor parallelism on every device of the mesh (an input
        on one device would be copied to the others on every step, and host tokens where the previous step's
        device tokens go would compile the decode step twice); as it is on one device."""
        return x if self.tp is None else jax.device_put(x, self.tp.replicated())
