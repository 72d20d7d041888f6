"""Log-probabilities: computed in the jitted step, carried to the host, and kept per request.

They are `log_softmax` of the float32 logits the sampler sees, before temperature and the filters (vLLM's default
"raw" log-probabilities, and what HF's `log_softmax(logits)` gives): a token's log-probability under the
model with its adapter, whatever the request's sampling settings. Tokens outside a request's vocabulary
(another adapter's added tokens) have logits of -inf, so they take no probability mass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_TOP_LOGPROBS", "Score", "StepLogprobs", "TokenLogprob", "TopLogprobs", "to_host", "top_logprobs",
           "top_width"]

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's and vLLM's limit)
_WIDTHS = (1, 5, MAX_TOP_LOGPROBS)  # the compiled top-k widths: top_k of 20 over a 128k vocabulary at 576
                                    # positions took 5.6 ms on an H100, of 1 0.13 ms (scoring asks for 1)


def top_width(k: int) -> int:
    """The top-k width a step computes when its requests ask for at most k alternatives (0 <= k <= 20): one of
    a few buckets, so that a step's cost follows what is asked with few compiled variants."""
    return next(w for w in _WIDTHS if w >= k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TopLogprobs:
    """Log-probabilities at N positions: each position's chosen token's, and the W most likely tokens' (most
    likely first; W a `top_width`)."""

    chosen: jax.Array  # [N] f32
    top_ids: jax.Array  # [N, W] int32
    top: jax.Array  # [N, W] f32


def top_logprobs(logits: jax.Array, chosen: jax.Array, width: int) -> TopLogprobs:
    """The log-probabilities of logits [N, V] f32 at the chosen token ids [N] (an id < 0: any value), with the
    `width` most likely."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    top, top_ids = jax.lax.top_k(logp, min(width, logits.shape[-1]))
    at = jnp.take_along_axis(logp, jnp.maximum(chosen, 0)[:, None], axis=-1)[:, 0]
    return TopLogprobs(at, top_ids.astype(jnp.int32), top)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepLogprobs:
    """What a step with log-probabilities returns beside its tokens: each row's sampled token's [R], and,
    with a prefill group [Bp, Sp], each prompt token's prediction of the next prompt token [Bp·Sp]."""

    sampled: TopLogprobs
    prompt: TopLogprobs | None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token and its log-probability, with the k most likely tokens at its position (most likely first;
    k as the request asked, possibly 0)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def at(lp, i: int, token: int, k: int) -> TokenLogprob:
        """Position i of host copies (NumPy) of a `TopLogprobs`, for `token`, with k alternatives."""
        top = tuple((int(t), float(v)) for t, v in zip(lp.top_ids[i, :k], lp.top[i, :k]))
        return TokenLogprob(int(token), float(lp.chosen[i]), top)


def to_host(lp: StepLogprobs | None) -> StepLogprobs | None:
    """A step's log-probabilities copied to NumPy (one transfer for all)."""
    return None if lp is None else jax.tree.map(np.asarray, jax.device_get(lp))


@dataclasses.dataclass(frozen=True)
class Score:
    """A continuation scored after its prompt: its tokens' log-probabilities, their sum, and whether each
    token is the most likely one at its position (lm-eval's `is_greedy`; a tie counts as greedy)."""

    logprob: float
    token_logprobs: list[float]
    is_greedy: bool
