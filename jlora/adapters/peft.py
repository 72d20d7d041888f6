"""PEFT LoRA adapters: parse, validate and convert one adapter directory into slot-ready host arrays.

Reads `adapter_config.json` + `adapter_model.safetensors` and returns `HostAdapter`: for every target
group of every layer (and the embedding / lm_head) the A and B of one slot over the modules it targets,
zero-padded to its rank bucket R, with the module's scaling folded into B. Everything is checked before
anything reaches the device, so a bad adapter never touches the pool.

Supported: `r`, `lora_alpha`, `use_rslora`, `target_modules` (list of names, a regex string or
"all-linear"), `rank_pattern`, `alpha_pattern`, `layers_to_transform`, `fan_in_fan_out` (for Llama's
nn.Linear layers PEFT itself resets it to False, and so do we), `lora_bias`, `use_dora`, embedding layers saved
whole (`base_layer.weight`, `modules_to_save` of embed_tokens / lm_head, a resized vocabulary),
`trainable_token_indices` and LongLoRA's `context_length` (docs/adapters.md says how each computes). Anything
else that would change the math raises, naming the feature or module.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jlora.adapters.config import AdapterError, adapter_file, read_config
from jlora.models.config import ModelConfig
from jlora.models.lora_weights import module_shapes

__all__ = ["AdapterError", "BaseRowsNeeded", "HostAdapter", "as_dtype", "read_adapter"]

LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDING_MODULES = ("model.embed_tokens", "lm_head")
_KEY = re.compile(  # PEFT's tensor names, the adapter name removed
    r"^base_model\.model\.(?P<module>.+?)\.(?:"
    r"(?P<ab>lora_[AB])(?:\.default)?\.weight|(?P<emb>lora_embedding_[AB])(?:\.default)?"
    r"|(?P<bias>lora_B)(?:\.default)?\.bias|(?P<mag>lora_magnitude_vector)(?:\.default)?(?:\.weight)?"
    r"|(?P<saved>base_layer\.weight|weight)|token_adapter\.(?P<tokens>trainable_tokens_delta)(?:\.default)?)$"
)
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<name>\w+)$")


class BaseRowsNeeded(AdapterError):
    """`read_adapter` was given no base rows for an adapter that carries embedding rows."""


@dataclasses.dataclass(frozen=True)
class HostAdapter:
    """One adapter converted for a slot (NumPy; A and B in a slot's dtype, scaling folded into the B side),
    holding only what it targets: a slot's other parts are written as zeros on the device, so they cost neither
    host memory nor a transfer. That holds within a fused group too: where an adapter targets some of its
    modules (`slices`: q_proj and v_proj of q|k|v), A and B hold only their slices, in the group's order
    (`group` gives the whole group's arrays).

    Besides A and B per module: `bias` and `magnitude` per (layer, group) key (`(None, "lm_head")` for the
    lm_head), each [N] over the group's fused columns (magnitude with a mask of the DoRA columns); `embed_rows`
    and `lm_head_rows`, token id -> the [H] row that replaces the base's, its LoRA included (PEFT's saved
    embedding layers, `modules_to_save` copies and trainable tokens, rows the adapter adds past the base
    vocabulary); `rope_factor` for LongLoRA.
    """

    rank: int  # the largest rank over its modules
    # R below: the rank bucket (`rank_bucket`), which the slot write pads to the slot's rank on the device
    # targeted group -> (a [S'·R, K], b [N', R]) over its S' targeted modules of N' output columns (`slices`)
    layers: tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]
    embed: tuple[np.ndarray, np.ndarray] | None  # a [R, V], b [H, R], when targeted
    lm_head: tuple[np.ndarray, np.ndarray] | None  # a [R, H], b [V, R], when targeted
    bias: dict[tuple[int | None, str], np.ndarray] = dataclasses.field(default_factory=dict)
    magnitude: dict[tuple[int | None, str], tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    embed_rows: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    lm_head_rows: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    added: int = 0  # tokens past the base vocabulary (ids V .. V + added - 1)
    rope_factor: float = 1.0  # LongLoRA: positions divided by this for the adapter's tokens
    files: str = ""  # the state of the files it was read from (`files_version`)
    # (layer, group) -> the indices of the fused group's modules it targets, where it targets some but not all
    # (q_proj and v_proj of q|k|v): `layers` holds only their slices, and the slot write zeroes the others'.
    # Under tensor parallelism B holds the whole group, in the devices' order (`permute_adapter`).
    slices: dict[tuple[int, str], tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (host memory while it is not staged)."""
        parts = [*(x for layer in self.layers for ab in layer.values() for x in ab), *(self.embed or ()),
                 *(self.lm_head or ()), *self.bias.values(), *(x for m in self.magnitude.values() for x in m),
                 *self.embed_rows.values(), *self.lm_head_rows.values()]
        return sum(x.nbytes for x in parts)

    def group(self, layer: int, group: str, outs: tuple[tuple[str, int], ...]) -> tuple[np.ndarray, np.ndarray]:
        """A [S·R, K] and B [N, R] of a targeted fused group over all its modules `outs` (module_shapes'), zero
        in the slices of those the adapter does not target; in the checkpoint's order."""
        a, b = self.layers[layer][group]
        kept = self.slices.get((layer, group))
        if kept is None:
            return a, b
        rank = b.shape[1]
        rows_a, rows_b = module_rows(outs, rank, kept)
        full_a, full_b = np.zeros((len(outs) * rank, a.shape[1]), a.dtype), np.zeros((sum(n for _, n in outs), rank),
                                                                                   b.dtype)
        for full, part, ranges in ((full_a, a, rows_a), (full_b, b, rows_b)):
            start = 0
            for first, stop in ranges:
                full[first:stop] = part[start : start + stop - first]
                start += stop - first
        return full_a, full_b

    def with_dtype(self, dtype) -> HostAdapter:
        """The adapter with its A and B in `dtype` (as a slot stores them: rounding on the host is the device's
        round-to-nearest-even); arrays already in it are kept, not copied."""
        cast = lambda ab: None if ab is None else tuple(as_dtype(x, dtype) for x in ab)
        layers = tuple({g: cast(ab) for g, ab in layer.items()} for layer in self.layers)
        return dataclasses.replace(self, layers=layers, embed=cast(self.embed), lm_head=cast(self.lm_head))


@dataclasses.dataclass(frozen=True)
class BaseRows:
    """The base model's embedding and lm_head as host [V, H] float32 arrays, fetched only when an adapter
    carries embedding layers to compare with them."""

    embedding: Callable[[], np.ndarray]
    lm_head: Callable[[], np.ndarray]


def rank_bucket(rank: int, padded_rank: int) -> int:
    """The rank an adapter's A and B are zero-padded to on the host: the power of two >= its largest rank, at
    least 8, at most `padded_rank` (a slot's). Host memory and the copy to the device follow the adapter's
    rank, not the slots' (an r=8 adapter in r=64 slots: 8x fewer bytes), and the slot write compiles once per
    bucket."""
    return min(padded_rank, max(8, 1 << (max(rank, 1) - 1).bit_length()))


def module_rows(outs: tuple[tuple[str, int], ...], rank: int, kept: tuple[int, ...]) -> tuple[tuple, tuple]:
    """((start, stop), ...) of A's rows and of B's that modules `kept` (indices into `outs`, module_shapes'
    (name, output dim) of a fused group) take in the group's A [S·R, K] and B [N, R]."""
    starts = np.cumsum([0] + [n for _, n in outs])
    return (tuple((i * rank, (i + 1) * rank) for i in kept),
            tuple((int(starts[i]), int(starts[i + 1])) for i in kept))


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _targets(cfg: dict, module: str) -> bool:
    target = cfg.get("target_modules")
    name = module.rsplit(".", 1)[-1]
    if isinstance(target, str):
        if target == "all-linear":
            return name in LINEAR_MODULES
        return re.fullmatch(target, module) is not None
    return any(module == t or module.endswith("." + t) for t in (target or ()))


_BFLOAT16 = np.dtype(jax.numpy.bfloat16)


def _float32(x: np.ndarray) -> np.ndarray:
    """`x` (any floating type) as float32, exactly; bfloat16 by widening its bits (NumPy's cast, through
    ml_dtypes, is about four times slower, and an adapter is tens of millions of values)."""
    if x.dtype == _BFLOAT16:
        return np.left_shift(x.view(np.uint16), 16, dtype=np.uint32).view(np.float32)
    return x.astype(np.float32, copy=False)


def as_dtype(x: np.ndarray, dtype) -> np.ndarray:
    """`x` (any floating type) in `dtype`, rounded once from its float32 value (to the nearest, ties to even, as
    the device rounds); `x` itself when already in it."""
    dtype = np.dtype(dtype)
    return x if x.dtype == dtype else _float32(x).astype(dtype)


def _finite(x: np.ndarray) -> bool:
    if x.dtype == _BFLOAT16:  # an exponent of all ones is inf or NaN (np.isfinite on bfloat16 is slow)
        return not ((x.view(np.uint16) & 0x7F80) == 0x7F80).any()
    return bool(np.isfinite(x).all())


def _size_limits(config: ModelConfig, max_rank: int, max_extra_vocab: int) -> tuple[int, int]:
    """(values in one tensor, values in all) past twice what an adapter of rank <= `max_rank` for this model
    holds: the A, B, bias and magnitude of every module of every layer, and per embedding layer its LoRA, a
    saved copy and trainable-token rows of up to V + `max_extra_vocab` rows. Twice: a file just past a limit
    gets the message that names which (more added tokens, a larger rank, ...)."""
    h, rows = config.hidden_size, config.vocab_size + max_extra_vocab
    widths = [(k, n) for k, outs in module_shapes(config).values() for _, n in outs]
    per_layer = sum(max_rank * (k + n) + 2 * n for k, n in widths)
    embedding = 2 * rows * h + max_rank * (rows + h) + 2 * rows
    one = max(rows * h, max_rank * max(rows, *(max(k, n) for k, n in widths)))
    return 2 * one, 2 * (config.num_layers * per_layer + 2 * embedding)


_FLOAT_TYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the types a LoRA weight may be saved in


def _read_tensors(adapter_dir: str, limits: tuple[int, int],
                  roots: Sequence[str] = ()) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors in the floating types saved, those types' names) of adapter_model.safetensors (inside `roots` if
    given: `adapter_file`), whose header is checked against `limits` (`_size_limits`) before any data is read: a
    hostile header never makes a reader allocate."""
    if not os.path.exists(os.path.join(adapter_dir, "adapter_model.safetensors")) and os.path.isfile(
            os.path.join(adapter_dir, "adapter_model.bin")):
        raise AdapterError(f"{adapter_dir}: only adapter_model.bin (a torch pickle); save with safetensors")
    path = adapter_file(adapter_dir, "adapter_model.safetensors", roots)
    tensors, dtypes = {}, {}
    try:
        with safe_open(path, framework="numpy") as f:  # NumPy: no JAX dispatch on a loader thread
            total = 0
            for key in f.keys():
                header = f.get_slice(key)
                if header.get_dtype() not in _FLOAT_TYPES:  # bool, integers, float8 (which NumPy cannot hold)
                    raise AdapterError(f"{path}: tensor {_shown(key)} has dtype {header.get_dtype()}; LoRA weights "
                                       f"must be floating: {', '.join(_FLOAT_TYPES)}")
                values = math.prod(header.get_shape())
                total += values
                if values > limits[0]:
                    raise AdapterError(f"{path}: tensor {_shown(key)} holds {values} values, more than any LoRA "
                                       f"weight of this model ({limits[0]} at most)")
            if total > limits[1]:
                raise AdapterError(f"{path}: {total} values in all, more than an adapter of this model up to "
                                   f"max_lora_rank holds ({limits[1]} at most)")
            for key in f.keys():
                t = f.get_tensor(key)
                tensors[key], dtypes[key] = t, t.dtype.name
                if not _finite(t):  # one inf would make every token of the adapter inf
                    bad = int((~np.isfinite(_float32(t))).sum())
                    raise AdapterError(f"{path}: tensor {_shown(key)} holds {bad} non-finite values (NaN or inf)")
    except AdapterError:
        raise
    except (SafetensorError, OSError, ValueError, TypeError) as err:  # a corrupt header, truncated data, odd dtypes
        raise AdapterError(f"{path}: cannot read safetensors ({type(err).__name__}: {str(err)[:200]})") from None
    return tensors, dtypes


def _shown(name: str) -> str:
    """A tensor or module name of the adapter's file for a message: quoted, at most 100 characters."""
    return repr(name if len(name) <= 100 else name[:97] + "...")


