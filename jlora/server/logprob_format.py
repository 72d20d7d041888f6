"""Log-probabilities in OpenAI's two answer formats: the completions API's legacy object (parallel lists of
tokens, their log-probabilities, top alternatives and text offsets) and chat's list of token objects.

A -inf log-probability (a token no request of this adapter can produce) is written as -9999.0, as vLLM does:
JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence

from jlora.logprobs import TokenLogprob

__all__ = ["TokenTexts", "chat_logprobs", "completion_logprobs"]


class TokenTexts:
    """Each token id's text in answers: the tokenizer's decode of the token alone (special tokens decode to
    ""), built for the whole vocabulary at once; an id without text (an adapter's added token, or any id
    without a tokenizer) as vLLM writes it, "token_id:N"."""

    def __init__(self, tokenizer):
        self._texts = [] if tokenizer is None else tokenizer.decode_batch(
            [[i] for i in range(tokenizer.get_vocab_size())])

    def __call__(self, token: int) -> str:
        return self._texts[token] if token < len(self._texts) else f"token_id:{token}"


def _finite(value: float) -> float:
    return max(value, -9999.0)


def _top(lp: TokenLogprob, texts: TokenTexts) -> dict[str, float]:
    """The alternatives by text; of tokens with the same text the more likely one's (it comes first)."""
    top: dict[str, float] = {}
    for token, value in lp.top:
        top.setdefault(texts(token), _finite(value))
    return top


def completion_logprobs(entries: Sequence[tuple[int, TokenLogprob | None]], texts: TokenTexts,
                        offset: int = 0) -> dict:
    """The legacy `logprobs` object of tokens given as (id, its `TokenLogprob`, or None for an echoed prompt's
    first token, which nothing predicts), their text offsets counted from `offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in entries:
        text = texts(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if lp is None else _finite(lp.logprob))
        out["top_logprobs"].append(None if lp is None else _top(lp, texts))
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict:
    """Chat's `logprobs` object: one {token, logprob, bytes, top_logprobs} per generated token."""

    def item(token: int, value: float) -> dict:
        text = texts(token)
        return {"token": text, "logprob": _finite(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(lp.token, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}
                        for lp in entries]}
