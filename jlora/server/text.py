"""`StreamText`: a request's generated text as its tokens arrive, decoded incrementally, with stop strings."""

from __future__ import annotations

from jlora.output_text import output_text, prompt_context

__all__ = ["StreamText"]


class StreamText:
    """The generated text so far. Each `update` decodes only the tokens that arrived since the last complete
    character, together with the tokens of the piece before them, and keeps what that adds to the piece alone:
    decoders that space or strip a sequence's first token (SentencePiece's "▁", WordPiece's "##") then give
    what a decode of the whole sequence gives, and a character split over byte tokens waits for its last byte.
    The cost per token stays constant, where a whole decode per update grew with the output. The prompt's last
    tokens start the sequence: the text is `output_text`'s, what the output adds to the prompt's.

    Stop strings: `take()` gives the new text that can no longer become a stop string's start; once a stop
    string appears, the text ends before it (`finish` = "stop"), and `shown` counts the request's tokens through
    the one that completed it: an answer shows those, whatever the engine generated before the request was
    cancelled. Without a tokenizer the text stays empty.
    """

    def __init__(self, tokenizer, stop_strings: list[str], prompt: list[int] = ()):
        self.tokenizer, self.stops = tokenizer, stop_strings
        # An adapter's added tokens (ids past the base vocabulary) have no text in the base tokenizer.
        self.known = 0 if tokenizer is None else tokenizer.get_vocab_size()
        self.text, self.sent, self.finish, self.done = "", 0, None, False
        self.prompt = prompt
        # the prompt's last tokens, then the output's tokens with text
        self.ids: list[int] = [] if tokenizer is None else prompt_context(tokenizer, prompt)
        self.seen = 0  # the request's tokens looked at
        self.shown = 0  # the request's tokens an answer shows: those looked at, or through a stop string's end
        # ids[prefix:read]: the piece decoded last (at first the prompt's); ids[read:]: not in the text yet
        self.prefix, self.read = 0, len(self.ids)
        self.searched = 0  # text[:searched] was searched for stop strings

    def update(self, tokens: list[int], done: bool) -> bool:
        """Updates from the request's tokens so far (its growing `out` list, read, not kept); True when a stop
        string ended the text."""
        self.done = done
        if self.finish == "stop":
            return True
        new = tokens[self.seen:]  # the engine's thread may append meanwhile: count what was read
        first, self.seen = self.seen, self.seen + len(new)
        self.shown = self.seen
        if self.tokenizer is None:
            return False
        self.ids += [t for t in new if t < self.known]
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        end = len(self.ids)
        after = self.tokenizer.decode(self.ids[self.prefix:end])
        if not done:  # hold back up to 3 tokens that end in a character's first bytes (the new text ends in U+FFFD)
            for _ in range(min(3, end - self.read)):
                if not after[len(before):].endswith("\ufffd"):
                    break
                end -= 1
                after = self.tokenizer.decode(self.ids[self.prefix:end])
            if after[len(before):].endswith("\ufffd"):  # no character has more than 4 bytes: invalid UTF-8,
                end = len(self.ids)                        # taken as U+FFFD, so the piece decoded stays short
                after = self.tokenizer.decode(self.ids[self.prefix:end])
        if len(after) > len(before):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, end
        start = max(0, self.searched - max((len(s) for s in self.stops), default=0) + 1)
        hits = [at for s in self.stops if (at := self.text.find(s, start)) >= 0]
        self.searched = len(self.text)
        if hits:  # the text ends before the first stop string in the text of the token that completed one
            self.shown = next((k for k in range(first + 1, self.seen) if self._stops_in(tokens[:k])), self.seen)
            self.text, self.finish, self.done = self.text[:min(self._stops_in(tokens[:self.shown]))], "stop", True
        return self.finish == "stop"

    def _stops_in(self, tokens: list[int]) -> list[int]:
        """Where stop strings start in the whole text of `tokens` after the prompt (once per request: when one ended
        its text), so the cut does not depend on how many tokens an update brought."""
        text = output_text(self.tokenizer, self.prompt, tokens)
        return [at for s in self.stops if (at := text.find(s)) >= 0]

    def take(self) -> str:
        hold = 0 if self.done else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.sent, len(self.text) - hold)
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def final(self) -> str:
        return self.text