def _same_as_saved(base: np.ndarray, dtype: str) -> np.ndarray:
    """The base rows rounded to the dtype the adapter saved its copy in, so equal rows compare equal."""
    return np.asarray(jax.numpy.asarray(base, jax.numpy.float32).astype(dtype).astype(jax.numpy.float32))


def _trainable_tokens(adapter_dir: str, cfg: dict) -> dict[str, list[int]]:
    """`trainable_token_indices` as module -> token ids (a list means the input embedding)."""
    spec = cfg.get("trainable_token_indices")
    if not spec:
        return {}
    if isinstance(spec, list):
        return {"model.embed_tokens": list(spec)}
    out = {}
    for name, ids in spec.items():
        module = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}.get(name.rsplit(".", 1)[-1])
        if module is None:
            raise AdapterError(f"{adapter_dir}: trainable_token_indices names a module other than embed_tokens and "
                               "lm_head (not supported)")
        out[module] = list(ids)
    return out


def read_adapter(adapter_dir: str, config: ModelConfig, max_rank: int, padded_rank: int, *,
                 base: BaseRows | None = None, max_extra_vocab: int = 0,
                 max_seq_len: int | None = None, dtype=np.float32, roots: Sequence[str] = ()) -> HostAdapter:
    """Parses and validates a PEFT adapter directory into slot arrays zero-padded to its `rank_bucket` (at
    most `padded_rank`).

    `base` gives the base model's embedding rows, needed only for adapters that carry embedding layers;
    `max_extra_vocab` bounds both the tokens an adapter adds and the rows it may change per embedding layer;
    `max_seq_len` bounds a LongLoRA adapter's context. A and B come back in `dtype` (a slot's), each value
    rounded once from float32 (the scaling applied in float32), except an adapter with DoRA (use_dora), whose
    column factors are computed from them: float32. With `roots` (a runtime load's --lora-root) each file must
    resolve inside one of them (`adapter_file`).

    Raises:
      AdapterError: missing or corrupt files, unsupported features, unknown modules, ranks above
        `max_rank`, shapes that do not match the base model, non-floating tensors, more changed or added
        rows than `max_extra_vocab`, or files that changed during each read (`_read_files`).
    """
    files, cfg, tensors, dtypes = _read_files(adapter_dir, _size_limits(config, max_rank, max_extra_vocab), roots)
    layers_to_transform = cfg.get("layers_to_transform")
    if isinstance(layers_to_transform, int):
        layers_to_transform = [layers_to_transform]
    use_dora, lora_bias = bool(cfg.get("use_dora")), bool(cfg.get("lora_bias"))
    dtype = np.dtype(np.float32 if use_dora else dtype)
    saved_whole = list(cfg.get("modules_to_save") or [])
    for name in saved_whole:
        if name.rsplit(".", 1)[-1] not in ("embed_tokens", "lm_head"):
            raise AdapterError(f"{adapter_dir}: modules_to_save names a module other than the embedding layers "
                               "embed_tokens and lm_head (only those may be saved whole)")
    trainable = _trainable_tokens(adapter_dir, cfg)

    parts: dict[str, dict[str, np.ndarray]] = {}  # module -> kind (A, B, bias, mag, saved, tokens) -> tensor
    saved_dtype: dict[str, str] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{adapter_dir}: unexpected tensor {_shown(key)} (not a PEFT LoRA weight)")
        kind = (m["ab"] or m["emb"] or "")[-1:] or ("bias" if m["bias"] else "mag" if m["mag"] else
                                                  "saved" if m["saved"] else "tokens")
        if kind in parts.get(m["module"], {}):
            raise AdapterError(f"{adapter_dir}: {m['module']}: two tensors for its {kind} ({_shown(key)})")
        # A and B as saved (a layer's go into the slot's dtype once), the rest in float32
        parts.setdefault(m["module"], {})[kind] = value if kind in ("A", "B") else _float32(value)
        if kind == "saved":
            saved_dtype[m["module"]] = dtypes[key]

    groups = module_shapes(config)
    slot_of = {name: (g, i) for g, (_, outs) in groups.items() for i, (name, _) in enumerate(outs)}
    ranks = [kinds["A"].shape[0] for kinds in parts.values() if "A" in kinds and kinds["A"].ndim == 2]
    h, v, r_pad = config.hidden_size, config.vocab_size, rank_bucket(max(ranks, default=1), padded_rank)
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(config.num_layers)]  # targeted only
    kept: dict[tuple[int, str], tuple[int, ...]] = {}  # (layer, group) -> the indices of its modules with weights
    for module, kinds in parts.items():  # known before any is placed: a group's arrays hold only their slices
        lm = _LAYER_MODULE.match(module)
        if lm and lm["name"] in slot_of and {"A", "B"} <= set(kinds):
            key, i = (int(lm["layer"]), slot_of[lm["name"]][0]), slot_of[lm["name"]][1]
            kept[key] = tuple(sorted({*kept.get(key, ()), i}))
    embed = lm_head = None
    bias: dict[tuple[int | None, str], np.ndarray] = {}
    magnitude: dict[tuple[int | None, str], tuple[np.ndarray, np.ndarray]] = {}
    full_lora: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # embedding modules: (A, scaled B) as saved
    rank_used = 0
    for module, kinds in sorted(parts.items()):
        extra = set(kinds) - {"A", "B"}
        if module in EMBEDDING_MODULES:
            if extra - {"saved", "tokens", "bias", "mag"}:
                raise AdapterError(f"{adapter_dir}: {module}: unexpected tensors {sorted(extra)}")
        elif extra - {"bias", "mag"}:
            raise AdapterError(f"{adapter_dir}: {module}: {sorted(extra & {'saved', 'tokens'})} of a layer that is "
                               "not an embedding layer (not supported)")
        if "bias" in kinds and not lora_bias:
            raise AdapterError(f"{adapter_dir}: {module}: a lora_B bias but the config says lora_bias=false")
        if "mag" in kinds and not use_dora:
            raise AdapterError(f"{adapter_dir}: {module}: a DoRA magnitude but the config says use_dora=false")
        if not {"A", "B"} & set(kinds):
            if extra & {"bias", "mag"}:
                raise AdapterError(f"{adapter_dir}: module {module} has a bias or magnitude but no lora_A / lora_B")
            continue
        if not {"A", "B"} <= set(kinds):
            raise AdapterError(f"{adapter_dir}: module {module} has lora_{'A' if 'A' in kinds else 'B'} only")
        a, b = kinds["A"], kinds["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{adapter_dir}: {module}: lora_A {a.shape} and lora_B {b.shape} disagree on the rank")
        rank = a.shape[0]
        expected_rank = _pattern_value(cfg.get("rank_pattern") or {}, module, cfg["r"])
        if rank != expected_rank:
            raise AdapterError(f"{adapter_dir}: {module}: rank {rank} but the config says r={expected_rank}")
        if rank > max_rank:
            raise AdapterError(f"{adapter_dir}: {module}: rank {rank} exceeds max_lora_rank={max_rank}")
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        scale = alpha / np.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        lm = _LAYER_MODULE.match(module)
        if use_dora and "mag" not in kinds and module != "model.embed_tokens":
            raise AdapterError(f"{adapter_dir}: {module}: use_dora=true but no lora_magnitude_vector")
        if module in EMBEDDING_MODULES:
            is_embed = module == "model.embed_tokens"
            if is_embed and ("mag" in kinds or "bias" in kinds):
                raise AdapterError(f"{adapter_dir}: {module}: {'DoRA' if 'mag' in kinds else 'a LoRA bias'} on the "
                                   "input embedding is not supported")
            # A [r, V'] and B [H, r] (embedding), A [r, H] and B [V', r] (lm_head); V' >= V with added tokens.
            vocab_rows = a.shape[1] if is_embed else b.shape[0]
            if (b.shape[0] if is_embed else a.shape[1]) != h or vocab_rows < v:
                want = ((rank, v), (h, rank)) if is_embed else ((rank, h), (v, rank))
                raise AdapterError(f"{adapter_dir}: {module}: A {a.shape}, B {b.shape}; the base model needs {want}")
            a, b = _float32(a), scale * _float32(b)
            full_lora[module] = (a, b)
            if is_embed:
                embed = (np.zeros((r_pad, v), dtype), np.zeros((h, r_pad), dtype))
                embed[0][:rank], embed[1][:, :rank] = as_dtype(a[:, :v], dtype), as_dtype(b, dtype)
            else:
                lm_head = (np.zeros((r_pad, h), dtype), np.zeros((v, r_pad), dtype))
                lm_head[0][:rank], lm_head[1][:, :rank] = as_dtype(a, dtype), as_dtype(b[:v], dtype)
                if "bias" in kinds:
                    bias[None, "lm_head"] = _vector(adapter_dir, module, "lora_B bias", kinds["bias"], v, scale)
                if "mag" in kinds:
                    magnitude[None, "lm_head"] = (_vector(adapter_dir, module, "magnitude", kinds["mag"], v),
                                                  np.ones(v, bool))
        elif lm and lm["name"] in slot_of and int(lm["layer"]) < config.num_layers:
            layer = int(lm["layer"])
            if layers_to_transform is not None and layer not in layers_to_transform:
                raise AdapterError(f"{adapter_dir}: {module}: weights for a layer outside layers_to_transform")
            if not _targets(cfg, module):
                raise AdapterError(f"{adapter_dir}: {module}: weights for a module outside target_modules")
            group, i = slot_of[lm["name"]]
            k, outs = groups[group]
            n = outs[i][1]
            if a.shape[1] != k or b.shape[0] != n:
                raise AdapterError(
                    f"{adapter_dir}: {module}: A {a.shape} and B {b.shape} do not fit the base layer "
                    f"(in {k}, out {n})"
                )
            modules = kept[layer, group]
            (a_rows,), (b_rows,) = module_rows(tuple(outs[j] for j in modules), r_pad, (modules.index(i),))
            if group not in layers[layer]:
                layers[layer][group] = (np.zeros((len(modules) * r_pad, k), dtype),
                                        np.zeros((sum(outs[j][1] for j in modules), r_pad), dtype))
            ga, gb = layers[layer][group]
            ga[a_rows[0] : a_rows[0] + rank] = as_dtype(a, dtype)
            gb[b_rows[0] : b_rows[1], :rank] = as_dtype(scale * _float32(b), dtype)
            col, width = sum(m for _, m in outs[:i]), sum(m for _, m in outs)  # the column affine's: every column
            if "bias" in kinds:
                bias.setdefault((layer, group), np.zeros(width, np.float32))[col : col + n] = \
                    _vector(adapter_dir, module, "lora_B bias", kinds["bias"], n, scale)
            if "mag" in kinds:
                mag, mask = magnitude.setdefault((layer, group), (np.zeros(width, np.float32), np.zeros(width, bool)))
                mag[col : col + n] = _vector(adapter_dir, module, "magnitude", kinds["mag"], n)
                mask[col : col + n] = True
        else:
            raise AdapterError(f"{adapter_dir}: unknown module {_shown(module)} for a {config.model_type} model "
                               f"with {config.num_layers} layers")
        rank_used = max(rank_used, rank)
    embed_rows, lm_head_rows, added = _row_overrides(adapter_dir, config, parts, saved_dtype, saved_whole, trainable,
                                                     full_lora, base, max_extra_vocab)
    if lm_head_rows and ((None, "lm_head") in bias or (None, "lm_head") in magnitude):
        raise AdapterError(f"{adapter_dir}: lm_head rows that differ from the base model's together with a LoRA bias "
                           "or DoRA on the lm_head are not supported")
    if not any(k in ("A", "B", "saved", "tokens") for kinds in parts.values() for k in kinds):
        raise AdapterError(f"{adapter_dir}: adapter_model.safetensors holds no LoRA weights")
    return HostAdapter(rank=rank_used, layers=tuple(layers), embed=embed, lm_head=lm_head, bias=bias,
                       magnitude=magnitude, embed_rows=embed_rows, lm_head_rows=lm_head_rows, added=added,
                       rope_factor=_rope_factor(adapter_dir, cfg, config, max_seq_len),
                       slices={key: modules for key, modules in kept.items() if len(modules) < len(groups[key[1]][1])},
                       files=files)


