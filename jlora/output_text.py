"""A request's output as text: what its tokens add to the decode of the prompt's last tokens, so that the space a
decoder puts before a word after others (SentencePiece's "▁", WordPiece) is the text's first character, as in
vLLM's outputs and transformers' text-generation pipeline's; the prompt's text joined to it reads as the whole
sequence's decode. Ids the tokenizer lacks (an adapter's added tokens) have no text."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["output_text", "prompt_context"]

CONTEXT = 5  # the prompt's tokens decoded before the output: a character's bytes (at most 4) and one more


def prompt_context(tokenizer, prompt: Sequence[int]) -> list[int]:
    """The prompt's last tokens with text, which an output's decode starts from; none where they end inside a
    character (their decode ends in U+FFFD, which the output's first bytes would replace)."""
    known = tokenizer.get_vocab_size()
    context = [t for t in prompt if t < known][-CONTEXT:]
    return [] if context and tokenizer.decode(context).endswith("\ufffd") else context


def output_text(tokenizer, prompt: Sequence[int], out: Sequence[int]) -> str:
    """The text `out` adds after `prompt` (a whole decode; `StreamText` gives it incrementally)."""
    context, known = prompt_context(tokenizer, prompt), tokenizer.get_vocab_size()
    return tokenizer.decode(context + [t for t in out if t < known])[len(tokenizer.decode(context)):]
