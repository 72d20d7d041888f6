"""`StreamText` against whole decodes: fed a request's tokens in random increments, its streamed pieces join
to what the tokenizer decodes from all of them, for a word-level tokenizer (WordPiece's spacing) and a
byte-level one (characters split over tokens, outputs cut inside a character); no piece holds a half
character; stop strings cut the text where the whole decode first holds one (before the earliest of those it
holds then), and the tokens shown end with the one that completed it."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from jlora import testing
from jlora.server.text import StreamText

CHARS = list("abc xyz,.!") + ["é", "ö", "ß", "世", "界", "🎉", "\n"]


def byte_level() -> Tokenizer:
    """One token per byte: every character past ASCII spans several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def word_level(tmp_path) -> Tokenizer:
    testing.write_tokenizer(str(tmp_path), 40, chat_template=None)
    return Tokenizer.from_file(str(tmp_path / "tokenizer.json"))


def outputs(kind: str, tok: Tokenizer, rng) -> list[int]:
    """A random output: bytes of random text (sometimes cut inside its last character), or random word ids
    with some past the vocabulary (an adapter's added tokens: no text)."""
    if kind == "bytes":
        ids = tok.encode("".join(rng.choice(CHARS, int(rng.integers(1, 30))))).ids
        return ids[:-1] if len(ids) > 1 and rng.random() < 0.3 else ids
    return rng.integers(0, tok.get_vocab_size() + 3, int(rng.integers(1, 30))).tolist()


def stream(tok, ids: list[int], stops: list[str], rng) -> tuple[StreamText, str]:
    """Feeds ids in increments of 1-3 tokens, as the engine's updates arrive; the text and the pieces joined."""
    text, pieces, n, out = StreamText(tok, stops), [], 0, []
    while n < len(ids) and not text.finish:
        n = min(len(ids), n + int(rng.integers(1, 4)))
        out += ids[len(out): n]  # the request's growing token list
        text.update(out, n == len(ids))
        pieces.append(text.take())
    return text, "".join(pieces)


@pytest.mark.parametrize("kind", ["bytes", "words"])
def test_streamed_pieces_join_to_the_whole_decode(kind, tmp_path):
    rng = np.random.default_rng(0)
    tok = byte_level() if kind == "bytes" else word_level(tmp_path)
    for _ in range(200):
        ids = outputs(kind, tok, rng)
        whole = tok.decode([t for t in ids if t < tok.get_vocab_size()])
        text, streamed = stream(tok, ids, [], rng)
        assert streamed == text.final() == whole, ids
        if not whole.endswith("\ufffd"):  # a complete output: no piece held half a character
            assert "\ufffd" not in streamed


@pytest.mark.parametrize("kind", ["bytes", "words"])
def test_stop_strings_cut_where_the_whole_decode_first_holds_one(kind, tmp_path):
    rng = np.random.default_rng(1)
    tok = byte_level() if kind == "bytes" else word_level(tmp_path)
    checked = 0
    while checked < 100:
        ids = outputs(kind, tok, rng)
        whole = tok.decode([t for t in ids if t < tok.get_vocab_size()]).rstrip("\ufffd")
        if len(whole) < 2:
            continue
        stops = ["<never>"]  # and two pieces of the text: the first to appear ends it, whatever their order here
        for _ in range(2):
            at = int(rng.integers(0, len(whole) - 1))
            stops.append(whole[at: at + int(rng.integers(1, 5))])
        text, streamed = stream(tok, ids, stops, rng)
        # the tokens an answer shows: through the one whose text completed a stop string, though the updates
        # read up to 2 more; the text ends before the earliest stop string in theirs
        decode = lambda k: tok.decode([t for t in ids[:k] if t < tok.get_vocab_size()])  # noqa: E731
        shown = next(k for k in range(1, len(ids) + 1) if any(s in decode(k) for s in stops))
        first = min(decode(shown).index(s) for s in stops if s in decode(shown))
        assert text.finish == "stop" and streamed == text.final() == whole[:first], (ids, stops)
        assert text.shown == shown, (ids, stops)
        checked += 1


def test_a_stop_string_completed_first_ends_the_text_however_the_tokens_arrive(tmp_path):
    """"c" completes at the third token, "abcd" (which starts earlier) at the fourth: the text ends before "c"
    whether the four tokens come one by one or in one update, as a request's updates may bring several."""
    tok = byte_level()
    ids = tok.encode("abcdef").ids
    for sizes in ([1] * 6, [6], [2, 4]):
        text, out = StreamText(tok, ["abcd", "c"]), []
        for size in sizes:
            out += ids[len(out): len(out) + size]
            if text.update(out, len(out) == len(ids)):
                break
        assert (text.final(), text.shown, text.finish) == ("ab", 3, "stop"), sizes


def test_without_a_tokenizer_the_text_stays_empty():
    text = StreamText(None, ["x"])
    assert not text.update([1, 2, 3], True) and text.take() == "" and text.final() == "" and text.done
