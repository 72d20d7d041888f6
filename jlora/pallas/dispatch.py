"""Entry points of the Pallas backend: shape requirements, rank padding, split-K finishing.

The kernels need R to be a power of two >= 16 (a `dot` dimension), K and every output slice at least 16 wide
(any width above: a last block overlaps the one before), and `block_m` a power of two >= 16. A smaller or odd
R is zero-padded here per slice, which copies the weights on every call; the adapter pool stores weights
already padded, so the model never pays it. K or a slice narrower than 16 is zero-padded here as well.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jlora.batch_info import LoRABatchInfo
from jlora.pallas.common import dot_dim
from jlora.pallas.config import ExpandConfig, ShrinkConfig
from jlora.pallas.expand import expand as _expand
from jlora.pallas.shrink import default_config, shrink_partials

__all__ = ["kernel_rank", "supported", "shrink", "expand", "linear"]


def kernel_rank(rank: int) -> int:
    """The rank the kernels run at: the next power of two >= max(rank, 16)."""
    return dot_dim(rank)


def supported(block_m: int) -> str | None:
    """Why the kernels cannot run a batch info's row tile, or None when they can (every K, rank and slice
    width runs)."""
    if block_m < 16 or block_m & (block_m - 1):
        return f"info.block_m={block_m} must be a power of two >= 16 for the pallas backend"
    return None


def _require(info: LoRABatchInfo) -> None:
    reason = supported(info.block_m)
    if reason:
        raise NotImplementedError(reason + "; use backend='reference' or 'ragged'")


def _pad_k(x: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] and A [L, S·R, K] zero-padded to K >= 16 (a `dot` dimension)."""
    extra = 16 - x.shape[1]
    if extra <= 0:
        return x, a
    return jnp.pad(x, ((0, 0), (0, extra))), jnp.pad(a, ((0, 0), (0, 0), (0, extra)))


def _pad_narrow_slices(slice_sizes: tuple[int, ...], b: jax.Array, *columns: jax.Array | None):
    """(slice sizes, B [L, N, R], *columns [..., N]) with every slice narrower than 16 zero-padded to 16
    columns, and the padded output's columns to keep [N] (None when no slice is narrow: nothing padded).
    `columns` are the arrays indexed by output column (base, scale, shift); None stays None."""
    if min(slice_sizes) >= 16:
        return slice_sizes, b, *columns, None
    bounds = list(itertools.accumulate(slice_sizes, initial=0))
    padded = tuple(max(16, n) for n in slice_sizes)

    def pad(w):  # w [..., N] -> [..., N'] slice by slice
        if w is None:
            return None
        parts = [jnp.pad(w[..., bounds[i] : bounds[i + 1]], [(0, 0)] * (w.ndim - 1) + [(0, padded[i] - n)])
                 for i, n in enumerate(slice_sizes)]
        return jnp.concatenate(parts, axis=-1)

    starts = itertools.accumulate(padded, initial=0)
    keep = np.concatenate([np.arange(o, o + n) for o, n in zip(starts, slice_sizes)])
    return padded, jnp.swapaxes(pad(jnp.swapaxes(b, 1, 2)), 1, 2), *(pad(c) for c in columns), keep


def _pad_slices(w: jax.Array, axis: int, num_slices: int, rank: int) -> jax.Array:
    """Zero-pads each of the `num_slices` rank blocks of `w` along `axis` from R to kernel_rank(R)."""
    extra = kernel_rank(rank) - rank
    if not extra:
        return w
    shape = w.shape[:axis] + (num_slices, rank) + w.shape[axis + 1 :]
    pad = [(0, 0)] * (len(shape))
    pad[axis + 1] = (0, extra)
    w = jnp.pad(w.reshape(shape), pad)
    return w.reshape(w.shape[:axis] + (num_slices * kernel_rank(rank),) + w.shape[axis + 2 :])


def shrink(
    x: jax.Array, a: jax.Array, info: LoRABatchInfo, *, num_slices: int, config: ShrinkConfig | None = None
) -> jax.Array:
    """[T, S·R] in x.dtype (see `jlora.lora_shrink`); `config` overrides the heuristic tiles.

    With several K splits XLA adds the f32 partials afterwards, masked by the token slots; XLA fuses those
    sums across a model's calls, which beat finishing them inside the kernel (docs/kernels.md)."""
    _require(info)
    rank = a.shape[1] // num_slices
    x, a = _pad_k(x, _pad_slices(a, 1, num_slices, rank))
    config = config or default_config(x, a, info, num_slices)
    if config.k_splits == 1:  # the kernel writes x.dtype into zeros: no pass over f32 sums, no mask
        out = jnp.zeros((1, x.shape[0], a.shape[1]), x.dtype)
        y = shrink_partials(x, a, info, num_slices=num_slices, config=config, out=out)[0]  # [T, S·R']
    else:
        y = shrink_partials(x, a, info, num_slices=num_slices, config=config).sum(0)
        y = jnp.where((info.token_slot >= 0)[:, None], y, 0.0).astype(x.dtype)
    return y.reshape(y.shape[0], num_slices, -1)[:, :, :rank].reshape(y.shape[0], num_slices * rank)


def expand(
    s: jax.Array,
    b: jax.Array,
    info: LoRABatchInfo,
    base: jax.Array,
    *,
    slice_sizes: tuple[int, ...],
    config: ExpandConfig | None = None,
    scale: jax.Array | None = None,
    shift: jax.Array | None = None,
) -> jax.Array:
    """[T, N] (see `jlora.lora_expand`); `config` overrides the heuristic tiles."""
    _require(info)
    rank = b.shape[2]
    s = _pad_slices(s, 1, len(slice_sizes), rank)
    padded, b, base, scale, shift, keep = _pad_narrow_slices(slice_sizes, _pad_slices(b, 2, 1, rank), base, scale,
                                                             shift)
    out = _expand(s[None], b, info, base, slice_sizes=padded, config=config, scale=scale, shift=shift)
    return out if keep is None else out[:, keep]


def linear(
    x: jax.Array,
    base: jax.Array,
    a: jax.Array,
    b: jax.Array,
    info: LoRABatchInfo,
    *,
    slice_sizes: tuple[int, ...],
    shrink_config: ShrinkConfig | None = None,
    expand_config: ExpandConfig | None = None,
    scale: jax.Array | None = None,
    shift: jax.Array | None = None,
    defer_add: bool = False,
) -> jax.Array:
    """[T, N] (see `jlora.lora_linear`): the expand kernel reads the shrink's split-K partials directly.
    The configs override the heuristic tiles of either kernel.

    Two kernels at every size: a fused shrink+expand kernel, slot-loop kernels and per-token kernels were
    built and were slower (docs/kernels.md, "Kernels built and not adopted")."""
    _require(info)
    rank = b.shape[2]
    x, a = _pad_k(x, _pad_slices(a, 1, len(slice_sizes), rank))
    padded, b, base, scale, shift, keep = _pad_narrow_slices(slice_sizes, _pad_slices(b, 2, 1, rank), base, scale,
                                                             shift)
    partials = shrink_partials(x, a, info, num_slices=len(slice_sizes), config=shrink_config)
    out = _expand(partials, b, info, base, slice_sizes=padded, config=expand_config, scale=scale, shift=shift,
                  defer_add=defer_add)
    return out if keep is None else out[:, keep]
