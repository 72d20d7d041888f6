"""The public multi-LoRA ops, their argument checks and backend dispatch.

Semantics shared by every backend: token t with slot s >= 0 gets, per slice i,
`scalings[s] * (x[t] @ A[s, i*R : i*R + r_s]ᵀ) @ B[s, slice_i, :r_s]ᵀ` added to `base[t, slice_i]`; slot -1
tokens keep `base[t]`. `lora_expand` and `lora_linear` take an optional per-slot column affine, `scale` and
`shift` [L, N]: a token of slot s >= 0 then gets `scale[s] * (base + delta) + shift[s]` (LoRA bias, DoRA).
Rows and columns of a slot beyond its rank `r_s` contribute nothing, and a slot's
weights reach only its own tokens, whatever values they hold (NaN and inf included: every backend selects
rather than multiplies by zero). One exception: the pallas expand reads B in 16-column chunks up to the rank,
so B's columns past the rank inside its last chunk must be finite (the adapter pool stores zeros there).

Backends: "reference" (contractions over slots), "ragged" (`jax.lax.ragged_dot`), "gather" (Punica's BGMV in
plain jnp: each token reads its own slot's weights inside one fused XLA reduction), "pallas" (the segmented
kernels in `jlora.pallas`; on CPU they run in interpret mode) and "auto": on GPU, gather for calls of
fewer than `PALLAS_MIN_TOKENS` tokens whose tokens x max rank is at most `GATHER_MAX_TOKEN_RANK` (small decode
steps) and pallas for the rest; reference elsewhere.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from jlora import pallas, reference
from jlora.batch_info import LoRABatchInfo, host_values

__all__ = ["Backend", "BACKENDS", "GATHER_MAX_TOKEN_RANK", "PALLAS_MIN_TOKENS", "lora_shrink", "lora_expand",
           "lora_linear", "lora_embedding", "resolve_backend"]

Backend = Literal["auto", "reference", "ragged", "gather", "pallas"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "ragged", "gather", "pallas")
# "auto" runs a call through "gather" on GPU when it has fewer than PALLAS_MIN_TOKENS tokens and T x R (tokens
# x the weight stack's max rank) is at most GATHER_MAX_TOKEN_RANK. Each token reads its own slot's weights, so
# gather's reads grow with T·R; the segmented kernels read each used slot once but pay a chain of dependent
# loads per launch. In the 8B decode step on an H200 (the pallas expand's add deferred, running beside the
# base GEMMs) gather wins at batch 8 and 16 with r=16 and at batch 8 with r=64, pallas at batch 32 with r=16
# unless every token has its own adapter, and at T·R = 1024 (docs/kernels.md, "Why auto switches where it does").
GATHER_MAX_TOKEN_RANK = 512
PALLAS_MIN_TOKENS = 32
# The plain-jnp backends' implementations (pallas dispatches to jlora.pallas).
_JNP_SHRINK = {"reference": reference.shrink_reference, "ragged": reference.shrink_ragged,
               "gather": reference.shrink_gather}
_JNP_EXPAND = {"reference": reference.expand_reference, "ragged": reference.expand_ragged,
               "gather": reference.expand_gather}


def resolve_backend(backend: str, num_tokens: int | None = None, rank: int | None = None) -> str:
    """The backend that runs a call of `num_tokens` tokens on weights of max rank `rank`: "auto" is gather
    (T < PALLAS_MIN_TOKENS and T·R <= GATHER_MAX_TOKEN_RANK) or pallas on GPU, and reference elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    if jax.default_backend() != "gpu":
        return "reference"
    small = (num_tokens is not None and rank is not None and num_tokens < PALLAS_MIN_TOKENS
             and num_tokens * rank <= GATHER_MAX_TOKEN_RANK)
    return "gather" if small else "pallas"


