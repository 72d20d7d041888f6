"""`Engine`: a base model from a Hugging Face directory plus PEFT adapters in device slots, and generation.

The model runs as one jitted pure function of (model definition, parameters, batch, cache, adapter weights);
the batch's `LoRABatchInfo` is built inside it from per-token slots, so changing the adapter mix or loading
adapters never recompiles. Prompt lengths and batch sizes are padded to power-of-two buckets, which bound the
compilations: one decode step per (rows, max_seq) and one prefill per (admitted requests, prompt length), each
with and without the LoRA ops (a batch of base-model requests only skips them), and with the top-p sort only
when a request asks for it.

Generation is continuously batched (`jlora.scheduler`): `max_batch` cache rows decode together; a finished
request frees its row and the next waiting request is prefilled into it, so throughput holds with mixed
lengths. Requests with different adapters, and with none, share every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jlora import parallel
from jlora.adapters import AdapterPool
from jlora.batch_info import LoRABatchInfo
from jlora.compile_options import concurrent_graphs, step_jit
from jlora.models.config import ModelConfig
from jlora.models.llama import KVCache, Transformer
from jlora.models.loading import load_model
from jlora.models.lora_weights import LoRAWeights
from jlora.parallel import TensorParallel
from jlora.sampling import request_keys, sample_tokens
from jlora.scheduler import Batcher, Request

__all__ = ["Engine", "Generation", "ModelDef", "bucket", "forward", "generate_step"]


def bucket(n: int, minimum: int = 1) -> int:
    """The power-of-two bucket (>= minimum) that holds n."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def row_tile(num_tokens: int) -> int:
    """`LoRABatchInfo.block_m` for a step of `num_tokens` tokens: 16 at decode sizes, 64 for prefill
    (bench/kernels.py --sweep: larger row tiles re-read each adapter's weights less often)."""
    return 16 if num_tokens <= 256 else 64


