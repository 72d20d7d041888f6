"""Token sampling inside the jitted step: greedy, temperature and nucleus (top-p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["sample_tokens"]


def sample_tokens(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
                  nucleus: bool) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V] f32, per row temperature [B] (0: greedy) and top_p [B].

    Top-p keeps the smallest set of most likely tokens whose probability reaches top_p (at least one). It
    sorts every row's logits (on an H200, 1.69 ms for [32, 128256] against 28 µs for sampling without it), so
    it runs only when the static `nucleus` is set: the caller knows whether any row samples with top_p < 1.
    Without it, rows with temperature > 0 sample from all tokens (their top_p is taken as 1).
    """
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    if nucleus:
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
        sorted_logits = jnp.where(before < top_p[:, None], sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)
        sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    else:
        sampled = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
