"""`EngineConfig`: every option of an `Engine`, validated in one place, and its command-line flags.

`Engine`, `Engine.from_pretrained`, `jlora generate`, `jlora serve` and the Ray replicas all take their options
from here: a field's default, check and help text are written once (`add_arguments`, `from_args`).
"""

from __future__ import annotations

import argparse
import dataclasses

from jlora.ops import BACKENDS
from jlora.pallas.decode_attention import split_chunk
from jlora.values import is_integer, is_real

__all__ = ["DTYPES", "EngineConfig"]

DTYPES = ("bfloat16", "float16", "float32")


def _option(default, help: str, metavar: str | None = None, choices: tuple | None = None, kind: type = int):
    return dataclasses.field(default=default, metadata=dict(help=help, metavar=metavar, choices=choices, kind=kind))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """An engine's options. Each field is a flag of `jlora generate` and `jlora serve` (`--max-loras`, ...)."""

    max_loras: int = _option(8, "adapter slots on the device (any number of adapters may be registered)")
    max_cpu_loras: int | None = _option(
        None, "adapters kept read and converted in host memory, least recently used evicted (default: "
              "max_loras), so an adapter evicted from its slot comes back without reading its files", "N")
    max_cpu_lora_memory: float | None = _option(
        None, "GiB of host memory the host tier's adapters may take (their arrays), least recently used evicted "
              "past it as past max_cpu_loras: a count alone bounds memory poorly when ranks and targets differ",
        "GIB", kind=float)
    device_cache_memory: float | None = _option(
        None, "GiB of device memory (all devices together) for adapters kept copied to the device beside the slots, "
              "least recently used evicted past it: an adapter evicted from its slot that the device cache still "
              "holds comes back by a device-side slot write, with no host -> device copy beside the running steps; it "
              "lets go of its adapters where a load runs the device out of memory (default: none kept)", "GIB",
        kind=float)
    adapter_readers: int = _option(
        4, "processes that read and convert adapter files, started as loads need them, so that a load never holds "
           "the GIL the engine loop needs; 0: the loader threads read them", "N")
    adapter_read_timeout: float = _option(
        120.0, "seconds a reader process may take to read one adapter (storage that hangs, a file that never "
               "ends) before it is stopped and the adapter fails to load; only with adapter_readers > 0",
        "SECONDS", kind=float)
    adapter_retry_after: float = _option(
        30.0, "seconds an adapter whose load failed fails its requests at once, without reading it again; the first "
              "request after loads it again (storage back, a reader process killed mid-read, files fixed in place)",
        "SECONDS", kind=float)
    max_lora_rank: int = _option(64, "the largest adapter rank accepted")
    max_extra_vocab: int = _option(
        256, "per adapter, the embedding and lm_head rows that may differ from the base model's: tokens it adds "
             "past the base vocabulary, trainable tokens, rows it changed (held on the device only once an "
             "adapter has such rows)", "E")
    max_batch: int = _option(32, "requests (cache rows) decoding together")
    max_seq_len: int = _option(2048, "the longest prompt + generation accepted (a LongLoRA adapter's "
                                     "context_length at most)")
    prefill_chunk: int = _option(
        512, "prompt tokens prefilled per step at most (a power of two >= 16), beside the decoding rows; a longer "
             "prompt goes in pieces. Larger: fewer steps per prompt; smaller: a step that takes a prompt delays "
             "the decoding rows less", "TOKENS")
    block_size: int = _option(
        16, "positions per KV-cache block (a power of two >= 16), or 0: each request's cache one block of the "
            "longest request's length (a contiguous cache, no prefix caching across requests' blocks)", "POSITIONS")
    kv_blocks: int | None = _option(
        None, "blocks in the KV cache, shared out to requests as their tokens need them (a request waits for "
              "free blocks; when they run out, the request admitted last is preempted and resumed later); "
              "default: what --kv-cache-memory holds, else max_batch requests at max_seq_len", "N")
    kv_cache_memory: float | None = _option(
        None, "GiB of each device's memory for the KV cache: sets the number of blocks (with --kv-blocks unset)",
        "GIB", kind=float)
    prefix_caching: bool = _option(
        True, "keep the full blocks of prompts keyed by adapter (its registration and the files it was read "
              "from) and tokens, so a later request under the same adapter prefills only what follows its longest "
              "cached prefix")
    dtype: str | None = _option(None, "the weights' and activations' type (default: bfloat16 on GPU, float32 "
                                      "elsewhere)", choices=DTYPES)
    backend: str = _option("auto", "the LoRA ops' backend ('auto': on GPU gather for calls of under 32 "
                                   "tokens with tokens x rank <= 512, the Pallas kernels for the rest; "
                                   "reference elsewhere)", choices=BACKENDS)
    split_attention: str = _option(
        "auto", "decode attention split over fixed chunks of positions too (flash-decoding), for long contexts: "
                "'auto' splits when max_seq_len >= 1024 over a paged cache (--block-size > 0), and over a "
                "contiguous one when max_batch x the KV heads on a device is at most 64. The engine's choice, "
                "never a step's: a request's tokens do not depend on the requests beside it",
        choices=("auto", "on", "off"))
    evict: str = _option("lru", "when every slot is taken: 'lru' evicts the least recently used idle adapter, "
                                "'refuse' fails the load", choices=("lru", "refuse"))
    tensor_parallel: int = _option(1, "split the model over the first N devices (Megatron-style; see "
                                      "docs/design.md)", "N")

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank", "max_batch", "max_seq_len", "tensor_parallel", "prefill_chunk"):
            _check_int(self, name, 1)
        _check_int(self, "max_extra_vocab", 0)
        _check_int(self, "adapter_readers", 0)
        if self.max_cpu_loras is not None:
            _check_int(self, "max_cpu_loras", 0)
        if self.kv_blocks is not None:
            _check_int(self, "kv_blocks", 1)
        if self.kv_cache_memory is not None:
            _check_positive(self, "kv_cache_memory", "GiB")
            if self.kv_blocks is not None:
                raise ValueError("give kv_blocks or kv_cache_memory, not both")
        _check_positive(self, "adapter_read_timeout", "seconds")
        _check_positive(self, "adapter_retry_after", "seconds")
        for name in ("max_cpu_lora_memory", "device_cache_memory"):
            if getattr(self, name) is not None:
                _check_positive(self, name, "GiB")
        _check_int(self, "block_size", 0)
        if self.block_size and (self.block_size < 16 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two >= 16, or 0, got {self.block_size}")
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two >= 16, got {self.prefill_chunk}")
        if self.dtype is not None:  # a name or anything with one (jnp.bfloat16, np.dtype): kept as its name
            name = getattr(self.dtype, "name", None) or getattr(self.dtype, "__name__", None) or self.dtype
            if name not in DTYPES:
                raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
            object.__setattr__(self, "dtype", name)
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {self.prefix_caching!r}")
        for name in ("backend", "evict", "split_attention"):
            choices = EngineConfig.__dataclass_fields__[name].metadata["choices"]
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")

    @property
    def host_capacity(self) -> int:
        """Adapters the host tier keeps: `max_cpu_loras`, by default `max_loras`."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def host_bytes(self) -> int | None:
        """Bytes of arrays the host tier keeps at most (`max_cpu_lora_memory`), or None: no byte budget."""
        return None if self.max_cpu_lora_memory is None else int(self.max_cpu_lora_memory * 2**30)

    @property
    def device_cache_bytes(self) -> int:
        """Bytes of arrays the device cache keeps at most (`device_cache_memory`; 0: none)."""
        return 0 if self.device_cache_memory is None else int(self.device_cache_memory * 2**30)

    @property
    def weights_out_in(self) -> bool:
        """Whether the engine stores its projections' weights [out, in] (`ModelConfig.weights_out_in`): when each
        of its decode steps has one row (max_batch 1), whose products then run as row reductions. On an H200 the
        8B base step at batch 1 took 4.19 against 4.75 ms; steps of 2-32 rows over [out, in] ran 2-4 % slower
        and a prefill level (docs/performance.md § The model step, *The weights as [out, in]*)."""
        return self.max_batch == 1

    def attention_chunk(self, kv_heads: int) -> int | None:
        """Positions per chunk that decode attention splits over for a model of `kv_heads` KV heads
        (`split_attention`; `jlora.pallas.decode_attention.split_chunk` of max_seq_len), or None: unsplit.
        Under 'auto' it splits when contexts may be long enough to: over a paged cache always (full batches
        of short requests pay 1-2 % of a step, small batches or long contexts gain up to a third), over rows
        where one program per request and KV head would leave most of the GPU's SMs idle. Evidence:
        docs/performance.md § The model step, *Decode attention split over positions*."""
        split = (self.split_attention == "on" if self.split_attention != "auto" else self.max_seq_len >= 1024 and (
            self.block_size > 0 or self.max_batch * kv_heads // self.tensor_parallel <= 64))
        return split_chunk(self.max_seq_len, self.block_size) if split else None

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Adds a flag for each field but `skip` (`--max-loras N`, ...), defaulting to the field's default."""
        for field in dataclasses.fields(EngineConfig):
            if field.name in skip:
                continue
            meta, flag = field.metadata, "--" + field.name.replace("_", "-")
            default = "" if field.default is None else f" (default {field.default})"
            if isinstance(field.default, bool):  # --name / --no-name
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                                    help=meta["help"])
                continue
            parser.add_argument(flag, type=str if meta["choices"] else meta["kind"], default=field.default,
                                choices=meta["choices"], metavar=meta["metavar"], help=meta["help"] + default)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The config of parsed flags (those `add_arguments` added), with `overrides` on top."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **overrides})

    @classmethod
    def from_settings(cls, values: dict) -> EngineConfig:
        """The config of named settings as a command line or a config file gives them: text (`serve run
        jlora.ray:app max_loras=8 prefix_caching=false`) parsed as the field's flag parses it, other values (a
        YAML file's numbers and booleans) as they are. Raises ValueError naming an unknown key or a value that
        does not parse."""
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(map(repr, unknown))}; the options are "
                             f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        return cls(**{name: _parse(name, v) if isinstance(v, str) else v for name, v in values.items()})


def _parse(name: str, text: str):
    """A field's value from text, as its flag parses it (bools: true/false)."""
    field = EngineConfig.__dataclass_fields__[name]
    if isinstance(field.default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{name} must be true or false, got {text!r}")
        return text.lower() == "true"
    if field.metadata["choices"]:
        return text
    try:
        return field.metadata["kind"](text)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if field.metadata['kind'] is int else 'a number'}, "
                         f"got {text!r}") from None


def _check_int(config: EngineConfig, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    object.__setattr__(config, name, int(value))


def _check_positive(config: EngineConfig, name: str, unit: str) -> None:
    value = getattr(config, name)
    if not is_real(value) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a number of {unit} > 0, got {value!r}")
    object.__setattr__(config, name, float(value))
