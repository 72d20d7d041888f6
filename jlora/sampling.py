"""Token sampling inside the jitted step: the repetition, frequency and presence penalties (vLLM's), greedy,
temperature, and the top-k, top-p (nucleus) and min-p filters as HF's `generate` applies them, one key per
request.

The contract: a request's sampled tokens depend only on its logits, its settings and its own key stream,
`fold_in(key(seed), i)` for its i-th generated token, never on its row or on the other requests of a batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Penalties", "Sampling", "apply_penalties", "request_keys", "sample_seeds", "sample_tokens"]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["seeds", "token_index", "temperature", "top_p", "top_k", "min_p"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Each row's sampling [R]: its request's seed and the index of the token it samples (its key is
    `request_keys(seeds, token_index)`), temperature (0: greedy), top_p (1: off), top_k (0: off) and min_p
    (0: off)."""

    seeds: np.ndarray
    token_index: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray

    def row_filters(self):
        """[R] bool: the rows that ask for a filter (NumPy or JAX arrays, as the fields are)."""
        return (self.top_p < 1) | (self.top_k > 0) | (self.min_p > 0)

    def filtered(self) -> bool:
        """Whether some row samples from a filtered set (on host arrays): the step's static `filtered`."""
        return bool(((self.temperature > 0) & self.row_filters()).any())


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["prompt_len", "repetition", "frequency", "presence"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Penalties:
    """Each row's penalties, for a step where some row asks for one; the tokens they count come apart, as the
    rows' history (`apply_penalties`), which stays on the device from step to step.

    Attributes:
      prompt_len: [R] int32, how many of a row's tokens are its prompt (the rest count as generated).
      repetition: [R] f32 (1: off), frequency and presence: [R] f32 (0: off).
    """

    prompt_len: np.ndarray
    repetition: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray


def apply_penalties(logits: jax.Array, penalties: Penalties, history: jax.Array, tokens: jax.Array,
                    positions: jax.Array, decoding: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits [R, W] f32 with each row's penalties applied, the history with the step's decode tokens), as vLLM
    applies them (before temperature and the filters; log-probabilities are taken before them): a token of the
    prompt or generated has its logit divided by `repetition` where positive and multiplied by it otherwise
    (HF's `repetition_penalty` over prompt and output); then a token generated c times loses `frequency · c`,
    and `presence` once.

    `history` [R, H] int32: each row's tokens by position (prompt, then generated), -1 past them. `tokens`,
    `positions`, `decoding` [R]: each row's decode token, its position and whether the row decodes; it joins
    the row's history there (the host may not know it yet: the step before sampled it). A row whose penalties
    are off keeps its logits bit for bit.
    """
    r, w = logits.shape
    h = history.shape[1]
    history = history.at[jnp.arange(r), jnp.where(decoding, positions, h)].set(tokens, mode="drop")
    rows, ids = jnp.arange(r)[:, None], jnp.where(history >= 0, history, w)  # w: out of range, dropped
    generated = (jnp.arange(h)[None] >= penalties.prompt_len[:, None]).astype(jnp.float32)
    seen = jnp.zeros((r, w), bool).at[rows, ids].set(True, mode="drop")
    counts = jnp.zeros((r, w), jnp.float32).at[rows, ids].add(generated, mode="drop")
    rep = penalties.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - penalties.frequency[:, None] * counts - penalties.presence[:, None] * (counts > 0), history


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


def sample_tokens(logits: jax.Array, keys: jax.Array, sampling: Sampling, *, filtered: bool) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V] f32, per row keys [B] (`request_keys`) and each row's `sampling`.

    A row with temperature 0 takes the argmax; the others sample from logits / temperature, filtered in HF's
    order: top-k keeps the tokens at least as likely as the k-th, top-p the smallest set of those whose
    probability (renormalized over them) reaches top_p, min-p those at least min_p times as likely as the top
    token (always at least the top token). The filters sort every row's logits (the sort dominates sampling at
    large vocabularies), so they run only when the static `filtered` is set: the caller knows whether any row
    asks for one (`Sampling.filtered`). Without it, rows sample from all tokens (their filters taken as off).
    Rows without filters draw the same token either way, so no row's draw depends on the other rows' settings.
    """
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(sampling.temperature, 1e-6)[:, None]
    categorical = jax.vmap(lambda key, row: jax.random.categorical(key, row))  # each row its own key
    sampled = categorical(keys, scaled)
    if filtered:
        order = jnp.argsort(-scaled, axis=-1)
        ranked = jnp.take_along_axis(scaled, order, axis=-1)
        vocab = ranked.shape[-1]
        k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), vocab)
        keep = ranked >= jnp.take_along_axis(ranked, k[:, None] - 1, axis=-1)  # ties with the k-th kept, as HF
        probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
        keep &= jnp.cumsum(probs, axis=-1) - probs < sampling.top_p[:, None]  # the mass ranked above each token
        keep &= ranked >= ranked[:, :1] + jnp.log(sampling.min_p)[:, None]  # p >= min_p * p_top; log 0 = -inf
        choice = categorical(keys, jnp.where(keep, ranked, -jnp.inf))
        cut = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        sampled = jnp.where(sampling.row_filters(), cut, sampled)
    return jnp.where(sampling.temperature > 0, sampled, greedy).astype(jnp.int32)