def _check_info(info: LoRABatchInfo, num_tokens: int, num_slots: int, max_rank: int, what: str) -> None:
    """Checks `info` against T and the weight stack's L and R; values only when not traced."""
    if not isinstance(info, LoRABatchInfo):
        raise TypeError(f"info must be a LoRABatchInfo, got {type(info).__name__}")
    if info.num_tokens != num_tokens:
        raise ValueError(f"info is built for T={info.num_tokens} tokens but {what} has {num_tokens} rows")
    if info.num_slots != num_slots:
        raise ValueError(f"info has L={info.num_slots} slots but the weight stack {what} has {num_slots}")
    if (ranks := host_values(info.ranks)) is not None and (top := int(ranks.max())) > max_rank:
        raise ValueError(f"adapter rank {top} exceeds the weight stack's max rank R={max_rank}")
    if (slots := host_values(info.token_slot)) is not None and (top := int(slots.max())) >= num_slots:
        raise ValueError(f"slot id {top} >= number of slots L={num_slots}")


def _check_float(name: str, arr: jax.Array, ndim: int) -> None:
    if not hasattr(arr, "shape") or arr.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {getattr(arr, 'shape', None)}")
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {arr.dtype}")


def _check_same_dtype(**arrays: jax.Array) -> None:
    dtypes = {name: a.dtype for name, a in arrays.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"dtype mismatch: {', '.join(f'{n}={d}' for n, d in dtypes.items())}")


def _check_shrink(x: jax.Array, a: jax.Array, info: LoRABatchInfo, num_slices: int) -> int:
    """Checks shrink arguments; returns R."""
    _check_float("x", x, 2)
    _check_float("A", a, 3)
    _check_same_dtype(x=x, A=a)
    if not isinstance(num_slices, int) or num_slices < 1:
        raise ValueError(f"num_slices must be a positive int, got {num_slices!r}")
    if a.shape[2] != x.shape[1]:
        raise ValueError(f"A {a.shape} has input dim K={a.shape[2]} but x {x.shape} has K={x.shape[1]}")
    if a.shape[1] % num_slices:
        raise ValueError(f"A's dim 1 ({a.shape[1]}) is not num_slices ({num_slices}) x max rank")
    rank = a.shape[1] // num_slices
    _check_info(info, x.shape[0], a.shape[0], rank, "A")
    return rank


def _check_expand(
    s: jax.Array, b: jax.Array, info: LoRABatchInfo, base: jax.Array, slice_sizes: tuple[int, ...]
) -> None:
    _check_float("s", s, 2)
    _check_float("B", b, 3)
    _check_float("base", base, 2)
    _check_same_dtype(s=s, B=b, base=base)
    if not slice_sizes or not all(isinstance(n, int) and n > 0 for n in slice_sizes):
        raise ValueError(f"slice_sizes must be a non-empty tuple of positive ints, got {slice_sizes!r}")
    n_total, rank = b.shape[1], b.shape[2]
    if sum(slice_sizes) != n_total:
        raise ValueError(f"slice_sizes {slice_sizes} sum to {sum(slice_sizes)} but B {b.shape} has N={n_total}")
    if base.shape != (s.shape[0], n_total):
        raise ValueError(f"base {base.shape} must be [T, N] = {(s.shape[0], n_total)} (s {s.shape}, B {b.shape})")
    if s.shape[1] != len(slice_sizes) * rank:
        raise ValueError(
            f"s {s.shape} must have {len(slice_sizes)} slices x R={rank} = {len(slice_sizes) * rank} columns"
        )
    _check_info(info, s.shape[0], b.shape[0], rank, "B")


def _check_affine(b: jax.Array, **affine: jax.Array | None) -> None:
    """scale / shift: None or floating [L, N] matching B [L, N, R]."""
    for name, arr in affine.items():
        if arr is None:
            continue
        _check_float(name, arr, 2)
        if arr.shape != b.shape[:2]:
            raise ValueError(f"{name} {arr.shape} must be [L, N] = {b.shape[:2]} (B {b.shape})")