_READ_ATTEMPTS = 3  # reads of an adapter's files that a writer may change before the read gives up


def _read_files(adapter_dir: str, limits: tuple[int, int],
                roots: Sequence[str]) -> tuple[str, dict, dict[str, np.ndarray], dict[str, str]]:
    """(`files_version`, the config, the tensors, their dtypes' names) of one state of the adapter's files: the
    files are read again when their version changed while they were read (a copy into place still being
    written), so that no read mixes two states, nor keeps an error that a half-written file gave.

    Raises:
      AdapterError: the files are invalid, or changed during each of `_READ_ATTEMPTS` reads.
    """
    for attempt in range(_READ_ATTEMPTS):
        if attempt:
            time.sleep(0.1 * attempt)  # a writer's time to finish
        files = files_version(adapter_dir)
        try:
            cfg = read_config(adapter_dir, roots)
            tensors, dtypes = _read_tensors(adapter_dir, limits, roots)
        except AdapterError:
            if files_version(adapter_dir) == files:
                raise
            continue
        if files_version(adapter_dir) == files:
            return files, cfg, tensors, dtypes
    raise AdapterError(f"{adapter_dir}: its files changed while they were read, {_READ_ATTEMPTS} times (a copy "
                       "still being written?); write an adapter elsewhere and rename it into place")


