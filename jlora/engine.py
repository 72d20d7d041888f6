"""`Engine`: a base model from a Hugging Face directory plus PEFT adapters in device slots, and generation.

The public facade over two parts that each read alone: `jlora.runner.ModelRunner` (the parameters, the
adapter pool and the compiled steps over a KV cache) and `jlora.scheduler.Batcher` (continuous batching over
cache rows: `max_batch` rows decode together, a finished request frees its row and the next waiting request is
prefilled into it). The engine loads, checks requests, and turns names and text into slots and token ids.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import difflib
import functools
import gc
import os
import threading
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jlora.adapters import AdapterError, AdapterPool, PoolFullError, check_adapter_name
from jlora.adapters.registry import AdapterRegistry
from jlora.adapters.reader import ProcessReader
from jlora.adapters.tiers import AdapterCache, AdapterTiers
from jlora.admission import Admission
from jlora.chat import ChatOptions, ChatTemplate, ChatTemplateError
from jlora.engine_config import EngineConfig
from jlora.logprobs import MAX_TOP_LOGPROBS, Score, TokenLogprob
from jlora.models.config import ModelConfig
from jlora.models.llama import Transformer, with_weight_layout
from jlora.models.loading import GenerationDefaults, eos_token_ids, generation_defaults, load_model
from jlora.output_text import output_text
from jlora.parallel import TensorParallel
from jlora.runner import HISTORY_DTYPE, ModelRunner, bucket, pack_prompts
from jlora.sampling import sample_seeds
from jlora.scheduler import Batcher, Request
from jlora.values import is_integer, is_real

__all__ = ["Engine", "Generation"]


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


def _note_refusal(refused: list[Request], then: Callable[[Request], None] | None, r: Request) -> None:
    """A request's `on_update` in `Engine._run`: collects it in `refused` when intake ended it with an error
    ("error" or "failed"), then calls the request's own `then`."""
    if r.finish in ("error", "failed"):
        refused.append(r)
    if then is not None:
        then(r)


def _free_bytes(devices: Sequence[jax.Device]) -> int | None:
    """Bytes the devices' allocators can still hand out, all together; for CPU devices, which say nothing, the
    memory the host has available (they share it); None where neither is known."""
    stats = [d.memory_stats() for d in devices]
    if all(st and "bytes_limit" in st for st in stats):
        return sum(st["bytes_limit"] - st["bytes_in_use"] for st in stats)
    return _host_available_bytes() if all(d.platform == "cpu" for d in devices) else None


def _host_available_bytes() -> int | None:
    """The host's available memory (Linux's MemAvailable: free, and caches it can drop), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_tokenizer(model_dir: str):
    """The model directory's `tokenizers.Tokenizer` (tokenizer.json), or None when it has none."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises Exception itself for a file it cannot parse
        raise ValueError(f"{path}: cannot read the tokenizer ({str(err)[:200]})") from None


def _request_seeds(seed: int | Sequence[int], n: int) -> list[int]:
    """Each of n requests' seed: `seed + i`, or `seed[i]` (`check_sampling`'s); as uint32 values (checked)."""
    seeds = [int(seed) + i for i in range(n)] if is_integer(seed) else [int(s) for s in seed]
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts; give one seed, or one per prompt")
    if not all(0 <= s < 2**32 for s in seeds):
        raise ValueError(f"seeds must be in [0, 2**32), got {[s for s in seeds if not 0 <= s < 2**32][:5]}")
    return seeds