def _host_staging(tensor_parallel: int):
    """Where a checkpoint is converted: under tensor parallelism in host memory, so that only the shards reach
    the devices (a model that outgrows one GPU must never sit whole on the first one); else on the default
    device. Without JAX's host platform (JAX_PLATFORMS leaving out cpu) the default device is all there is."""
    if tensor_parallel > 1:
        try:
            return jax.default_device(jax.devices("cpu")[0])
        except RuntimeError:
            pass
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """The static half of a split model, for the jitted calls: its nnx graph and the tree structure of its
    parameters.

    The parameters travel as a flat list of arrays and this object is hashed by identity: flattening an
    `nnx.State` runs Python for every parameter, and hashing a GraphDef walks the whole graph; together they
    made the host dispatch of an 8B-shaped decode step 3.5-3.8 ms instead of 1.5-2.6 ms (H200 host,
    `bench/model.py`), enough to leave the GPUs idle under tensor parallelism.
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


def _model_call(model_def: ModelDef, params, tokens, positions, cache, lora, token_slot, ranks, block_m, backend,
                valid=None, rows=None, tp: TensorParallel | None = None, base_first: bool | None = None):
    """The model on one device, or under `shard_map` over the tensor-parallel mesh. `base_first` (None: whether
    the step runs concurrent CUDA graphs, `concurrent_graphs`): see `Transformer.__call__`."""
    base_first = concurrent_graphs(tokens.shape[1]) if base_first is None else base_first

    def run(params, tokens, positions, cache, lora, token_slot, ranks, valid, rows):
        info = LoRABatchInfo.build(token_slot, ranks, jnp.ones(ranks.shape, jnp.float32), block_m=block_m)
        return model_def.merge(params)(tokens, positions, cache, lora, info, valid=valid, rows=rows,
                                       backend=backend, reduce_axis=None if tp is None else parallel.AXIS,
                                       base_first=base_first)

    args = (params, tokens, positions, cache, lora, token_slot, ranks, valid, rows)
    if tp is None:
        return run(*args)
    rep = P()
    cache_spec = KVCache(tp.cache_spec, tp.cache_spec)
    param_specs = jax.tree.leaves(tp.state_specs(model_def.state(params)), is_leaf=lambda x: isinstance(x, P))
    in_specs = (param_specs, rep, rep, cache_spec, None if lora is None else tp.lora_specs(), rep, rep,
                None if valid is None else rep, None if rows is None else rep)
    return jax.shard_map(run, mesh=tp.mesh, in_specs=in_specs, out_specs=(tp.logits_spec, cache_spec),
                         check_vma=False)(*args)


@step_jit(static_argnames=("model_def", "block_m", "backend", "tp", "base_first"), donate_argnames=("cache",))
def forward(model_def: ModelDef, params, tokens, positions, cache, lora, token_slot, ranks, *, block_m: int,
            backend: str, tp: TensorParallel | None = None, base_first: bool | None = None):
    """One jitted model call: tokens/positions [B, S], token_slot [B·S] -> (logits [B, S, V] f32, cache).
    `base_first` overrides the scheduling rule of `_model_call` (for benchmarks compiled under other options)."""
    return _model_call(model_def, params, tokens, positions, cache, lora, token_slot, ranks, block_m, backend, tp=tp,
                       base_first=base_first)


@step_jit(static_argnames=("model_def", "block_m", "backend", "tp", "nucleus"), donate_argnames=("cache",))
def generate_step(model_def: ModelDef, params, tokens, positions, valid, rows, last, cache, lora, token_slot, ranks,
                  seeds, token_index, temperature, top_p, *, block_m: int, backend: str,
                  tp: TensorParallel | None = None, nucleus: bool = False):
    """Runs B requests of S tokens (prefill: S = prompt bucket; decode: S = 1) into cache rows `rows` [B]
    (None: row b) and samples each request's next token from its position `last` [B] with its own key,
    `request_keys(seeds, token_index)` (`nucleus`: see `sample_tokens`).

    Returns (next tokens [B, 1] int32, shaped as the next decode step's `tokens`, and the cache). The key
    folding and that layout live here so the engine's pipelined loop dispatches nothing else per step.
    """
    logits, cache = _model_call(model_def, params, tokens, positions, cache, lora, token_slot, ranks, block_m,
                                backend, valid, rows, tp)
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # [B, V]
    keys = request_keys(seeds, token_index)
    return sample_tokens(logits, keys, temperature, top_p, nucleus=nucleus)[:, None], cache


def pack_prompts(prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Prompts padded into power-of-two buckets: tokens [B, S] int32, positions [B, S] int32, token slots
    [B, S] int32 (-1 on padding) and valid [B, S] bool (False on padding), B >= len(prompts), S >= 16."""
    batch, seq = bucket(len(prompts)), bucket(max(len(p) for p in prompts), 16)
    tokens = np.zeros((batch, seq), np.int32)
    token_slot = np.full((batch, seq), -1, np.int32)
    valid = np.zeros((batch, seq), bool)
    for i, (p, slot) in enumerate(zip(prompts, slots)):
        tokens[i, : len(p)] = p
        token_slot[i, : len(p)] = slot
        valid[i, : len(p)] = True
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
    return tokens, positions, token_slot, valid


def _request_seeds(seed: int | Sequence[int], n: int) -> list[int]:
    """Each of n requests' seed: `seed + i`, or `seed[i]`; as uint32 values (checked)."""
    seeds = [seed + i for i in range(n)] if isinstance(seed, (int, np.integer)) else [int(s) for s in seed]
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts; give one seed, or one per prompt")
    if not all(0 <= s < 2**32 for s in seeds):
        raise ValueError(f"seeds must be in [0, 2**32), got {[s for s in seeds if not 0 <= s < 2**32][:5]}")
    return seeds


class Generation(list):
    """A request's generated token ids (a `list[int]`), with `text` (None without a tokenizer) and
    `finish_reason` ("stop": a stop token, not included; "length": max_new_tokens reached)."""

    def __init__(self, tokens=(), text: str | None = None, finish_reason: str = "length"):
        super().__init__(tokens)
        self.text = text
        self.finish_reason = finish_reason


class Engine:
    """A base model and its adapter slots.

    Build with `Engine.from_pretrained(model_dir, max_loras=8, max_lora_rank=64, dtype="float32")`.
    """

    def __init__(self, model: Transformer, *, max_loras: int, max_lora_rank: int, dtype, backend: str = "auto",
                 evict: str = "lru", max_batch: int = 32, max_seq_len: int = 2048, tokenizer=None,
                 tensor_parallel: int = 1):
        self.config: ModelConfig = model.config
        self.dtype = dtype
        self.backend = backend
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.tokenizer = tokenizer
        self.tp = TensorParallel.create(self.config, tensor_parallel) if tensor_parallel > 1 else None
        graphdef, state = nnx.split(model) if self.tp is None else self.tp.shard_model(model)
        self.model_def, self.params = ModelDef.split(graphdef, state)
        self.pool = AdapterPool(self.config, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype,
                                evict=evict, tp=self.tp)
        self._sharded_zeros = {}  # (rows, max_seq) -> jitted maker of an empty cache split over the mesh

    @classmethod
    def from_pretrained(cls, model_dir: str, *, max_loras: int = 8, max_lora_rank: int = 64,
                        dtype: str | None = None, backend: str = "auto", evict: str = "lru",
                        max_batch: int = 32, max_seq_len: int = 2048, tensor_parallel: int = 1,
                        progress: bool = True) -> Engine:
        """Loads an HF checkpoint directory (config.json + safetensors, and tokenizer.json when present).

        Args:
          model_dir: the HF model directory.
          max_loras: adapter slots on the device.
          max_lora_rank: the largest adapter rank accepted.
          dtype: "bfloat16", "float16" or "float32"; default bfloat16 on GPU, float32 elsewhere.
          backend: the LoRA ops' backend ("auto": on GPU gather for small calls, tokens x rank <= 1024,
            i.e. decode, and pallas above; reference elsewhere).
          evict: when the pool is full, "lru" evicts the least recently used idle adapter; "refuse" raises.
          max_batch: cache rows decoding together in `generate`.
          max_seq_len: the longest prompt + generation accepted.
          tensor_parallel: devices to split the model over (Megatron-style, see `jlora.parallel`).
          progress: show a progress bar while loading.
        """
        dtype = jnp.dtype(dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
        with _host_staging(tensor_parallel):
            model = load_model(model_dir, dtype, progress=progress)
        tokenizer = None
        if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        return cls(model, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, backend=backend,
                   evict=evict, max_batch=max_batch, max_seq_len=max_seq_len, tokenizer=tokenizer,
                   tensor_parallel=tensor_parallel)

    def load_adapter(self, name: str, adapter_dir: str) -> None:
        """Loads a PEFT adapter directory under `name` (see `AdapterPool.load` for the errors)."""
        self.pool.load(name, adapter_dir)

    def unload_adapter(self, name: str) -> None:
        self.pool.unload(name)

    @property
    def adapters(self) -> list[str]:
        return self.pool.names

    def _slots(self, adapters: Sequence[str | None]) -> np.ndarray:
        unknown = sorted({a for a in adapters if a is not None and a not in self.pool.names})
        if unknown:
            raise KeyError(f"unknown adapter(s) {unknown}; loaded: {self.pool.names}")
        return np.array([-1 if a is None else self.pool.slot(a) for a in adapters], np.int32)

    def encode(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Token ids of each prompt: text through the model's tokenizer, id lists as they are."""
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is text but the model directory has no tokenizer.json; "
                                     "give token ids instead")
                p = self.tokenizer.encode(p).ids
            ids.append([int(t) for t in p])
        return ids

    def _check_prompts(self, prompts: Sequence[Sequence[int]], adapters: Sequence[str | None],
                       max_new_tokens: int = 0) -> None:
        if len(prompts) != len(adapters):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters; give one per prompt (None: base)")
        if not prompts:
            raise ValueError("no prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                                 f"max_seq_len={self.max_seq_len}")

    def run(self, tokens: np.ndarray, positions: np.ndarray, token_slot: np.ndarray, cache: KVCache):
        """One jitted model call on padded host arrays; returns (logits [B, S, V] f32, cache)."""
        return forward(self.model_def, self.params, tokens, positions, cache, self._lora_for(token_slot), token_slot,
                       self.pool.ranks.copy(), block_m=row_tile(tokens.size), backend=self.backend, tp=self.tp)

    def _lora_for(self, token_slot: np.ndarray) -> LoRAWeights | None:
        """The pool's weights for a call whose host token slots are `token_slot`, or None when no token uses an
        adapter: a call of base-model tokens only runs without the LoRA ops (a second compiled variant per
        shape), which with every slot -1 would add nothing at full cost."""
        return self.pool.weights if (token_slot >= 0).any() else None

    def new_cache(self, batch: int, max_seq: int) -> KVCache:
        """An empty KV cache of `batch` rows (split over KV heads under tensor parallelism)."""
        if self.tp is None:
            return KVCache.zeros(self.config, batch, max_seq, self.dtype)
        if (batch, max_seq) not in self._sharded_zeros:  # one compiled maker per bucket, not one per call
            sharding = self.tp.cache_sharding()
            make = functools.partial(KVCache.zeros, self.tp.layout, batch, max_seq, self.dtype)
            self._sharded_zeros[batch, max_seq] = jax.jit(make, out_shardings=KVCache(sharding, sharding))
        return self._sharded_zeros[batch, max_seq]()

    def prefill_logits(self, prompts: Sequence[str | Sequence[int]], adapters: Sequence[str | None]) -> list[np.ndarray]:
        """Logits of every prompt position, each request with its own adapter (None: the base model).

        Args:
          prompts: token id lists.
          adapters: one adapter name or None per prompt.

        Returns:
          One float32 array [len(prompt), vocab] per prompt.
        """
        prompts = self.encode(prompts)
        self._check_prompts(prompts, adapters)
        tokens, positions, token_slot, _ = pack_prompts(prompts, self._slots(adapters))
        cache = self.new_cache(*tokens.shape)
        logits, _ = self.run(tokens, positions, token_slot.reshape(-1), cache)
        logits = np.asarray(logits)
        return [logits[i, : len(p)] for i, p in enumerate(prompts)]

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        adapters: Sequence[str | None],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | Sequence[int] = 0,
        progress=None,
    ) -> list[Generation]:
        """Generates for every prompt with its adapter (None: the base model), continuously batched.

        Args:
          prompts: token id lists, or text when the model has a tokenizer.
          adapters: one loaded adapter name or None per prompt.
          max_new_tokens: tokens to generate per request at most.
          temperature: 0 for greedy decoding.
          top_p: nucleus sampling mass.
          stop_token_ids: a request stops at any of these (not included in its output).
          seed: sampling seed: request i samples with `seed + i`, or with `seed[i]` when a sequence is given.
            A request's key for its n-th token is `fold_in(key(its seed), n)` (`jlora.sampling`), so its
            output never depends on the other requests of the call, their number or order, or its row.
          progress: optional callable(n) told of each generated token batch (e.g. a tqdm's update).

        Returns:
          One `Generation` (a list of token ids with `.text` and `.finish_reason`) per prompt, in order.
        """
        prompts = self.encode(prompts)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        self._check_prompts(prompts, adapters, max_new_tokens)
        slots = self._slots(adapters)
        seeds = _request_seeds(seed, len(prompts))
        stop = frozenset(stop_token_ids or ())
        requests = [Request(p, int(s), max_new_tokens, temperature, top_p, sd, stop)
                    for p, s, sd in zip(prompts, slots, seeds)]
        batcher = Batcher(self, bucket(min(len(requests), self.max_batch)),
                          bucket(max(len(p) for p in prompts) + max_new_tokens, 16), progress)
        for r in requests:
            batcher.add(r)
        held = [a for a in adapters if a is not None]
        self.pool.hold(held)
        try:
            while batcher.busy:
                batcher.step()
        finally:
            self.pool.release(held)
        decode = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer is not None else (lambda ids: None)
        return [Generation(r.out, decode(r.out), r.finish) for r in requests]

    def _like_step_outputs(self, x):
        """`x` placed as a step's outputs are: under tensor parallelism on every device of the mesh (an input
        on one device would be copied to the others on every step, and host tokens where the previous step's
        device tokens go would compile the decode step twice); as it is on one device."""
        return x if self.tp is None else jax.device_put(x, self.tp.replicated())

    def _step(self, tokens, positions, valid, rows, last, cache, token_slot, seeds, token_index, temperature, top_p,
              nucleus):
        """Dispatches one generate_step; returns (next tokens [B, 1] on the device, cache)."""
        # Host arrays go to jit as they are: under tensor parallelism jit copies them to every device at once
        # (a jnp.asarray would land on device 0 first).
        return generate_step(
            self.model_def, self.params, tokens, positions, valid, rows, last, cache, self._lora_for(token_slot),
            token_slot, self.pool.ranks.copy(), seeds, token_index, temperature, top_p,
            block_m=row_tile(tokens.size), backend=self.backend, tp=self.tp, nucleus=nucleus)
