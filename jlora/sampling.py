"""Token sampling inside the jitted step: greedy, temperature and nucleus (top-p), one key per request.

The contract: a request's sampled tokens depend only on its logits, its settings and its own key stream,
`fold_in(key(seed), i)` for its i-th generated token, never on its row or on the other requests of a batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["request_keys", "sample_seeds", "sample_tokens"]


def sample_seeds(seed: int, n: int) -> list[int]:
    """The seeds of a request's n samples (n > 1): the first is the request's own, so n=1 draws what a single
    sample draws; sample j adds j times the golden ratio's 32-bit constant, modulo 2**32."""
    return [(seed + j * 0x9E3779B9) % 2**32 for j in range(n)]


def request_keys(seeds: jax.Array, token_index: jax.Array) -> jax.Array:
    """[B] keys, `fold_in(key(seeds[b]), token_index[b])`: request b's key for its token_index[b]-th token.

    Args:
      seeds: [B] uint32, each request's seed.
      token_index: [B] int32, how many tokens each request generated before this one.
    """
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, token_index)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
                  nucleus: bool) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V] f32, per row keys [B] (`request_keys`), temperature [B]
    (0: greedy) and top_p [B].

    Top-p keeps the smallest set of most likely tokens whose probability reaches top_p (at least one). It
    sorts every row's logits (the sort dominates sampling at large vocabularies), so it runs only when the
    static `nucleus` is set: the caller knows whether any row samples with top_p < 1. Without it, rows with
    temperature > 0 sample from all tokens (their top_p is taken as 1). Rows with top_p >= 1 draw the same
    token either way, so no row's draw depends on the other rows' settings.
    """
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    categorical = jax.vmap(lambda key, row: jax.random.categorical(key, row))  # each row its own key
    sampled = categorical(keys, scaled)
    if nucleus:
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ranked above each token
        sorted_logits = jnp.where(before < top_p[:, None], sorted_logits, -jnp.inf)
        choice = categorical(keys, sorted_logits)
        cut = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        sampled = jnp.where(top_p < 1, cut, sampled)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
