"""The request schemas alone: strict types, and a bounded cost for the bodies that cost most to parse and
refuse (CPU time of the parsing thread, which holds the interpreter lock: robust to a busy machine, where the
wall time a client sees is not)."""

import gc
import json
import time

import pytest

pytest.importorskip("pydantic")
pytest.importorskip("starlette")

from jlora.server.errors import ApiError  # noqa: E402
from jlora.server.schemas import ChatRequest, CompletionRequest, TokenizeRequest, parse  # noqa: E402

MB = 1 << 20
JUNK = {  # 1 MiB (the default body limit) of the JSON that costs most, each refused or ignored
    "nested lists as the prompt": (CompletionRequest, {"model": "m", "prompt": [[[]]] * (MB // 7)}),
    "an unsupported field of objects": (CompletionRequest,
                                        {"model": "m", "prompt": "x", "logit_bias": [{}] * (MB // 4)}),
    "messages with bad roles": (ChatRequest, {"model": "m", "messages": [{"role": 5, "content": "", "x": [[]]}] * (MB // 41)}),
    "an unknown field of nested lists": (CompletionRequest, {"model": "m", "prompt": "x", "user": [[[]]] * (MB // 7)}),
    "token ids, the last bad": (CompletionRequest, {"model": "m", "prompt": [1] * (MB // 3) + ["x"]}),
}


@pytest.mark.parametrize("case", list(JUNK))
def test_a_megabyte_body_costs_at_most_200ms_of_cpu(case):
    """About 50 ms on an idle core of this machine; `model_validate_json` took 0.9 s for the first case (it
    builds the refused value for its error, once per member of the prompt's union). The collector is paused:
    a full collection of the test worker's heap (JAX, compiled models) once cost 0.6 s here, and is not the
    body's cost."""
    model, body = JUNK[case]
    raw = json.dumps(body).encode()
    assert len(raw) <= MB + 64
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        try:
            parse(model, raw)
        except ApiError as err:
            assert err.status == 400
        spent = time.thread_time() - start
    finally:
        gc.enable()
    assert spent < 0.2


@pytest.mark.parametrize("body, message", [
    ({"model": "m", "prompt": "x", "stream": "false"}, "invalid 'stream'"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.0}, "invalid 'max_tokens'"),
    ({"model": "m", "prompt": "x", "temperature": "1"}, "invalid 'temperature'"),
    ({"model": "m", "prompt": [[1], "a"]}, "'prompt' must be a string, a list of token ids, or a list of at most"),
    ({"model": "m", "prompt": [[1]] * 1025}, "'prompt' must be"),
    ({"model": "m", "prompt": [True]}, "'prompt' must be"),
    ({"model": "m", "prompt": "x", "stop": ["a"] * 17}, "'stop' must be"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "'suffix' is not supported"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "invalid 'logprobs'"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "invalid 'logprobs'"),
    ({"model": "m", "prompt": "x", "n": 0}, "invalid 'n'"),
    ({"model": "m", "prompt": "x", "best_of": 129}, "invalid 'best_of'"),
    ({"prompt": "x"}, "'model' is required"),
    ({"model": "m", "prompt": "x", "cache_salt": ""}, "invalid 'cache_salt'"),
    ({"model": "m", "prompt": "x", "cache_salt": 7}, "invalid 'cache_salt'"),
])
def test_strict_fields(body, message):
    with pytest.raises(ApiError, match=message):
        parse(CompletionRequest, json.dumps(body).encode())


def test_unset_unsupported_fields_and_unknown_fields_pass():
    request = parse(CompletionRequest, json.dumps({"model": "m", "prompt": [1], "echo": False, "logprobs": None,
                                                   "user": {"any": ["thing"]}, "stream_options": {}}).encode())
    assert request.prompt == [1] and request.stream is False


@pytest.mark.parametrize("extra, refused", [
    ({"min_tokens": 0, "use_beam_search": False, "skip_special_tokens": True, "bad_words": [], "prompt_logprobs": None,
      "guided_json": None, "priority": 0, "modalities": ["text"], "chat_template": None, "cache_salt": None}, None),
    ({"chat_template": "{{ 'another prompt' }}"}, "chat_template"), ({"documents": [{"text": "x"}]}, "documents"),
    ({"priority": -1}, "priority"), ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ({"logits_processors": ["m.P"]}, "logits_processors"), ({"vllm_xargs": {"k": 1}}, "vllm_xargs"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"min_tokens": 4}, "min_tokens"),
    ({"use_beam_search": True}, "use_beam_search"), ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"bad_words": ["the"]}, "bad_words"), ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"), ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
])
def test_vllm_fields_jlora_lacks_are_taken_only_at_their_defaults(extra, refused):
    """vLLM's sampling fields, which its clients send in extra_body, change what is sampled: a value other than
    the default is refused, naming the field, not sampled as if it were absent."""
    for model in (CompletionRequest, ChatRequest):
        body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}], **extra}
        if refused is None:
            parse(model, json.dumps(body).encode())
        else:
            with pytest.raises(ApiError, match=f"'{refused}' is not supported by this server"):
                parse(model, json.dumps(body).encode())


def test_fields_that_change_the_chat_prompt_are_refused_in_chat_and_tokenize():
    """A request's own chat template or documents would render another prompt than the model's template: refused,
    also by /tokenize; so is chat's echo (vLLM's: the last message before the answer), which completions have."""
    messages = [{"role": "user", "content": "x"}]
    for model, extra in [(ChatRequest, {"chat_template": "{{ 'x' }}"}), (TokenizeRequest, {"chat_template": "x"}),
                         (TokenizeRequest, {"documents": [{"text": "x"}]}), (ChatRequest, {"echo": True})]:
        with pytest.raises(ApiError, match=f"'{next(iter(extra))}' is not supported by this server"):
            parse(model, json.dumps({"model": "m", "messages": messages, **extra}).encode())
    assert parse(CompletionRequest, json.dumps({"model": "m", "prompt": "x", "echo": True}).encode()).echo


@pytest.mark.parametrize("extra, message", [
    ({"top_k": -2}, "invalid 'top_k'"), ({"top_k": 2**31}, "invalid 'top_k'"), ({"top_k": 1.0}, "invalid 'top_k'"),
    ({"min_p": 1.5}, "invalid 'min_p'"), ({"min_p": -0.1}, "invalid 'min_p'"), ({"min_p": "0.1"}, "invalid 'min_p'"),
])
def test_top_k_and_min_p_are_checked(extra, message):
    for top_k, min_p in ((-1, 0), (0, 0.0), (50, 0.05), (None, None)):  # vLLM's off values and real ones
        parse(CompletionRequest, json.dumps({"model": "m", "prompt": "x", "top_k": top_k, "min_p": min_p}).encode())
    with pytest.raises(ApiError, match=message):
        parse(CompletionRequest, json.dumps({"model": "m", "prompt": "x", **extra}).encode())
