"""A Flax NNX decoder-only transformer of the Llama family (llama, mistral, qwen2) with multi-LoRA.

Every projection adds its LoRA through `jlora.lora_linear` with the batch's `LoRABatchInfo`, passed
explicitly from the top: q|k|v as one 3-slice call, o, gate|up as one 2-slice call, down; the embedding
through `lora_embedding`; lm_head as a one-slice linear. Tokens are laid out [B, S] (B requests of S
positions); the projections see them flattened to [T = B·S, ·], the token order of the batch info.

The KV cache is paged, with static shapes: per layer [blocks, kv_heads, P, head_dim] (heads before positions:
the layout the attention contractions read, so XLA never transposes the cache). A request's block table lists
its blocks in position order: position p is at offset p % P of block table[p // P]. With one block per
request of P = max_seq positions (a group without tables: request b's block is b) this is a contiguous cache
of rows. Prefill (S = prompt bucket) and decode (S = 1) are the same function, and a query at position p
attends to positions <= p. A call may carry two groups of requests (`Group`, e.g. every row's decode token,
then prompt pieces into other rows) whose tokens go through the projections together. Decode groups (S = 1)
on GPU (or under an explicit "pallas" backend) run attention in a Pallas kernel
(`jlora.pallas.decode_attention`, through the block tables when a request has several), which reads each
request's positions only up to its own, and which also rotates q and k by RoPE and writes the cache
(`rope_in_attention`); everything else uses XLA's masked contractions over the blocks a group's tables name.
Where that kernel runs, the norms run in a Pallas kernel too (`jlora.pallas.rms_norm`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jlora.batch_info import LoRABatchInfo
from jlora.models.config import ModelConfig
from jlora.models.lora_weights import LayerLoRA, LoRAWeights, RowOverrides
from jlora.ops import lora_embedding, lora_linear, lora_shrink, resolve_backend
from jlora.pallas.config import by_device, delta_expand
from jlora.pallas.decode_attention import (NewToken, decode_attention, decode_attention_supported,
                                           paged_decode_attention)
from jlora.pallas.projections import matmul, matmul_add, matmul_supported
from jlora.pallas.rms_norm import add_rms_norm, rms_norm, rms_norm_supported
from jlora.precision import dot_precision

__all__ = ["Batch", "CallOptions", "Group", "KVCache", "LoRAInput", "Transformer", "rope_frequencies"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values, one buffer per layer, so a donated cache is updated in place layer by layer (one
    stacked [layers, ...] array would be rebuilt, i.e. copied whole, on every step)."""

    k: tuple[jax.Array, ...]  # per layer [blocks, kv_heads, block_size, head_dim]
    v: tuple[jax.Array, ...]  # per layer [blocks, kv_heads, block_size, head_dim]

    @staticmethod
    def zeros(config: ModelConfig, blocks: int, block_size: int, dtype) -> KVCache:
        shape = (blocks, config.num_kv_heads, block_size, config.head_dim)
        layers = range(config.num_layers)
        return KVCache(tuple(jnp.zeros(shape, dtype) for _ in layers), tuple(jnp.zeros(shape, dtype) for _ in layers))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tokens", "positions", "valid", "rows", "tables"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Group:
    """B requests of S tokens each of a `Batch`: tokens, positions and valid [B, S] (valid None: all); each
    request's row of the engine's batch [B] (None: row b; the model does not read it) and its block table
    [B, nb] (None: request b's positions are all in block b): position p of request b is at offset p % P of
    block tables[b, p // P], P the cache's block size."""

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array | None = None
    rows: jax.Array | None = None
    tables: jax.Array | None = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["groups", "logits_at"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Batch:
    """What a model call runs: one or two groups of requests, whose tokens go through the projections one
    after another (the engine's mixed steps: every row's decode token, then prompt pieces into other rows),
    and `logits_at` [N], indices into the call's tokens (all groups, flat) whose logits are computed (None:
    every token's; needed with two groups)."""

    groups: tuple[Group, ...]
    logits_at: jax.Array | None = None

    @staticmethod
    def of(tokens, positions, valid=None, tables=None, logits_at=None) -> Batch:
        """A batch of one group."""
        return Batch((Group(tokens, positions, valid, tables=tables),), logits_at)

    @property
    def tokens(self) -> jax.Array:
        """[T] every group's tokens, flat, in the call's token order."""
        flat = [g.tokens.reshape(-1) for g in self.groups]
        return flat[0] if len(flat) == 1 else jnp.concatenate(flat)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weights", "info", "head_info"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LoRAInput:
    """A call's adapters: the slots' weights, the `LoRABatchInfo` of its T tokens and, with `logits_at`, that
    of those N tokens (`head_info`, for the lm_head)."""

    weights: LoRAWeights
    info: LoRABatchInfo
    head_info: LoRABatchInfo | None = None


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """A call's static options.

    Attributes:
      backend: the LoRA ops' backend; on GPU (and under an explicit "pallas") decode groups (S = 1) also run
        attention in the Pallas decode-attention kernel.
      reduce_axis: under tensor parallelism (inside `shard_map`), the mesh axis that o and down are
        row-parallel over (`jlora.parallel`); None on one device.
      base_first: put each layer's base GEMMs before their LoRA kernels in XLA's schedule (an optimization
        barrier on the GEMM's output and x; `base_first_projection` says which) where those run in XLA
        (gather). Under CONCURRENT CUDA graphs (which `jlora.step_compiler_options` asks for decode steps; the
        engine sets this for them) the first node after a fork keeps the graph's stream, and left to itself XLA
        scheduled the LoRA shrink first, so the GEMM started late on a second stream. The barrier orders
        nothing at run time: the LoRA kernels still run beside the GEMM. Calls on the Pallas kernels keep none:
        the barrier held their deferred expand until the GEMM ended (1-3.6 % slower steps). The lm_head keeps
        none (its split-K GEMM ends in a reduction XLA fuses into the consumer, which a barrier would split
        off). Off by default: under XLA's default graphs it costs 1-4 %. Evidence: docs/performance.md.
      attention_chunk: split the Pallas decode attention over chunks of this many positions too
        (`jlora.pallas.decode_attention`; None: unsplit). It changes the rounding, so an engine fixes it once
        (`EngineConfig.attention_chunk`), never per call.
    """

    backend: str = "auto"
    reduce_axis: str | None = None
    base_first: bool = False
    attention_chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class _Part:
    """One group as the attention layers see it: its shape, positions, its tokens' rotation (cos and sin [B, S, D]
    f32, `_rotation`), which tokens write the cache, its block tables [B, nb] (`own_block`: request b's is block
    b, the cache's blocks in request order), whether decode attention runs in a Pallas kernel (which then also
    rotates q and k and writes the cache) and the chunk of positions that kernel is split over (None: unsplit)."""

    b: int
    s: int
    positions: jax.Array
    cos: jax.Array
    sin: jax.Array
    valid: jax.Array
    tables: jax.Array
    own_block: bool
    kernel: bool
    chunk: int | None


@dataclasses.dataclass(frozen=True)
class _Context:
    """What every layer of a call reads: its groups as `_Part`s, the adapters (None: the base model alone), the
    options and whether the norms run in the Pallas kernel."""

    parts: tuple[_Part, ...]
    lora: LoRAInput | None
    options: CallOptions
    norm_kernel: bool
    add_in_norm: bool  # the residual adds too (`residual_add_in_norm`)
    gemm_kernels: bool  # q|k|v, o and down may run in the Pallas kernels (`projections_in_kernel`, `_in_kernel`)


def rope_frequencies(config: ModelConfig) -> jax.Array:
    """[head_dim / 2] f32 inverse frequencies, with Llama-3 scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if config.rope_llama3 is None:
        return inv
    factor, low, high, original = config.rope_llama3
    wavelen = 2 * jnp.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    scaled = jnp.where(wavelen > original / low, inv / factor, inv)  # long wavelengths: divided by factor
    mid = (wavelen <= original / low) & (wavelen >= original / high)
    return jnp.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def _rotation(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, S, D] f32 of RoPE at positions [B, S] (the D/2 angles twice, HF's rotate-half convention)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, S, D/2]
    return jnp.cos(jnp.concatenate([angles, angles], -1)), jnp.sin(jnp.concatenate([angles, angles], -1))


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, heads, D] rotated by `_rotation`'s cos and sin [B, S, D]: x·cos + rotate_half(x)·sin in f32, rounded
    to x's dtype (the Pallas decode attention rotates in-kernel with these operations)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def project(x: jax.Array, w: jax.Array, out_in: bool, one_token_reduction: bool = True) -> jax.Array:
    """x [T, K] times a weight: [T, N] f32. w is [K, N], or with `out_in` [N, K] (HF's layout), where a call of
    one token (T = 1, a batch-1 decode step) sums its products along w's contiguous rows with
    `one_token_reduction`: a row reduction, which XLA reads at up to 4.4 TB/s on an H200 where its GEMM reads a
    batch-1 [K, N] weight at 2.6-4.0 (`bench/studies/weight_layout.py`). Products and sums are f32 either way,
    as the GEMM accumulates."""
    if not out_in:
        return jnp.einsum("TK,KN->TN", x, w, preferred_element_type=jnp.float32, precision=dot_precision(x.dtype))
    if x.shape[0] == 1 and one_token_reduction:
        return jnp.sum(x.astype(jnp.float32) * w.astype(jnp.float32), axis=1)[None]
    return jnp.einsum("TK,NK->TN", x, w, preferred_element_type=jnp.float32, precision=dot_precision(x.dtype))


def residual_add_in_norm(config: ModelConfig, tokens: int) -> bool:
    """Whether a call of `tokens` tokens runs each residual add in the norms' kernel after it (`add_rms_norm`,
    where the norms run in the Pallas kernel): where its projections are row reductions (`project` at one token
    over [out, in]), which leave each add a kernel of its own. XLA's GEMMs take the add into the kernel that
    sums their split-K partials, so elsewhere the add stays there (docs/performance.md § The model step)."""
    return config.weights_out_in and tokens == 1


# The call sizes (least, most tokens) at which the projections' kernels beat XLA's split-K GEMM and sum in the 8B
# decode step, by the device kind's name: an H200's faster memory keeps XLA's pair the faster at 32 rows and below
# (docs/performance.md § The model step, *On an H200 with the rows masked*: measured at 32, 36, 40, 48, 56 and 64);
# other kinds 16-64 (the H100's range, measured at 16, 24, 32, 40, 48 and 64).
KERNEL_TOKENS = {"H200": (36, 64)}


def projections_in_kernel(tokens: int) -> bool:
    """Whether a call of `tokens` tokens on one device, where the model's Pallas kernels run, computes its
    `projection_kernel` projections that have no LoRA in it in one Pallas kernel each, K unsplit (`matmul`, and
    `matmul_add` with the residual add after o and down): at the device's `KERNEL_TOKENS`, where XLA's split-K
    GEMM and its sum (with the add) in a second kernel were the slower (1.6-6.5 % of an H100's 8B decode step at
    16-64 tokens, 2.9-4.5 % of an H200's at 36-64)."""
    low, high = by_device(KERNEL_TOKENS, (16, 64))
    return low <= tokens <= high


def projection_kernel(name: str) -> bool:
    """Whether projection `name` runs in the Pallas kernel where `projections_in_kernel`: q|k|v, o and down;
    gate|up keeps XLA's GEMM, which reads its 235 MB near the copy bandwidth where the kernel was 8 µs slower
    (`bench/studies/small_gemm.py --residual`, an H100)."""
    return name in ("qkv", "o", "down")


def _has_lora(ctx: _Context, group: LayerLoRA | None, name: str) -> bool:
    """Whether projection `name` has LoRA in this call (a group no loaded adapter targets is left out)."""
    return ctx.lora is not None and name in group.a


def _in_kernel(proj: Linear, ctx: _Context, group: LayerLoRA | None, name: str) -> bool:
    """Whether projection `name` of this call runs in `matmul` / `matmul_add`: the call's `gemm_kernels`, the
    projection's `projection_kernel`, no LoRA on it in the call, no bias, and a weight [in, out] of a dtype and
    shape the kernel takes. With LoRA its delta is added before the residual, as PEFT adds it, and the delta's add
    took the place of XLA's split-K sum: the kernel beside the LoRA kernels was no faster (docs/performance.md §
    The model step, *A projection with LoRA over the projections' kernel*)."""
    w = proj.weight[...]
    return (ctx.gemm_kernels and projection_kernel(name) and not _has_lora(ctx, group, name) and proj.bias is None
            and not proj.out_in and matmul_supported(w.dtype, *w.shape))


def rope_in_attention(qkv_delta_apart: bool) -> bool:
    """Whether a decode part whose attention runs in the Pallas kernel hands it its q|k|v before RoPE (a
    `NewToken`), so the kernel rotates q and k and writes the cache: XLA ran those as five small kernels a layer
    and copied the slices of q|k|v (2.3 % of an H200's batch-1 step, 0.6-1.8 % at batch 8-32). Not where the
    Pallas LoRA kernels wrote the q|k|v delta `qkv_delta_apart` for XLA to add into its consumer (`defer_add`):
    before the kernel that add is a kernel of its own (a batch-32 step with one adapter 2.1 % slower). Evidence:
    docs/performance.md § The model step, *RoPE and the cache write in the attention kernel*."""
    return not qkv_delta_apart


class Linear(nnx.Module):
    """y = x @ W (+ bias): the weight [in, out] (HF's [out, in] transposed at load), or with `out_in` [out, in]
    as HF stores it (`ModelConfig.weights_out_in`, see `project`)."""

    def __init__(self, din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs, out_in: bool = False):
        self.out_in = out_in
        self.weight = nnx.Param(jnp.zeros((dout, din) if out_in else (din, dout), dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = project(x, self.weight[...], self.out_in)
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype)


def base_first_projection(name: str, reductions: bool) -> bool:
    """Whether projection `name`'s base op goes before its LoRA kernels in XLA's schedule under the call's
    `base_first` (`CallOptions`): every GEMM's, and none where the projections are row reductions (`project` at
    one token over [out, in]). Left to XLA, the other GEMMs ran on side streams beside the LoRA reductions and
    slowed there: the barrier at every projection made an H200's batch-8 step with adapters 11-14 % faster, batch
    16's 4-11 %, batch 32's on the gather backend 1-3 % and batch 4's level. Over reductions it held gate|up's
    LoRA until that reduction ended: the batch-1 step was 1.0-1.6 % faster with none and 4 % slower with every
    projection's (docs/performance.md § The model step, *The base op before its LoRA at every projection*)."""
    del name  # one rule for every projection; the name is the seam bench/studies patch by
    return not reductions


def _with_lora(proj: Linear, x: jax.Array, ctx: _Context, group: LayerLoRA | None, name: str,
               slice_sizes: tuple[int, ...], row_parallel: bool = False) -> jax.Array:
    """The projection's output [T, N], plus its adapters' deltas when LoRA is on; the base output in `matmul`
    where `_in_kernel`.

    `row_parallel` (o and down): under tensor parallelism (the options' `reduce_axis`) x, the weight's input
    rows and A's input columns are this device's shard. The expand is linear in the shrink, so each device expands its
    partial [T, R] shrink (B is replicated) into its partial output, and the layer's one all-reduce sums
    base and deltas together: LoRA adds no collective. Under the context's `base_first`, the base GEMM of a
    `base_first_projection` goes before the LoRA kernels in XLA's schedule (see `CallOptions`).
    """
    lora, options = ctx.lora, ctx.options
    reduce_axis = options.reduce_axis if row_parallel else None
    out = matmul(x, proj.weight[...]) if _in_kernel(proj, ctx, group, name) else proj(x)
    if _has_lora(ctx, group, name):
        if (options.base_first and base_first_projection(name, proj.out_in and x.shape[0] == 1)
                and resolve_backend(options.backend, x.shape[0], group.b[name].shape[2]) != "pallas"):
            out, x = jax.lax.optimization_barrier((out, x))
        scale = None if group.scale is None else group.scale[name]
        shift = None if group.shift is None else group.shift[name]
        if shift is not None and reduce_axis is not None:  # the partial outputs are summed: add it on one device
            shift = jnp.where(jax.lax.axis_index(reduce_axis) == 0, shift, 0)
        out = lora_linear(x, out, group.a[name], group.b[name], lora.info, slice_sizes=slice_sizes,
                          backend=options.backend, scale=scale, shift=shift, defer_add=True)
    return out if reduce_axis is None else jax.lax.psum(out, reduce_axis)


def _qkv_delta_apart(ctx: _Context, group: LayerLoRA | None, tokens: int) -> bool:
    """Whether `_with_lora` has the Pallas LoRA kernels write the q|k|v delta of a call of `tokens` tokens on its
    own, for XLA to add (`lora_linear`'s `defer_add`)."""
    if ctx.lora is None or "qkv" not in group.a:
        return False
    return (resolve_backend(ctx.options.backend, tokens, group.b["qkv"].shape[2]) == "pallas"
            and delta_expand(tokens, True))


def _override_rows(x: jax.Array, tokens: jax.Array, token_slot: jax.Array, ids: jax.Array,
                   rows: jax.Array) -> jax.Array:
    """x [T, H] with each token's row replaced where its slot overrides that token (ids [L, E], rows [L, E, H])."""
    slot = jnp.maximum(token_slot, 0)
    match = (ids[slot] == tokens[:, None]) & (token_slot >= 0)[:, None]  # [T, E]
    row = rows[slot, jnp.argmax(match, axis=1)]  # [T, H]
    return jnp.where(match.any(axis=1)[:, None], row.astype(x.dtype), x)


def _override_logits(logits: jax.Array, x: jax.Array, rows: RowOverrides, info: LoRABatchInfo,
                     backend: str) -> jax.Array:
    """logits [T, V] f32 widened to [T, V + E]: each token's slot's override rows (their logits through the
    segmented shrink, the rows as A of rank E) replace the base's columns and fill the added tokens' columns;
    every other added column is -inf, so a request can sample only the tokens its adapter defines."""
    e, (t, v) = rows.extra_vocab, logits.shape
    info = dataclasses.replace(info, ranks=jnp.full_like(info.ranks, e), scalings=jnp.ones_like(info.scalings))
    values = lora_shrink(x, rows.lm_head_rows, info, backend=backend).astype(jnp.float32)  # [T, E]
    ids = rows.lm_head_ids[jnp.maximum(info.token_slot, 0)]  # [T, E]
    column = jnp.where((ids >= 0) & (info.token_slot >= 0)[:, None], ids, v + e)  # out of range: dropped
    logits = jnp.concatenate([logits, jnp.full((t, e), -jnp.inf, logits.dtype)], axis=1)
    return logits.at[jnp.arange(t)[:, None], column].set(values, mode="drop")


def _pallas_kernels(backend: str) -> bool:
    """Whether the model's own Pallas kernels run (decode attention, RMSNorm): on GPU under the GPU backends
    ("auto", "gather", "pallas"), and under an explicit "pallas" anywhere (interpret mode on CPU); reference
    and ragged keep XLA's operations."""
    resolve_backend(backend)  # rejects unknown names
    return backend == "pallas" or (backend in ("auto", "gather") and jax.default_backend() == "gpu")


def _masked_attention(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array,
                      sliding_window: int | None) -> jax.Array:
    """q [B, S, KV, G, D] against every position of keys / values [B, KV, max_seq, D], the invisible ones
    (later than the query, or outside the sliding window) masked: [B, S, KV, G, D] (the form XLA runs)."""
    scores = jnp.einsum("BSKGD,BKTD->BKGST", q, keys, preferred_element_type=jnp.float32,
                        precision=dot_precision(q.dtype))
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    key_pos = jnp.arange(keys.shape[2])[None, None, :]
    visible = key_pos <= positions[:, :, None]  # [B, S, max_seq]: causal
    if sliding_window is not None:
        visible &= key_pos > positions[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return jnp.einsum("BKGST,BKTD->BSKGD", probs, values, precision=dot_precision(values.dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, kernel: bool = False) -> jax.Array:
        """x [T, H] normalized per row, in the Pallas kernel with `kernel` (the same rounding)."""
        if kernel:
            return rms_norm(x, self.weight[...], self.eps)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)

    def added(self, x: jax.Array, h: jax.Array | None, kernel: bool = False,
              add_in_kernel: bool = False) -> tuple[jax.Array, jax.Array]:
        """(s, s normalized) for the residual sum s = x + h [T, H] (x itself for h None), the norm in the Pallas
        kernel with `kernel`, and the add too with `add_in_kernel` (`add_rms_norm`: the same bits)."""
        if h is None:
            return x, self(x, kernel)
        if kernel and add_in_kernel:
            return add_rms_norm(x, h, self.weight[...], self.eps)
        s = x + h
        return s, self(s, kernel)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.window = config.window(layer)
        out_in = config.weights_out_in
        self.qkv = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias,
                          dtype=dtype, rngs=rngs, out_in=out_in)
        self.o = Linear(config.q_size, config.hidden_size, bias=False, dtype=dtype, rngs=rngs, out_in=out_in)

    def __call__(self, x, ctx: _Context, k_cache, v_cache, group: LayerLoRA | None,
                 residual: jax.Array | None = None):
        """x [T, H] (the parts' tokens one after another, each part's B·S in row-major order), caches
        [blocks, kv_heads, P, D], the layer's adapter weights -> ([T, H], caches); with `residual` [T, H] the
        output is residual + the o projection in one kernel (`matmul_add`; see `_in_kernel`).

        Each part's request b reads and writes the blocks of its table; tokens with `valid` False leave the
        cache untouched. A part with `kernel` (decode, S = 1) runs attention in a Pallas decode-attention
        kernel, which reads only the positions each request can see. Every part writes the cache before any
        reads it (the positions one part writes are positions no other part reads), so no write waits on a
        read and XLA updates the donated cache in place.
        """
        c = self.config
        qkv = _with_lora(self.qkv, x, ctx, group, "qkv", (c.q_size, c.kv_size, c.kv_size))
        qkvs, start = [], 0
        for p in ctx.parts:
            qkvs.append(qkv[start: start + p.b * p.s].reshape(p.b, p.s, -1, c.head_dim))  # [B, S, H + 2·KV, D]
            start += p.b * p.s
        in_kernel = [p.kernel and rope_in_attention(_qkv_delta_apart(ctx, group, x.shape[0])) for p in ctx.parts]
        # XLA's cache writes first, then the kernels' (each reads and writes the cache it is given), then the rest's
        # attention: each version of the cache is read before the next is written, so XLA updates it in place.
        queries = [None] * len(ctx.parts)
        for i, p in enumerate(ctx.parts):
            if not in_kernel[i]:
                queries[i], k_cache, v_cache = self._write(qkvs[i], p, k_cache, v_cache)
        outs = [None] * len(ctx.parts)
        for i, p in enumerate(ctx.parts):
            if in_kernel[i]:
                outs[i], k_cache, v_cache = self._attend_token(qkvs[i], p, k_cache, v_cache)
        for i, p in enumerate(ctx.parts):
            if not in_kernel[i]:
                outs[i] = self._attend(queries[i], p, k_cache, v_cache)
        outs = [o.reshape(p.b * p.s, c.q_size).astype(x.dtype) for o, p in zip(outs, ctx.parts)]
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
        if residual is not None:
            return matmul_add(out, self.o.weight[...], residual), k_cache, v_cache
        return _with_lora(self.o, out, ctx, group, "o", (c.hidden_size,), row_parallel=True), k_cache, v_cache

    def _write(self, qkv, p: _Part, k_cache, v_cache):
        """One part's q|k|v [B, S, H + 2·KV, D]: k and v rotated and written to the cache; q rotated [B, S, KV, G,
        D]."""
        c = self.config
        q, k, v = jnp.split(qkv, [c.num_heads, c.num_heads + c.num_kv_heads], axis=2)
        q, k = _rope(q, p.cos, p.sin), _rope(k, p.cos, p.sin)
        # [block, :, offset] addresses [B, S, kv_heads, D], the layout of k and v (advanced indices first).
        # Invalid tokens (padding) get an out-of-range block, so the scatter drops them: padding requests
        # share a real request's blocks, and a scatter with duplicate indices keeps an arbitrary one of them.
        size = k_cache.shape[2]
        index = jnp.minimum(p.positions // size, p.tables.shape[1] - 1)
        block = jnp.where(p.valid, jnp.take_along_axis(p.tables, index, axis=1), k_cache.shape[0])
        at = (block, slice(None), p.positions % size)
        k_cache = k_cache.at[at].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[at].set(v.astype(v_cache.dtype), mode="drop")
        return q.reshape(p.b, p.s, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim), k_cache, v_cache

    def _attend_token(self, qkv, p: _Part, k_cache, v_cache):
        """A decode part's (S = 1) attention in the Pallas kernel, which also rotates q and k of its q|k|v
        [B, 1, H + 2·KV, D] and writes k and v to the cache: ([B, KV, G, D], k_cache, v_cache)."""
        token = NewToken(qkv[:, 0], p.cos[:, 0], p.sin[:, 0], p.valid[:, 0])
        if p.tables.shape[1] == 1:  # one block per request: the contiguous kernel
            return decode_attention(token, k_cache, v_cache, p.positions[:, 0], p.tables[:, 0], window=self.window,
                                    chunk=p.chunk)
        return paged_decode_attention(token, k_cache, v_cache, p.positions[:, 0], p.tables, window=self.window,
                                      chunk=p.chunk)

    def _attend(self, q, p: _Part, k_cache, v_cache):
        """One part's attention over its blocks of the cache: q [B, S, KV, G, D] -> [B, S, KV, G, D]."""
        window = self.window
        if p.kernel and p.tables.shape[1] == 1:  # one block per request: the contiguous kernel
            return decode_attention(q[:, 0], k_cache, v_cache, p.positions[:, 0], p.tables[:, 0], window=window,
                                    chunk=p.chunk)
        if p.kernel:
            return paged_decode_attention(q[:, 0], k_cache, v_cache, p.positions[:, 0], p.tables, window=window,
                                          chunk=p.chunk)
        if p.own_block:
            return _masked_attention(q, k_cache, v_cache, p.positions, window)
        return _masked_attention(q, _gather(k_cache, p.tables), _gather(v_cache, p.tables), p.positions, window)


def _gather(cache: jax.Array, tables: jax.Array) -> jax.Array:
    """[B, KV, nb·P, D]: each request's blocks (tables [B, nb]) of cache [blocks, KV, P, D], in position order."""
    b, nb = tables.shape
    _, kv, size, d = cache.shape
    return cache[tables].transpose(0, 2, 1, 3, 4).reshape(b, kv, nb * size, d)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        out_in = config.weights_out_in
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype, rngs=rngs,
                              out_in=out_in)
        self.down = Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype, rngs=rngs,
                           out_in=out_in)

    def __call__(self, x, ctx: _Context, group: LayerLoRA | None, residual: jax.Array | None = None):
        """x [T, H] -> the MLP's output [T, H], or with `residual` [T, H] residual + that output in the down
        projection's kernel (`matmul_add`; see `_in_kernel`)."""
        i = self.config.intermediate_size
        gate_up = _with_lora(self.gate_up, x, ctx, group, "gate_up", (i, i))
        h = jax.nn.silu(gate_up[:, :i].astype(jnp.float32)) * gate_up[:, i:].astype(jnp.float32)
        if residual is not None:
            return matmul_add(h.astype(x.dtype), self.down.weight[...], residual)
        return _with_lora(self.down, h.astype(x.dtype), ctx, group, "down", (self.config.hidden_size,),
                          row_parallel=True)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.attn = Attention(config, layer, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, pending, ctx: _Context, k_cache, v_cache, group: LayerLoRA | None):
        """(x, mlp output, k_cache, v_cache): x [T, H] is the residual stream less `pending`, the layer before's
        MLP output (None: nothing), which is added here and the returned MLP output by whoever comes next, so
        that with `ctx.add_in_norm` each add runs in the kernel of the norm after it; where `_in_kernel`, the
        o or down projection's kernel adds it instead (the MLP output returned is then None: added)."""
        x, normed = self.input_norm.added(x, pending, ctx.norm_kernel, ctx.add_in_norm)
        if _in_kernel(self.attn.o, ctx, group, "o"):
            x, k_cache, v_cache = self.attn(normed, ctx, k_cache, v_cache, group, residual=x)
            normed = self.post_attn_norm(x, ctx.norm_kernel)
        else:
            h, k_cache, v_cache = self.attn(normed, ctx, k_cache, v_cache, group)
            x, normed = self.post_attn_norm.added(x, h, ctx.norm_kernel, ctx.add_in_norm)
        if _in_kernel(self.mlp.down, ctx, group, "down"):
            return self.mlp(normed, ctx, group, residual=x), None, k_cache, v_cache
        return x, self.mlp(normed, ctx, group), k_cache, v_cache


class Transformer(nnx.Module):
    """The decoder. Build with `nnx.eval_shape(lambda: Transformer(config, dtype=..., rngs=nnx.Rngs(0)))`
    and fill from a checkpoint (`jlora.models.loading`)."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Param(jnp.zeros((config.vocab_size, config.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.lm_head = (
            None if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, rngs=rngs,
                        out_in=config.weights_out_in)
        )

    def __call__(self, batch: Batch, cache: KVCache, lora: LoRAInput | None = None,
                 options: CallOptions = CallOptions()) -> tuple[jax.Array, KVCache]:
        """Runs the batch's groups of requests, B requests of S tokens each per group.

        Args:
          batch: each group's tokens and positions [B, S] (positions are cache indices, < max_seq), which
            tokens write the cache (`valid`; padding leaves it untouched) and each request's cache row (`rows`,
            default row b, with R = B); `logits_at` when only some tokens' logits are wanted (the final norm
            and the lm_head run on those N tokens only).
          cache: the KV cache, per layer [R, kv_heads, max_seq, head_dim] keys and values.
          lora: the adapter slots' weights and the batch's `LoRABatchInfo` (its tokens in the batch's flat
            order), or None for the base model alone.
          options: the static options (`CallOptions`).

        Returns:
          logits [B, S, V] f32 (a one-group batch without `logits_at`), or [N, V] at `logits_at` (with the
          adapters' row overrides V + E columns: see `_override_logits`), and the updated cache.
        """
        if len(batch.groups) > 1 and batch.logits_at is None:
            raise ValueError("a call with two groups needs logits_at")
        flat = batch.tokens
        embed = self.embed[...]
        ids = jnp.minimum(flat, embed.shape[0] - 1)  # an adapter's added tokens: their override row replaces it
        x = embed[ids]  # [T, H]
        factor, weights = None, None if lora is None else lora.weights
        if lora is not None:
            if weights.embed_a is not None:  # None: no loaded adapter targets the embedding
                x = lora_embedding(ids, weights.embed_a, weights.embed_b, lora.info, x, backend=options.backend)
            if weights.rows is not None:
                x = _override_rows(x, flat, lora.info.token_slot, weights.rows.embed_ids, weights.rows.embed_rows)
            if weights.rope_factor is not None:  # LongLoRA: linear RoPE scaling by each token's adapter's factor
                slot = lora.info.token_slot
                factor = jnp.where(slot >= 0, weights.rope_factor[jnp.maximum(slot, 0)], 1.0)
        norm_kernel = _pallas_kernels(options.backend) and rms_norm_supported(self.config.hidden_size)
        add_in_norm = norm_kernel and residual_add_in_norm(self.config, x.shape[0])
        gemm_kernels = (_pallas_kernels(options.backend) and options.reduce_axis is None
                        and projections_in_kernel(x.shape[0]))
        ctx = _Context(self._parts(batch, factor, cache, options), lora, options, norm_kernel, add_in_norm,
                       gemm_kernels)
        ks, vs, pending = [], [], None
        for i, layer in enumerate(self.layers):
            x, pending, k, v = layer(x, pending, ctx, cache.k[i], cache.v[i],
                                     None if lora is None else weights.layers[i])
            ks.append(k)
            vs.append(v)
        info = None if lora is None else lora.info
        if batch.logits_at is not None:  # the rows of the sum, as the sum of the rows
            x, info = x[batch.logits_at], None if lora is None else lora.head_info
            pending = None if pending is None else pending[batch.logits_at]
        _, normed = self.norm.added(x, pending, norm_kernel, add_in_norm)
        logits = self._head(normed, weights, info, options.backend)
        cache = KVCache(tuple(ks), tuple(vs))
        return (logits if batch.logits_at is not None else logits.reshape(*batch.groups[0].tokens.shape, -1)), cache

    def _parts(self, batch: Batch, factor: jax.Array | None, cache: KVCache,
               options: CallOptions) -> tuple[_Part, ...]:
        """Each group as the layers see it; `factor` [T]: each token's RoPE position divisor (LongLoRA)."""
        parts, start, inv_freq = [], 0, rope_frequencies(self.config)
        for g in batch.groups:
            b, s = g.tokens.shape
            rope_positions = g.positions if factor is None else g.positions / factor[start:start + b * s].reshape(b, s)
            kernel = (s == 1 and _pallas_kernels(options.backend)
                      and decode_attention_supported(self.config.head_dim, cache.k[0].shape[2]))
            writes = jnp.ones((b, s), bool) if g.valid is None else g.valid
            # once for all layers: an iota per layer is a kernel
            tables = jnp.arange(b)[:, None] if g.tables is None else g.tables
            cos, sin = _rotation(rope_positions, inv_freq)
            parts.append(_Part(b, s, g.positions, cos, sin, writes, tables, g.tables is None, kernel,
                               options.attention_chunk if kernel else None))
            start += b * s
        return tuple(parts)

    def _head(self, x: jax.Array, weights: LoRAWeights | None, info: LoRABatchInfo | None,
              backend: str) -> jax.Array:
        """The lm_head's logits [N, V] f32 of normed x [N, H], with the adapters' lm_head LoRA and row overrides."""
        if self.lm_head is None:  # the embedding [V, H] is [out, in]: reduced over at one token as the weights are
            logits = project(x, self.embed[...], True, self.config.weights_out_in).astype(x.dtype)
        else:
            logits = self.lm_head(x)
        if weights is not None and weights.lm_head_a is not None:  # no barrier (base_first): see CallOptions
            logits = lora_linear(x, logits, weights.lm_head_a, weights.lm_head_b, info,
                                 slice_sizes=(self.config.vocab_size,), backend=backend, scale=weights.lm_head_scale,
                                 shift=weights.lm_head_shift, defer_add=True)
        logits = logits.astype(jnp.float32)
        if weights is not None and weights.rows is not None:
            logits = _override_logits(logits, x, weights.rows, info, backend)
        return logits


def with_weight_layout(model: Transformer, out_in: bool) -> Transformer:
    """`model` with its projections' weights [out, in] (`out_in`) or [in, out] (`ModelConfig.weights_out_in`):
    itself when they are stored so, else a model over transposed copies of them."""
    if model.config.weights_out_in == out_in:
        return model
    config = dataclasses.replace(model.config, weights_out_in=out_in)
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=model.embed[...].dtype, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    _, state = nnx.split(model)
    flat = [(path, type(var)(var[...].T if path[-1] == "weight" and var[...].ndim == 2 else var[...]))
            for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