def lora_shrink(
    x: jax.Array, a: jax.Array, info: LoRABatchInfo, *, num_slices: int = 1, backend: Backend = "auto"
) -> jax.Array:
    """The LoRA A side: per token, its slot's scaled down-projection.

    Args:
      x: [T, K] activations.
      a: [L, S·R, K] stacked A weights (PEFT's `lora_A.weight` [r, K] per slice, zero-padded to R rows).
      info: the batch's `LoRABatchInfo` (T tokens, L slots).
      num_slices: S, the number of fused projections sharing x (3 for q|k|v).
      backend: "auto", "reference", "ragged", "gather" or "pallas".

    Returns:
      [T, S·R] in x.dtype: `scalings[slot] * x @ A[slot]ᵀ`, columns at or beyond the slot's rank 0,
      rows of slot -1 tokens 0.
    """
    _check_shrink(x, a, info, num_slices)
    return _shrink(x, a, info, num_slices=num_slices,
                   backend=resolve_backend(backend, x.shape[0], a.shape[1] // num_slices))


@functools.partial(jax.jit, static_argnames=("num_slices", "backend"))
def _shrink(x, a, info, *, num_slices, backend):
    if backend == "pallas":
        return pallas.shrink(x, a, info, num_slices=num_slices)
    return _JNP_SHRINK[backend](x, a, info, num_slices=num_slices)


def lora_expand(
    s: jax.Array,
    b: jax.Array,
    info: LoRABatchInfo,
    base: jax.Array,
    *,
    slice_sizes: tuple[int, ...],
    backend: Backend = "auto",
    scale: jax.Array | None = None,
    shift: jax.Array | None = None,
) -> jax.Array:
    """The LoRA B side: adds each token's slot's up-projection of `s` to `base`, slice by slice.

    Args:
      s: [T, S·R] shrink output (already scaled).
      b: [L, N, R] stacked B weights (PEFT's `lora_B.weight` [n_i, r] per slice, stacked along N,
        zero-padded to R columns).
      info: the batch's `LoRABatchInfo`.
      base: [T, N] base-layer output.
      slice_sizes: static output widths (n_1, ..., n_S), summing to N; e.g. (4096, 1024, 1024) for q|k|v.
      backend: "auto", "reference", "ragged", "gather" or "pallas".
      scale, shift: optional [L, N] per-slot column affine (see the module docstring); None costs nothing.

    Returns:
      [T, N] in base.dtype: `base + s_i @ B[slot, slice_i, :rank]ᵀ` per slice (then the affine); slot -1 rows
      equal `base`. The pallas backend adds in place into `base`'s buffer when `base` is donated or an
      intermediate.
    """
    slice_sizes = tuple(slice_sizes)
    _check_expand(s, b, info, base, slice_sizes)
    _check_affine(b, scale=scale, shift=shift)
    return _expand(s, b, info, base, scale, shift, slice_sizes=slice_sizes,
                   backend=resolve_backend(backend, s.shape[0], b.shape[2]))


@functools.partial(jax.jit, static_argnames=("slice_sizes", "backend"))
def _expand(s, b, info, base, scale=None, shift=None, *, slice_sizes, backend):
    if backend == "pallas":
        return pallas.expand(s, b, info, base, slice_sizes=slice_sizes, scale=scale, shift=shift)
    return _JNP_EXPAND[backend](s, b, info, base, slice_sizes=slice_sizes, scale=scale, shift=shift)


def lora_linear(
    x: jax.Array,
    base: jax.Array,
    a: jax.Array,
    b: jax.Array,
    info: LoRABatchInfo,
    *,
    slice_sizes: tuple[int, ...],
    backend: Backend = "auto",
    scale: jax.Array | None = None,
    shift: jax.Array | None = None,
    defer_add: bool = False,
) -> jax.Array:
    """A (fused) linear layer's LoRA: `lora_expand(lora_shrink(x), ...)`, the one call layers make.

    Args:
      x: [T, K] layer input.
      base: [T, N] base-layer output, N = sum(slice_sizes).
      a: [L, S·R, K] and b: [L, N, R] stacked weights, S = len(slice_sizes).
      info: the batch's `LoRABatchInfo`.
      slice_sizes: static output widths of the fused projections, e.g. (q, k, v) or (gate, up).
      backend: "auto", "reference", "ragged", "gather" or "pallas".
      scale, shift: optional [L, N] per-slot column affine (see the module docstring).
      defer_add: the pallas backend at decode sizes (T <= 256) writes the delta to a buffer of its own,
        rounded to base.dtype as PEFT rounds its LoRA output, and XLA adds it to `base`, instead of adding it
        into base's buffer. The expand then need not wait for `base`: inside a jitted step it runs beside the
        GEMM that makes `base`, and XLA fuses the add into the kernel that reads the sum. A call on its own
        pays one more pass over [T, N]. The model passes True; other backends add so already or ignore it.

    Returns:
      [T, N] in base.dtype, base plus each token's adapter delta (then the affine).
    """
    slice_sizes = tuple(slice_sizes)
    _check_shrink(x, a, info, len(slice_sizes))
    if x.shape[0] != base.shape[0]:
        raise ValueError(f"x {x.shape} and base {base.shape} must have the same number of tokens")
    _check_expand(jax.ShapeDtypeStruct((x.shape[0], a.shape[1]), x.dtype), b, info, base, slice_sizes)
    if a.shape[1] // len(slice_sizes) != b.shape[2]:
        raise ValueError(f"A {a.shape} and B {b.shape} disagree on the max rank R")
    _check_affine(b, scale=scale, shift=shift)
    return _linear(x, base, a, b, info, scale, shift, slice_sizes=slice_sizes,
                   backend=resolve_backend(backend, x.shape[0], b.shape[2]), defer_add=bool(defer_add))


@functools.partial(jax.jit, static_argnames=("slice_sizes", "backend", "defer_add"))
def _linear(x, base, a, b, info, scale=None, shift=None, *, slice_sizes, backend, defer_add=False):
    if backend == "pallas":
        return pallas.linear(x, base, a, b, info, slice_sizes=slice_sizes, scale=scale, shift=shift,
                             defer_add=defer_add)
    s = _shrink(x, a, info, num_slices=len(slice_sizes), backend=backend)
    return _expand(s, b, info, base, scale, shift, slice_sizes=slice_sizes, backend=backend)


def lora_embedding(
    token_ids: jax.Array,
    a_emb: jax.Array,
    b_emb: jax.Array,
    info: LoRABatchInfo,
    base: jax.Array,
    *,
    backend: Backend = "auto",
) -> jax.Array:
    """Embedding LoRA: adds `scaling · B_emb[slot] @ A_emb[slot, :, token_id]` to the base embedding.

    Args:
      token_ids: [T] int token ids.
      a_emb: [L, R, V] stacked `lora_embedding_A` (PEFT's [r, V]), zero-padded to R rows.
      b_emb: [L, H, R] stacked `lora_embedding_B` (PEFT's [H, r]), zero-padded to R columns.
      info: the batch's `LoRABatchInfo`.
      base: [T, H] base embeddings of `token_ids`.
      backend: "auto", "reference", "ragged", "gather" or "pallas" (the A side is a gather in every backend).

    Returns:
      [T, H] in base.dtype.
    """
    if not hasattr(token_ids, "shape") or token_ids.ndim != 1 or not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be a 1-D int array, got {getattr(token_ids, 'dtype', None)} "
                         f"{getattr(token_ids, 'shape', None)}")
    _check_float("A_emb", a_emb, 3)
    if a_emb.shape[:2] != (b_emb.shape[0], b_emb.shape[2]):
        raise ValueError(f"A_emb {a_emb.shape} must be [L, R, V] to match B_emb {b_emb.shape} [L, H, R]")
    if token_ids.shape[0] != base.shape[0]:
        raise ValueError(f"token_ids {token_ids.shape} and base {base.shape} must have the same T")
    _check_same_dtype(A_emb=a_emb, B_emb=b_emb, base=base)
    s_spec = jax.ShapeDtypeStruct((base.shape[0], b_emb.shape[2]), base.dtype)
    _check_expand(s_spec, b_emb, info, base, (b_emb.shape[1],))
    return _embedding(token_ids, a_emb, b_emb, info, base,
                      backend=resolve_backend(backend, base.shape[0], b_emb.shape[2]))


@functools.partial(jax.jit, static_argnames=("backend",))
def _embedding(token_ids, a_emb, b_emb, info, base, *, backend):
    # The A side of an embedding LoRA is a lookup: row `token_id` of Aᵀ, scaled and rank-masked.
    slot = jnp.maximum(info.token_slot, 0)
    rows = a_emb[slot, :, jnp.clip(token_ids, 0, a_emb.shape[2] - 1)]  # [T, R]
    s = reference.scale_rows(rows.astype(jnp.float32), info, a_emb.shape[1], 1).astype(base.dtype)
    return _expand(s, b_emb, info, base, slice_sizes=(b_emb.shape[1],), backend=backend)