def files_version(adapter_dir: str) -> str:
    """The state of an adapter directory's files as a string: each file's device, inode, size, and modification
    and change times (links followed), so files rewritten or replaced since give another one. An adapter read
    again under one registration (after an eviction) whose files changed meanwhile holds other weights: what was
    computed with the old ones (a cached prompt prefix) must not be reused with them."""
    stamps = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            st = os.stat(os.path.join(adapter_dir, name))
        except OSError:  # missing: the read that follows says so
            stamps.append("-")
        else:
            stamps.append(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}")
    return "/".join(stamps)


def _vector(adapter_dir: str, module: str, what: str, value: np.ndarray, n: int, scale: float = 1.0) -> np.ndarray:
    """A per-output-column vector of a module ([n]), checked and scaled."""
    if value.shape != (n,):
        raise AdapterError(f"{adapter_dir}: {module}: {what} has shape {value.shape}; the layer has {n} outputs")
    return scale * value


def _row_overrides(adapter_dir, config, parts, saved_dtype, saved_whole, trainable, full_lora, base,
                   max_extra_vocab) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], int]:
    """(embedding rows, lm_head rows, added tokens): every row of the adapter's embedding layers that differs
    from the base model's or lies past its vocabulary, with the layer's LoRA folded in (so the row replaces
    the whole output for that token), from saved embedding layers, modules_to_save copies and trainable tokens."""
    v, h = config.vocab_size, config.hidden_size
    weights: dict[str, np.ndarray] = {}  # module -> its [V', H] weights as the adapter has them
    for module in EMBEDDING_MODULES:
        kinds = parts.get(module, {})
        if "saved" in kinds:
            w = kinds["saved"]
            if w.ndim != 2 or w.shape[1] != h or w.shape[0] < v:
                raise AdapterError(f"{adapter_dir}: {module}: saved weights {w.shape}; the base model has {(v, h)}")
            if w.shape[0] - v > max_extra_vocab:
                raise AdapterError(f"{adapter_dir}: {module}: {w.shape[0] - v} tokens past the base vocabulary of {v}; "
                                   f"the engine allows max_extra_vocab={max_extra_vocab}")
            if module == "lm_head" and config.tie_word_embeddings:
                raise AdapterError(f"{adapter_dir}: lm_head weights of its own on a model with tied embeddings")
            if module == "model.embed_tokens" and config.tie_word_embeddings and "embed_tokens" in saved_whole:
                raise AdapterError(f"{adapter_dir}: modules_to_save of a tied embedding (embed_tokens) is not supported")
            weights[module] = w
        if module in trainable:
            ids, delta = trainable[module], kinds.get("tokens")
            if delta is None or delta.shape != (len(ids), h):
                raise AdapterError(f"{adapter_dir}: {module}: {len(ids)} trainable_token_indices need a "
                                   f"trainable_tokens_delta of shape {(len(ids), h)}, found "
                                   f"{None if delta is None else delta.shape}")
            if module in full_lora:
                raise AdapterError(f"{adapter_dir}: {module}: trainable tokens on a layer LoRA also targets")
            if not all(0 <= t < v for t in ids):
                raise AdapterError(f"{adapter_dir}: trainable_token_indices outside the vocabulary [0, {v})")
        elif "tokens" in kinds:
            raise AdapterError(f"{adapter_dir}: {module}: trainable_tokens_delta but no trainable_token_indices")
    for module, (a, b) in full_lora.items():  # a LoRA over added tokens needs the layer's rows for them
        rows_of_lora = a.shape[1] if module == "model.embed_tokens" else b.shape[0]
        has_rows = module in weights or (module == "lm_head" and config.tie_word_embeddings
                                         and "model.embed_tokens" in weights)
        if rows_of_lora > v and not has_rows:
            raise AdapterError(f"{adapter_dir}: {module}: its LoRA covers {rows_of_lora} tokens but the adapter "
                               f"saves no {module} weights for those past the base vocabulary of {v}")
        if has_rows and rows_of_lora != weights.get(module, weights.get("model.embed_tokens")).shape[0]:
            raise AdapterError(f"{adapter_dir}: {module}: its LoRA covers {rows_of_lora} tokens but its saved "
                               "weights another number")
    if not weights and not trainable:
        return {}, {}, 0
    if base is None:
        raise BaseRowsNeeded(f"{adapter_dir}: carries embedding rows, but the base model's are not at hand")
    rows: dict[str, dict[int, np.ndarray]] = {}
    vocab = {}
    for module in EMBEDDING_MODULES:
        tied_lm = module == "lm_head" and config.tie_word_embeddings
        source = "model.embed_tokens" if tied_lm else module
        if source not in weights and source not in trainable:
            continue
        original = base.embedding() if module == "model.embed_tokens" else base.lm_head()
        w = weights.get(source)
        changed = set()
        if w is None:
            w = original
        else:
            same = _same_as_saved(original, saved_dtype[source]) == w[:v]
            changed = set(np.flatnonzero(~same.all(axis=1)).tolist()) | set(range(v, w.shape[0]))
        if source in trainable:  # the delta is the rows' new values (PEFT copies it over the weights)
            w = w.copy()
            w[trainable[source]] = parts[source]["tokens"]
            changed |= set(trainable[source])
        vocab[module] = w.shape[0]
        out = {}
        for t in sorted(changed):
            row = w[t].astype(np.float32)
            if module in full_lora:  # the layer's LoRA at this token, folded in (the row replaces the output)
                a, b = full_lora[module]
                row = row + (b @ a[:, t] if module == "model.embed_tokens" else b[t] @ a)
            out[t] = row
        if len(out) > max_extra_vocab:
            raise AdapterError(f"{adapter_dir}: {module}: {len(out)} rows differ from the base model's; the engine "
                               f"holds up to max_extra_vocab={max_extra_vocab} per adapter")
        rows[module] = out
    if len(set(vocab.values())) > 1:
        raise AdapterError(f"{adapter_dir}: the embedding and lm_head have different vocabularies {vocab}")
    added = max(vocab.values(), default=v) - v
    return rows.get("model.embed_tokens", {}), rows.get("lm_head", {}), added


def _rope_factor(adapter_dir: str, cfg: dict, config: ModelConfig, max_seq_len: int | None) -> float:
    """LongLoRA (vLLM's convention): `context_length` in adapter_config.json runs the adapter's tokens with linear
    RoPE scaling by ceil(context_length / max_position_embeddings)."""
    context = cfg.get("context_length")
    if context is None:
        return 1.0
    if config.max_position_embeddings is None:
        raise AdapterError(f"{adapter_dir}: context_length (LongLoRA) needs the base model's max_position_embeddings")
    if max_seq_len is not None and context > max_seq_len:
        raise AdapterError(f"{adapter_dir}: context_length {context} exceeds the engine's max_seq_len {max_seq_len}; "
                           f"start the engine with max_seq_len >= {context} to serve it")
    return float(math.ceil(context / config.max_position_embeddings))