def _check_progress(progress) -> None:
    """A ValueError unless `progress` is None or callable: found before the run, not at its first update."""
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be None or a callable(n) (such as a tqdm's update), got {progress!r:.60}")


def _config(config: EngineConfig | None, options: dict) -> EngineConfig:
    """`config`, or an `EngineConfig` of `options` (not both); an option that is no field is a TypeError naming
    it and the field nearest its name."""
    if config is not None and options:
        raise TypeError(f"give an EngineConfig or its fields as keywords, not both (got {sorted(options)})")
    fields = EngineConfig.__dataclass_fields__
    for name in options:
        if name not in fields:
            near = difflib.get_close_matches(name, fields, n=1)
            raise TypeError(f"unknown engine option {name!r}" + (f"; did you mean {near[0]!r}?" if near else
                                                                  "; the options are EngineConfig's fields"))
    return config if config is not None else EngineConfig(**options)


def check_sampling(max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                   min_p: float = 0.0, stop_token_ids: Sequence[int] | None = None, seed: int | Sequence[int] = 0,
                   logprobs: int | None = None, n: int = 1, ignore_eos: bool = False, repetition_penalty: float = 1.0,
                   frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> None:
    """Raises a ValueError naming the first of `Engine.generate`'s settings (its keywords, described there) out of
    its range: the checks that need no model, so that a caller may make them before one loads (`jlora generate`
    does). `generate` makes them too, then those that need the model (the stop ids against its vocabulary)."""
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (is_real(temperature) and is_real(top_p) and 0 <= temperature < float("inf") and 0 < top_p <= 1):
        raise ValueError(f"need a finite temperature >= 0 and 0 < top_p <= 1, got {temperature!r}, {top_p!r}")
    if not (is_integer(top_k) and 0 <= top_k < 2**31):
        raise ValueError(f"top_k must be an integer >= 0 (0: off), got {top_k!r:.60}")
    if not (is_real(min_p) and 0 <= min_p <= 1):
        raise ValueError(f"min_p must be a number in [0, 1] (0: off), got {min_p!r:.60}")
    if stop_token_ids is not None and not (isinstance(stop_token_ids, Sequence | np.ndarray | set | frozenset)
                                           and all(is_integer(t) for t in stop_token_ids)):
        raise ValueError(f"stop_token_ids must be a collection of integer token ids, got {stop_token_ids!r:.60}")
    if not (is_integer(seed) or isinstance(seed, Sequence | np.ndarray) and all(is_integer(s) for s in seed)):
        raise ValueError(f"seed must be an integer or a sequence of integers, got {seed!r:.60}")
    if bad := [int(s) for s in ([seed] if is_integer(seed) else seed) if not 0 <= s < 2**32]:
        raise ValueError(f"seeds must be in [0, 2**32), got {bad[:5]}")
    if logprobs is not None and not (is_integer(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs!r}")
    if not is_integer(n) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a bool, got {ignore_eos!r:.60}")
    if not (is_real(repetition_penalty) and 0 < repetition_penalty <= 2):
        raise ValueError(f"repetition_penalty must be a number in (0, 2] (1: off), got {repetition_penalty!r:.60}")
    for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if not (is_real(value) and -2 <= value <= 2):
            raise ValueError(f"{name} must be a number in [-2, 2] (0: off), got {value!r:.60}")


class Generation(list):
    """A request's generated token ids (a `list[int]`), with `text` (what they add to the prompt's text, a word's
    leading space included, as in vLLM's and transformers' pipeline's; None without a tokenizer),
    `finish_reason` ("stop": a stop token, not included; "length": max_new_tokens reached) and `logprobs`
    (when asked for, one `TokenLogprob` per token, and last the stop token's when one ended it; else None)."""

    def __init__(self, tokens=(), text: str | None = None, finish_reason: str = "length",
                 logprobs: list[TokenLogprob] | None = None):
        super().__init__(tokens)
        self.text = text
        self.finish_reason = finish_reason
        self.logprobs = logprobs


class Engine:
    """A base model and its adapter slots.

    Build with `Engine.from_pretrained(model_dir, max_loras=8, max_lora_rank=64, dtype="float32")`; the
    options are `EngineConfig`'s (`engine.config`; the model's own is `engine.model_config`). `max_batch` and
    `prefill_chunk` may change between calls (`engine.config = dataclasses.replace(engine.config, ...)`), but
    for max_batch past 1 in an engine built with max_batch 1, which stores its weights for one-row steps
    (`EngineConfig.weights_out_in`). `generate`, `chat`, `score` and `prefill_logits` called from several
    threads run one after another: each call batches its own requests over the shared slots (the server's
    `OnlineEngine` batches requests from many callers together). `load_adapter` and `unload_adapter` from
    another thread wait for the call running (a load reads its files meanwhile).
    """

    def __init__(self, model: Transformer, config: EngineConfig | None = None, *, tokenizer=None,
                 eos_token_ids: Iterable[int] = (), chat_template: ChatTemplate | None = None,
                 generation_defaults: GenerationDefaults = GenerationDefaults(), **options):
        """`model` in the dtype `config.dtype` names (None: the model's); `config`, or its fields as `options`;
        `eos_token_ids`: where generation stops unless asked not to (`generate`'s `ignore_eos`);
        `chat_template`: what `chat` renders conversations with (None: no template); `generation_defaults`: the
        sampling settings the model recommends, which the server gives requests that set none (`generate`
        takes its own defaults). A model whose weights are not in the layout the engine stores
        (`EngineConfig.weights_out_in`) is copied transposed: drop other references to it to free its memory."""
        config = _config(config, options)
        model = with_weight_layout(model, config.weights_out_in)
        self.model_config: ModelConfig = model.config
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.chat_template = chat_template or ChatTemplate()
        self.generation_defaults = generation_defaults
        dtype = jnp.dtype(config.dtype) if config.dtype else model.embed[...].dtype
        tp = TensorParallel.create(self.model_config, config.tensor_parallel) if config.tensor_parallel > 1 else None
        self.pool = AdapterPool(self.model_config, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                dtype=dtype, evict=config.evict, tp=tp, max_extra_vocab=config.max_extra_vocab,
                                max_seq_len=config.max_seq_len,
                                reader=ProcessReader.shared(config.adapter_readers) if config.adapter_readers else None,
                                read_timeout=config.adapter_read_timeout)
        self.runner = ModelRunner(model, self.pool, dtype=dtype, backend=config.backend, tp=tp,
                                  attention_chunk=config.attention_chunk(self.model_config.num_kv_heads))
        self.registry = AdapterRegistry(config.adapter_retry_after)
        self.devices = list(tp.mesh.devices.flat) if tp is not None else [jax.devices()[0]]
        free = _free_bytes(self.devices)
        if free is not None and config.device_cache_bytes > free:
            raise ValueError(f"device_cache_memory {config.device_cache_memory:g} GiB is more than the "
                             f"{free / 2**30:.1f} GiB the device(s) have free beside the model")
        self.tiers = AdapterTiers(host=AdapterCache(config.host_capacity, config.host_bytes),
                                  device=AdapterCache(None, config.device_cache_bytes), registry=self.registry)
        # Loads run on loader threads, at least one per reader process so that all of them read at once; at most
        # twice as many loads are under way or staged on the device at a time (`Admission`).
        threads = max(4, config.adapter_readers)
        self.loader = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jlora-adapter-load")
        self.max_loads = 2 * threads
        # One call at a time: concurrent calls would each hold a KV cache and take slots from each other (one
        # found every slot held by another's adapters: PoolFullError), and a slot write from one would delete the
        # weights a step of another reads. Re-entrant: a `progress` callback may call again.
        self._calls = threading.RLock()

    @classmethod
    def from_pretrained(cls, model_dir: str, config: EngineConfig | None = None, *, progress: bool = True,
                        **options) -> Engine:
        """Loads an HF checkpoint directory (config.json + safetensors, and tokenizer.json when present); its
        end-of-sequence ids come from generation_config.json (else config.json), as HF's `generate` reads them,
        its sampling defaults from generation_config.json (`generation_defaults`), and its chat template from
        chat_template.jinja (else tokenizer_config.json), as transformers finds it.

        Args:
          model_dir: the HF model directory.
          config: the engine's options (`EngineConfig`), or give its fields as keyword `options`
            (`max_loras=4, dtype="bfloat16"`); dtype None: bfloat16 on GPU, float32 elsewhere.
          progress: show a progress bar while loading.
        """
        config = _config(config, options)  # checked before the minutes a large checkpoint takes to load
        if config.dtype is None:
            config = dataclasses.replace(config, dtype="bfloat16" if jax.default_backend() == "gpu" else "float32")
        tokenizer = _read_tokenizer(model_dir)  # before the weights: a broken file stops the load at once
        eos, chat, defaults = eos_token_ids(model_dir), ChatTemplate(model_dir), generation_defaults(model_dir)
        with _host_staging(config.tensor_parallel):
            model = load_model(model_dir, jnp.dtype(config.dtype), progress=progress, out_in=config.weights_out_in)
        return cls(model, config, tokenizer=tokenizer, eos_token_ids=eos, chat_template=chat,
                   generation_defaults=defaults)

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        if self.model_config.weights_out_in and not config.weights_out_in:
            raise ValueError(f"max_batch {config.max_batch}: this engine was built with max_batch 1 and stores its "
                             "weights for one-row steps ([out, in]); build an engine with the larger max_batch")
        self._config = config

    def register_adapter(self, name: str, adapter_dir: str) -> None:
        """Registers a PEFT adapter directory under `name` without reading it: it is read, checked and given a
        device slot when a request first needs it (a slot of an idle adapter, least recently used, when none
        is free). Any number may be registered.

        Raises:
          ValueError: an invalid name, or one already registered (unload it first).
          AdapterError: the directory has no adapter_config.json.
        """
        self.registry.register(name, adapter_dir)

    def load_adapter(self, name: str, adapter_dir: str) -> None:
        """Registers a PEFT adapter and reads, checks and writes it into a device slot now, so a bad adapter
        raises here (see `AdapterPool.prepare`); an idle adapter may be evicted from its slot (it stays
        registered).

        Raises:
          ValueError: an invalid name, or one already registered.
          AdapterError: the adapter is invalid (nothing changes).
          PoolFullError: every slot holds an adapter in use (the adapter stays registered, on the host).
        """
        if name in self.registry:
            raise ValueError(f"adapter {name!r} is already registered; unload it first")
        check_adapter_name(name)
        prepared = self.pool.prepare(adapter_dir)
        with self._calls:  # the slot write waits for a call running on another thread
            entry = self.registry.register(name, adapter_dir)
            self.tiers.keep(self.tiers.host, entry, prepared)
            self.tiers.retried(self.pool.install, name, self.tiers.staged(self.pool, entry, prepared),
                               entry.generation)

    def unload_adapter(self, name: str) -> None:
        """Unregisters an adapter and frees its slot and its copies in the host tier and the device cache.

        Raises:
          KeyError: it is not registered.
          RuntimeError: running requests use it.
        """
        with self._calls:  # waits for a call running on another thread
            entry = self.registry.get(name)
            if entry is None:
                raise KeyError(f"adapter {name!r} is not registered")
            if self.pool.generation(name) is not None:
                self.pool.unload(name)  # raises while requests hold it
            self.registry.unregister(name)
            self.tiers.drop(entry.generation)

    @property
    def adapters(self) -> list[str]:
        """Every registered adapter's name (sorted), in a device slot or not."""
        return self.registry.names

    @property
    def resident_adapters(self) -> list[str]:
        """The adapters in device slots, least recently used first."""
        return self.pool.names

    def _make_resident(self, adapters: Sequence[str | None]) -> np.ndarray:
        """The slot of each adapter (-1: None), writing the registered ones not in slots into slots first."""
        names = list(dict.fromkeys(a for a in adapters if a is not None))
        unknown = [a for a in names if a not in self.registry]
        if unknown:
            raise KeyError(f"unknown adapter(s) {unknown}; registered: {self.adapters}")
        if len(names) > self.pool.num_slots:
            raise ValueError(f"{len(names)} adapters in one call but max_loras={self.pool.num_slots}")
        entries = [self.registry.get(a) for a in names]
        held = [e.name for e in entries if self.pool.generation(e.name) == e.generation]
        self.pool.hold(held)  # so that writing the others evicts none of them
        try:
            for entry in entries:
                if entry.name in held:
                    continue
                staged = self.tiers.staged(self.pool, entry, self.tiers.find(entry.generation)[1])
                if self.pool.generation(entry.name) is not None:  # an older registration of the name
                    self.pool.unload(entry.name)
                self.tiers.retried(self.pool.install, entry.name, staged, entry.generation)
                self.pool.hold([entry.name])
                held.append(entry.name)
            return np.array([-1 if a is None else self.pool.slot(a) for a in adapters], np.int32)
        finally:
            self.pool.release(held)

    def encode(self, prompts: Sequence[str | Sequence[int]], add_special_tokens: bool = True,
               kind: str = "prompt") -> list[list[int]]:
        """Token ids of each prompt: text through the model's tokenizer, id lists as they are (Python or numpy
        integers; anything else, a float, a bool or bytes included, is a ValueError naming the `kind` and its index).
        `prompts` itself must be a list of them: one string is refused, not read as one prompt per character."""
        if isinstance(prompts, (str, bytes)):
            raise ValueError(f"{kind}s must be a list, got one {type(prompts).__name__}; for one {kind} give "
                             f"[{kind}]")
        ids = []
        for i, p in enumerate(prompts):
            if not isinstance(p, (str, Sequence, np.ndarray)) or isinstance(p, (bytes, bytearray)):
                raise ValueError(f"{kind} {i} is neither text nor a sequence of token ids: {type(p).__name__}"
                                 + ("; decode it to a str" if isinstance(p, (bytes, bytearray)) else ""))
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"{kind} {i} is text but the model directory has no tokenizer.json; "
                                     "give token ids instead")
                p = self._tokenize(p, add_special_tokens, f"{kind} {i}")
            bad = [t for t in p if not is_integer(t)]
            if bad:
                raise ValueError(f"{kind} {i} holds token ids that are not integers: {bad[:5]}")
            ids.append([int(t) for t in p])
        return ids

    def vocab_size(self, adapter: str | None) -> int:
        """The token ids requests with `adapter` (None: the base model) may hold and sample: the base
        vocabulary plus the tokens the adapter adds. For an adapter in no slot or tier, whose files have not
        been read, an upper bound: plus `max_extra_vocab`. Marks nothing used (the server asks
        from its request threads).

        Raises:
          KeyError: the adapter is not registered.
        """
        if adapter is None:
            return self.model_config.vocab_size
        entry = self.registry.get(adapter)
        if entry is None:
            raise KeyError(f"adapter {adapter!r} is not registered")
        slot = self.pool.peek(adapter)
        if slot is not None and self.pool.generation(adapter) == entry.generation:
            return self.pool.vocab_size(slot)
        prepared = self.tiers.find(entry.generation)[1]
        return self.model_config.vocab_size + (self.pool.max_extra_vocab if prepared is None else prepared.host.added)

    def _check_prompts(self, prompts: Sequence[Sequence[int]], adapters: Sequence[str | None],
                       max_new_tokens: int = 0, kind: str = "prompt") -> None:
        """Raises a ValueError (a KeyError for an adapter not registered) naming the first request, by its `kind`
        and index, that the engine cannot run: adapters not one name or None per prompt, an empty prompt, token
        ids outside its adapter's vocabulary, more than max_seq_len positions with `max_new_tokens`."""
        if isinstance(adapters, str) or not isinstance(adapters, Sequence | np.ndarray):
            raise ValueError(f"adapters must be a list of names (None: base), one per prompt, got {adapters!r:.60}; "
                             "for one adapter on every prompt give [name] * len(prompts)")
        odd = [i for i, a in enumerate(adapters) if a is not None and not isinstance(a, str)]
        if odd:
            raise ValueError(f"adapters[{odd[0]}] is {adapters[odd[0]]!r:.60}: each must be a name or None")
        if len(prompts) != len(adapters):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters; give one per prompt (None: base)")
        if not prompts:
            raise ValueError("no prompts")
        unknown = sorted({a for a in adapters if a is not None and a not in self.registry})
        if unknown:
            raise KeyError(f"unknown adapter(s) {unknown}; registered: {self.adapters}")
        for i, (p, a) in enumerate(zip(prompts, adapters)):
            if len(p) == 0:
                raise ValueError(f"{kind} {i} is empty")
            vocab = self.vocab_size(a)
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{kind} {i} has token ids outside [0, {vocab}) (its adapter's vocabulary): "
                                 f"{bad[:5]}")
            if len(p) + max_new_tokens > self.config.max_seq_len:
                generated = f" with max_new_tokens={max_new_tokens}" if max_new_tokens else ""
                raise ValueError(f"{kind} {i} has {len(p)} tokens;{generated} it exceeds "
                                 f"max_seq_len={self.config.max_seq_len}")

    def prefill_logits(self, prompts: Sequence[str | Sequence[int]], adapters: Sequence[str | None]) -> list[np.ndarray]:
        """Logits of every prompt position, each request with its own adapter (None: the base model), the
        adapters written into slots first where they are not (at most max_loras of them per call).

        Args:
          prompts: token id lists.
          adapters: one adapter name or None per prompt.

        Returns:
          One float32 array [len(prompt), vocab_size(adapter)] per prompt.
        """
        prompts = self.encode(prompts)
        self._check_prompts(prompts, adapters)
        with self._calls:  # no other call's slot writes between these and the step
            slots = self._make_resident(adapters)
            self._check_prompts(prompts, adapters)  # now against each adapter's own vocabulary
            tokens, positions, token_slot, _ = pack_prompts(prompts, slots)
            cache = self.runner.new_cache(*tokens.shape)
            logits, _ = self.runner.run(tokens, positions, token_slot.reshape(-1), cache)
            logits = np.asarray(logits)
        return [logits[i, : len(p), : self.vocab_size(a)] for i, (p, a) in enumerate(zip(prompts, adapters))]

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        adapters: Sequence[str | None],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | Sequence[int] = 0,
        progress=None,
        logprobs: int | None = None,
        n: int = 1,
        ignore_eos: bool = False,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
    ) -> list[Generation]:
        """Generates for every prompt with its adapter (None: the base model), continuously batched.

        Args:
          prompts: token id lists, or text when the model has a tokenizer.
          adapters: one loaded adapter name or None per prompt.
          max_new_tokens: tokens to generate per request at most.
          temperature: 0 for greedy decoding.
          top_p: nucleus sampling mass (1: off).
          top_k: sample among the k most likely tokens (0: off).
          min_p: sample among the tokens at least min_p times as likely as the most likely one (0: off); the
            three filters apply in HF's order (`jlora.sampling.sample_tokens`).
          stop_token_ids: a request stops at any of these (not included in its output), and at the model's
            `eos_token_ids` unless `ignore_eos`.
          seed: sampling seed: request i samples with `seed + i`, or with `seed[i]` when a sequence is given.
            A request's key for its n-th token is `fold_in(key(its seed), n)` (`jlora.sampling`), so its
            output never depends on the other requests of the call, their number or order, or its row.
          progress: optional callable(n) told of each generated token batch (e.g. a tqdm's update).
          logprobs: k in [0, 20]: each generated token's log-probability and the k most likely tokens at its
            position (`Generation.logprobs`; see `jlora.logprobs` for what they are computed from).
          n: samples per prompt, each its own request sharing the first's prefill (a copy of its cache row);
            sample j of a request with seed s samples with `jlora.sampling.sample_seeds(s, n)[j]` (the first with
            s itself).
          ignore_eos: generate past the model's end-of-sequence ids (always max_new_tokens but for
            `stop_token_ids`).
          repetition_penalty: in (0, 2] (1: off): the logit of a token of the prompt or already generated is
            divided by it where positive and multiplied by it otherwise (HF's `repetition_penalty`).
          frequency_penalty, presence_penalty: in [-2, 2] (0: off), OpenAI's: a token generated c times loses
            `frequency_penalty · c` of its logit and `presence_penalty` once. The penalties apply before
            temperature and the filters, as vLLM applies them (`jlora.sampling.apply_penalties`), and to greedy
            decoding too; log-probabilities are of the logits before them.

        Returns:
          n `Generation`s (lists of token ids with `.text`, `.finish_reason` and `.logprobs`) per prompt, prompt
          by prompt: prompt i's samples are items i·n to i·n + n - 1.
        """
        check_sampling(max_new_tokens, temperature, top_p, top_k, min_p, stop_token_ids, seed, logprobs, n, ignore_eos,
                       repetition_penalty, frequency_penalty, presence_penalty)
        _check_progress(progress)
        prompts = self.encode(prompts)
        penalties = dict(repetition_penalty=float(repetition_penalty), frequency_penalty=float(frequency_penalty),
                         presence_penalty=float(presence_penalty))
        max_new_tokens, n = int(max_new_tokens), int(n)  # numpy integers as Python ones from here on
        logprobs = None if logprobs is None else int(logprobs)
        self._check_prompts(prompts, adapters, max_new_tokens)
        stop = frozenset(() if stop_token_ids is None else (int(t) for t in stop_token_ids))
        largest = max(map(self.vocab_size, set(adapters)))  # the widest vocabulary of the requests' adapters
        if bad := sorted(t for t in stop if not 0 <= t < largest):
            raise ValueError(f"stop_token_ids {bad[:5]} are outside [0, {largest}), the requests' vocabulary: "
                             "they would never match")
        if not ignore_eos:
            stop |= self.eos_token_ids
        requests = []
        for prompt, request_seed in zip(prompts, _request_seeds(seed, len(prompts))):
            first = None  # the other samples share its prefill
            for sample_seed in sample_seeds(request_seed, n):
                requests.append(Request(prompt, -1, max_new_tokens, temperature, top_p, sample_seed, stop,
                                        int(top_k), float(min_p), logprobs=logprobs, fork_of=first, **penalties))
                first = first or requests[-1]
        self._run(requests, [a for a in adapters for _ in range(n)], progress)
        return [Generation(r.out, None if self.tokenizer is None else output_text(self.tokenizer, r.prompt, r.out),
                           r.finish, None if logprobs is None else r.out_logprobs) for r in requests]

    def chat(self, conversations: Sequence[Sequence[dict]], adapters: Sequence[str | None], max_new_tokens: int,
             options: ChatOptions = ChatOptions(), **sampling) -> list[Generation]:
        """A reply to each conversation ([{"role": ..., "content": ...}, ...]; a content is a string or OpenAI's
        text parts, joined by newlines) with its adapter: the conversation rendered by the model's chat template as
        transformers' `apply_chat_template` renders it (`options`: by default ending with the assistant's turn),
        then generated as `generate` generates (`sampling`: its keywords, temperature to n).

        Raises:
          ValueError: no chat template or tokenizer, or a conversation the template cannot render (named).
        """
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model directory has no tokenizer.json")
        if isinstance(conversations, str) or not isinstance(conversations, Sequence):
            raise ValueError("conversations must be a list of conversations, each a list of messages")
        prompts = []
        for i, messages in enumerate(conversations):
            if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence) or not messages:
                raise ValueError(f"conversation {i} must be a non-empty list of messages")
            try:
                text = self.chat_template.render(list(messages), options)
            except ChatTemplateError as err:
                raise ValueError(f"conversation {i}: {err}") from None
            prompts.append(self._tokenize(text, False, f"conversation {i}"))  # the template has the special tokens
        return self.generate(prompts, adapters, max_new_tokens, **sampling)

    def _tokenize(self, text: str, add_special_tokens: bool, what: str) -> list[int]:
        """`text`'s token ids; text that is no valid Unicode (a lone surrogate: what Python makes of bytes that
        are not UTF-8 on a command line) is a ValueError naming `what`, where the tokenizer raised a TypeError."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"{what} is not valid Unicode text: a lone surrogate at character {err.start} (from "
                             "bytes that are not UTF-8?)") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def score(self, prompts: Sequence[str | Sequence[int]], continuations: Sequence[str | Sequence[int]],
              adapters: Sequence[str | None], progress=None) -> list[Score]:
        """The log-probability of each continuation after its prompt, under its adapter (None: the base model):
        one prefill of prompt + continuation per request, continuously batched (any mix of adapters in one
        step; long inputs in `prefill_chunk` pieces), nothing generated.

        Args:
          prompts: the contexts (none empty), token id lists or text (text is tokenized alone: as lm-eval does,
            give ids when the tokenization of the joined text matters).
          continuations: one non-empty continuation per prompt, token ids or text (tokenized without special
            tokens).
          adapters: one adapter name or None per prompt.
          progress: optional callable(n) told of each scored request.

        Returns:
          One `Score` per prompt: the sum and per-token log-probabilities of its continuation, and whether
          every continuation token is the most likely one at its position.
        """
        _check_progress(progress)
        prompts = self.encode(prompts)
        if len(continuations) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations; give one per prompt")
        continuations = self.encode(continuations, add_special_tokens=False, kind="continuation")
        empty = [i for i, c in enumerate(continuations) if not c]
        if empty:
            raise ValueError(f"continuation(s) {empty[:5]} are empty")
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty:
            raise ValueError(f"prompt(s) {empty[:5]} are empty: a continuation's first token needs a context")
        full = [p + c for p, c in zip(prompts, continuations)]
        self._check_prompts(full, adapters, kind="prompt + continuation")
        ended = None if progress is None else (lambda r: r.finish is not None and progress(1))
        requests = [Request(f, -1, 0, prompt_logprobs=1, on_update=ended) for f in full]
        self._run(requests, adapters)
        scores = []
        for p, r in zip(prompts, requests):
            scored = r.prompt_out_logprobs[len(p):]
            scores.append(Score(sum(t.logprob for t in scored), [t.logprob for t in scored],
                                all(t.logprob >= t.top[0][1] for t in scored)))
        return scores

    def new_batcher(self, num_rows: int, max_seq: int, progress=None) -> Batcher:
        """A `Batcher` of `num_rows` rows of up to `max_seq` positions over a new cache, as the config says
        (`prefill_chunk`, `block_size`, `prefix_caching`, and `kv_blocks`, or as many blocks as `kv_cache_memory`
        holds, at most what the rows hold at `max_seq`)."""
        c = self.config
        size = c.block_size or max_seq
        cfg = self.model_config if self.runner.tp is None else self.runner.tp.layout  # KV heads as stored
        block_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size
                       * jnp.dtype(self.runner.dtype).itemsize) // c.tensor_parallel  # per device
        every_row = num_rows * -(-max_seq // size)  # blocks for every row at max_seq: the default
        blocks = c.kv_blocks or every_row
        if c.kv_cache_memory is not None:
            blocks = int(c.kv_cache_memory * 2**30 // block_bytes)
            if blocks < 1:
                raise ValueError(f"kv_cache_memory {c.kv_cache_memory} GiB holds no block of {size} positions "
                                 f"({block_bytes / 2**20:.1f} MiB on each device)")
            blocks = min(blocks, every_row)
        # The penalties' token history ([num_rows, max_seq] on each device, `Batcher.history`) is made by the
        # first request with penalties: counted here, so that it cannot run the device out of memory then.
        history_bytes = num_rows * max_seq * np.dtype(HISTORY_DTYPE).itemsize
        need, free = (blocks * block_bytes + history_bytes) * len(self.devices), _free_bytes(self.devices)
        if free is not None and need > free:
            gc.collect()  # a finished batcher's cache may still be held in a reference cycle: counted as in use
            free = _free_bytes(self.devices)
        if free is not None and need > free:
            raise ValueError(f"a KV cache of {blocks} blocks of {size} positions takes "
                             f"{blocks * block_bytes / 2**30:.1f} GiB on each device (and the penalties' token "
                             f"history {history_bytes / 2**30:.1f} GiB), more than the "
                             f"{free / len(self.devices) / 2**30:.1f} GiB free there: lower kv_blocks, "
                             "kv_cache_memory, max_batch or max_seq_len")
        return Batcher(self.runner, num_rows, max_seq, progress, c.prefill_chunk, c.block_size or None, blocks,
                       c.prefix_caching)

    def _run(self, requests: list[Request], adapters: Sequence[str | None], progress=None) -> None:
        """Runs requests to their end, each with its adapter: through `Admission` (adapters written into slots
        as rows free) and a `Batcher` of up to max_batch rows, `progress(n)` told of generated tokens; one call
        at a time (`_calls`)."""
        with self._calls:
            longest = max(len(r.prompt) + r.max_new for r in requests)
            rows = bucket(min(len(requests), self.config.max_batch))
            batcher = self.new_batcher(rows, bucket(longest, 16), progress)
            loaded = threading.Event()
            admission = Admission(self.pool, self.registry, self.tiers, self.loader, wake=loaded.set,
                                  max_loads=self.max_loads)
            refused: list[Request] = []  # by their on_update: no scan of every request at every step
            for r, a in zip(requests, adapters):
                r.on_update = functools.partial(_note_refusal, refused, r.on_update)
                admission.submit(r, a)
            idle_polls = 0  # polls in a row that admitted nothing with no load running
            try:
                while admission.pending or batcher.busy:
                    admission.poll(batcher.add, write=not batcher.busy)  # writes go while a step runs
                    if refused:
                        refusal = refused[0]  # a load that failed, no slot with eviction off (503), or bad input
                        kind = (AdapterError if refusal.finish == "failed"
                                else PoolFullError if refusal.status == 503 else ValueError)
                        raise kind(refusal.error)
                    if batcher.busy:
                        batcher.step(lambda: admission.poll(batcher.add))
                        idle_polls = 0
                    elif admission.pending:
                        if admission.waiting_for_loads:
                            loaded.wait()
                            loaded.clear()
                            idle_polls = 0
                            continue
                        idle_polls += 1  # a load may have ended after the poll looked: one more poll installs it
                        if idle_polls == 2:
                            raise PoolFullError(f"no slot for adapter(s) {admission.pending.adapters()}:"
                                                f" every slot holds an adapter in use or eviction is off")
            except RuntimeError as err:
                self.tiers.relieve(err)  # out of device memory: the device cache lets go, for the calls after
                raise
            finally:
                for r in requests:  # after an error: the requests still here give back their adapters
                    if r.finish is None and not admission.cancel(r):
                        batcher.cancel(r)
                batcher.settle()  # after a Ctrl-C too: the device idle, as a process may exit next
