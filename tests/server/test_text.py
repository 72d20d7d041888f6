"""`StreamText` against whole decodes: fed a request's tokens in random increments after a random prompt, its
streamed pieces join to what the tokenizer decodes from the prompt and all of them past the prompt's own decode,
for a word-level tokenizer (WordPiece's spacing), a SentencePiece-like one (Metaspace: a sequence's first word
loses its space) and a byte-level one (characters split over tokens, outputs cut inside a character); no piece
holds a half character; stop strings cut the text where the whole decode first holds one (before the earliest
of those it holds then), and the tokens shown end with the one that completed it."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from jlora import testing
from jlora.output_text import output_text
from jlora.server.text import StreamText

CHARS = list("abc xyz,.!") + ["é", "ö", "ß", "世", "界", "🎉", "\n"]
KINDS = ["bytes", "words", "metaspace"]


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


def metaspace() -> Tokenizer:
    """SentencePiece's spacing: words that start with "▁" and pieces that continue one; a decode drops the space
    of its first word."""
    pieces = ["<unk>"] + [f"▁{w}" for w in ("the", "a", "cat", "sat", "on", "mat")] + ["s", "ing", ".", ","]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def tokenizer(kind: str, tmp_path) -> Tokenizer:
    return {"bytes": byte_level, "metaspace": metaspace}.get(kind, lambda: word_level(tmp_path))()


def outputs(kind: str, tok: Tokenizer, rng, cut: bool = True) -> list[int]:
    """A random output: bytes of random text (sometimes cut inside its last character, with `cut`), or random
    ids with some past the vocabulary (an adapter's added tokens: no text)."""
    if kind == "bytes":
        ids = tok.encode("".join(rng.choice(CHARS, int(rng.integers(1, 30))))).ids
        return ids[:-1] if cut and len(ids) > 1 and rng.random() < 0.3 else ids
    return rng.integers(0, tok.get_vocab_size() + 3, int(rng.integers(1, 30))).tolist()


def prompt(kind: str, tok: Tokenizer, rng) -> list[int]:
    """A random prompt of whole characters, at times none."""
    return [] if rng.random() < 0.1 else outputs(kind, tok, rng, cut=False)


def whole(tok: Tokenizer, before: list[int], ids: list[int]) -> str:
    """What `ids` add to the decode of the whole prompt `before` (ids past the vocabulary have no text)."""
    text = lambda ids: tok.decode([t for t in ids if t < tok.get_vocab_size()])  # noqa: E731
    return text(before + ids)[len(text(before)):]


def stream(tok, before: list[int], ids: list[int], stops: list[str], rng) -> tuple[StreamText, str]:
    """Feeds ids after the prompt `before` in increments of 1-3 tokens, as the engine's updates arrive; the text
    and the pieces joined."""
    text, pieces, n, out = StreamText(tok, stops, before), [], 0, []
    while n < len(ids) and not text.finish:
        n = min(len(ids), n + int(rng.integers(1, 4)))
        out += ids[len(out): n]  # the request's growing token list
        text.update(out, n == len(ids))
        pieces.append(text.take())
    return text, "".join(pieces)


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_pieces_join_to_the_whole_decode(kind, tmp_path):
    rng = np.random.default_rng(0)
    tok = tokenizer(kind, tmp_path)
    for _ in range(200):
        before, ids = prompt(kind, tok, rng), outputs(kind, tok, rng)
        want = whole(tok, before, ids)
        text, streamed = stream(tok, before, ids, [], rng)
        assert streamed == text.final() == want == output_text(tok, before, ids), (before, ids)
        if not want.endswith("\ufffd"):  # a complete output: no piece held half a character
            assert "\ufffd" not in streamed


def test_the_text_keeps_the_space_before_its_first_word():
    """A SentencePiece decode of the output alone drops its first word's space; the text after a prompt keeps
    it, as vLLM's and transformers' pipeline's do, so the prompt and the text join as the whole decode."""
    tok = metaspace()
    before, ids = tok.encode("the cat").ids, [tok.token_to_id(p) for p in ("▁sat", "▁on", "▁the", "▁mat", ".")]
    assert tok.decode(ids) == "sat on the mat."
    for context, want in ((before, " sat on the mat."), ([], "sat on the mat.")):  # no prompt: the decode alone
        text, streamed = stream(tok, context, ids, [], np.random.default_rng(0))
        assert streamed == text.final() == output_text(tok, context, ids) == want


def test_a_prompt_that_ends_inside_a_character_is_no_context():
    """A prompt of ids may end inside a character, which the output's first bytes complete: the text is then the
    output's decode alone, which keeps its half character rather than the prompt's text changing."""
    tok = byte_level()
    before, ids = tok.encode("aé").ids[:-1], tok.encode("bc").ids
    text, streamed = stream(tok, before, ids, [], np.random.default_rng(0))
    assert streamed == text.final() == output_text(tok, before, ids) == "bc"


@pytest.mark.parametrize("kind", KINDS)
def test_stop_strings_cut_where_the_whole_decode_first_holds_one(kind, tmp_path):
    rng = np.random.default_rng(1)
    tok = tokenizer(kind, tmp_path)
    checked = 0
    while checked < 100:
        before, ids = prompt(kind, tok, rng), outputs(kind, tok, rng)
        want = whole(tok, before, ids).rstrip("\ufffd")
        if len(want) < 2:
            continue
        stops = ["<never>"]  # and two pieces of the text: the first to appear ends it, whatever their order here
        for _ in range(2):
            at = int(rng.integers(0, len(want) - 1))
            stops.append(want[at: at + int(rng.integers(1, 5))])
        text, streamed = stream(tok, before, ids, stops, rng)
        # the tokens an answer shows: through the one whose text completed a stop string, though the updates
        # read up to 2 more; the text ends before the earliest stop string in theirs
        decode = lambda k: whole(tok, before, ids[:k])  # noqa: E731
        shown = next(k for k in range(1, len(ids) + 1) if any(s in decode(k) for s in stops))
        first = min(decode(shown).index(s) for s in stops if s in decode(shown))
        assert text.finish == "stop" and streamed == text.final() == want[:first], (before, ids, stops)
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
