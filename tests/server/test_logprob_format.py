"""The OpenAI `logprobs` objects: alternatives of one text keep the more likely one's value (they come most likely
first), a log-probability of -inf (a token of another adapter's added vocabulary) is written as vLLM writes it,
-9999.0, so that the body stays JSON, and the legacy object's text offsets add up the tokens' texts."""

import json
import math

from jlora.logprobs import TokenLogprob
from jlora.server.logprob_format import TokenTexts, chat_logprobs, completion_logprobs
from tests.server.test_text import byte_level, word_level


def test_one_text_keeps_the_more_likely_value_and_minus_infinity_stays_json():
    texts = TokenTexts(byte_level())
    lone = [i for i in range(256) if texts(i) == "\ufffd"][:2]  # two continuation bytes: each alone is U+FFFD
    a, b = (next(i for i in range(256) if texts(i) == c) for c in "ab")
    lp = TokenLogprob(b, -math.inf, ((lone[1], -0.25), (lone[0], -0.5), (a, -1.0), (b, -math.inf)))
    legacy = completion_logprobs([(a, None), (b, lp)], texts, offset=3)
    assert legacy == {"tokens": ["a", "b"], "token_logprobs": [None, -9999.0], "text_offset": [3, 4],
                      "top_logprobs": [None, {"\ufffd": -0.25, "a": -1.0, "b": -9999.0}]}
    chat = chat_logprobs([lp], texts)["content"][0]
    assert (chat["token"], chat["logprob"], chat["bytes"]) == ("b", -9999.0, [98])
    assert [(t["token"], t["logprob"]) for t in chat["top_logprobs"]] == [
        ("\ufffd", -0.25), ("\ufffd", -0.5), ("a", -1.0), ("b", -9999.0)]  # chat lists every alternative
    json.dumps([legacy, chat], allow_nan=False)


def test_the_text_offsets_add_up_the_tokens_texts(tmp_path):
    tok = word_level(tmp_path)
    texts, ids = TokenTexts(tok), [tok.token_to_id(w) for w in ("the", "quick", "fox")]
    legacy = completion_logprobs([(i, TokenLogprob(i, -1.0)) for i in ids], texts, offset=10)
    assert legacy["tokens"] == ["the", "quick", "fox"] and legacy["text_offset"] == [10, 13, 18]
