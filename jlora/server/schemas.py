"""The request bodies as strict pydantic models, parsed straight from the body's bytes.

pydantic's JSON parser bounds nesting (200 levels) and numbers (4300 digits), and refuses invalid UTF-8 and
lone surrogates; strict mode takes no string for a number or a boolean ("stream": "false" is an error, not
true), and lists of token ids stop at their first bad element. Every failure becomes a 400 `ApiError` naming
the field. Fields beyond OpenAI's that vLLM also takes: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `add_special_tokens`, `cache_salt`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from typing_extensions import TypedDict

from jlora.logprobs import MAX_TOP_LOGPROBS
from jlora.server.errors import ApiError

__all__ = ["ChatRequest", "CompletionRequest", "DetokenizeRequest", "LoadLoraRequest", "TokenizeRequest",
           "UnloadLoraRequest", "parse"]

MAX_PROMPTS = 1024  # prompts in one completions request
MAX_N = 128  # choices per prompt (n, best_of)
# Fields of the OpenAI request bodies, and vLLM's sampling fields that its clients send (`extra_body`), that we do
# not implement: a request that sets one to anything but its unset values (null, false or 0 unless said) is
# refused, naming it, rather than sampled as if it were not there.
UNSUPPORTED = ("suffix", "logit_bias", "tools", "tool_choice", "functions", "function_call", "response_format",
               "min_tokens", "audio", "modalities",
               "use_beam_search", "length_penalty", "include_stop_str_in_output", "skip_special_tokens",
               "spaces_between_special_tokens", "prompt_logprobs", "truncate_prompt_tokens", "allowed_token_ids",
               "bad_words", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
               "structural_tag", "logits_processors", "return_tokens_as_token_ids", "prompt_embeds", "priority",
               "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs",
               "chat_template", "documents")  # the prompt the model's template renders is the only one
# What a field of a union type must be: its message when the body's value fits none of the forms (N: any index).
_FORMS = {"prompt": f"a string, a list of token ids, or a list of at most {MAX_PROMPTS} of either",
          "stop": "a string or a list of at most 16 strings (of at most 1024 characters) or token ids",
          "messages.N.content": "a string or a list of text parts ({'type': 'text', 'text': ...}), at least one"}
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Ids = Annotated[list[int], Field(fail_fast=True)]  # the prompt's: ranges are checked against the vocabulary
StopString = Annotated[str, Field(max_length=1024)]
Off = Literal[None, False, 0]  # an unsupported field left unset: anything else is refused without being built


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, frozen=True, extra="ignore")


class _TextFormat(TypedDict):
    type: Literal["text"]


class StreamOptions(TypedDict, total=False):
    """A streamed request's options: with include_usage, a last chunk with no choices carries the usage."""

    include_usage: bool


# The unsupported fields, each typed to take only its unset values: response_format also its default, plain text
# (which some clients always send); vLLM's fields their defaults.
_Unsupported = create_model("_Unsupported", __base__=_Strict, **{
    **{f: (Off, None) for f in UNSUPPORTED}, "response_format": (Off | _TextFormat, None),
    "length_penalty": (Annotated[float, Field(ge=1, le=1)] | None, None),
    "skip_special_tokens": (Literal[None, True], None), "spaces_between_special_tokens": (Literal[None, True], None),
    "bad_words": (Literal[None] | Annotated[list, Field(max_length=0)], None),
    "modalities": (Literal[None] | list[Literal["text"]], None),
    "prompt_logprobs": (Literal[None], None), "truncate_prompt_tokens": (Literal[None], None)})


class _Generation(_Unsupported):
    """What completions and chat share: the model (or adapter) and the sampling settings."""

    model: str
    max_tokens: int | None = Field(None, ge=0, lt=2**31)  # 0: only with echo (scoring the prompt)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # vLLM's: -1 or 0 is off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)  # vLLM's range
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: StopString | Annotated[list[StopString | TokenId], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(fail_fast=True)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM's: the prefix cache per salt


class CompletionRequest(_Generation):
    prompt: (str | Ids | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Ids], Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy form: the top k per token
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True  # a text prompt's BOS (the tokenizer's special tokens)


class ContentPart(TypedDict, total=False):
    """A part of a message's content as OpenAI's clients send it; only text parts are taken (checked where the
    messages are rendered, so that the error can say so)."""

    type: str
    text: str


class ChatMessage(TypedDict):  # a dict, not a model: 3x cheaper to build per message
    role: str
    content: str | Annotated[list[ContentPart], Field(min_length=1, fail_fast=True)]


class _ChatOptions(_Strict):
    """How messages are rendered: `jlora.chat.ChatOptions`'s fields."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Off = None  # the model's template renders, never a request's (`UNSUPPORTED`)
    documents: Off = None


class ChatRequest(_Generation, _ChatOptions):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = False  # the tokenizer's special tokens before the rendered prompt (vLLM's default)
    echo: Off = None  # vLLM's: the last message's content before the answer
    unsupported: ClassVar[tuple[str, ...]] = ("echo",)  # refused as `UNSUPPORTED`'s are, in chat only


class TokenizeRequest(_ChatOptions):
    """vLLM's /tokenize: a text, or chat messages rendered by the chat template."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, fail_fast=True)
    add_special_tokens: bool | None = None  # None: vLLM's default, True for a prompt and False for messages


class DetokenizeRequest(_Strict):
    tokens: Ids


class LoadLoraRequest(_Strict):
    lora_name: str
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(_Strict):
    lora_name: str


Model = TypeVar("Model", bound=BaseModel)


def parse(model: type[Model], body: bytes) -> Model:
    """`body` parsed into `model`; a 400 `ApiError` naming the first problem otherwise.

    The JSON is parsed first, then validated: `model_validate_json` is faster on good bodies, but a refused
    value of a megabyte cost it up to 0.9 s with the interpreter lock held (building the value for its
    error, once per member of a union); this way a body costs about 50 ms per megabyte at most.
    """
    try:
        value = pydantic_core.from_json(body)
    except ValueError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    try:
        return model.model_validate(value)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
    loc = [str(part) for part in first["loc"]]
    if not loc:
        raise ApiError(400, "the request body must be a JSON object")
    field = ".".join(loc)
    if first["type"] == "missing":
        raise ApiError(400, f"'{field}' is required", loc[0])
    if loc[0] in UNSUPPORTED + getattr(model, "unsupported", ()):
        raise ApiError(400, f"'{loc[0]}' is not supported by this server", loc[0])
    pattern = ["N" if part.isdigit() else part for part in loc]
    for form, what in _FORMS.items():
        if pattern[:form.count(".") + 1] == form.split("."):
            raise ApiError(400, f"'{'.'.join(loc[:form.count('.') + 1])}' must be {what}", loc[0])
    raise ApiError(400, f"invalid '{field}': {first['msg']}", loc[0])
