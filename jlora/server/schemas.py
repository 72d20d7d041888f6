"""The request bodies as strict pydantic models, parsed straight from the body's bytes.

pydantic's JSON parser bounds nesting (200 levels) and numbers (4300 digits), and refuses invalid UTF-8 and
lone surrogates; strict mode takes no string for a number or a boolean ("stream": "false" is an error, not
true). Every failure becomes a 400 `ApiError` naming the field. Fields beyond OpenAI's that vLLM also takes:
`stop_token_ids`, `ignore_eos`.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jlora.server.errors import ApiError

__all__ = ["ChatRequest", "CompletionRequest", "LoadLoraRequest", "UnloadLoraRequest", "parse"]

# Fields of the OpenAI request bodies we do not implement: a request that sets one is refused, naming it.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "tool_choice",
               "functions", "function_call", "response_format", "presence_penalty", "frequency_penalty")
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, frozen=True, extra="allow")


class _Generation(_Strict):
    """What completions and chat share: the model (or adapter) and the sampling settings."""

    model: str
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: Any = None  # a string, or a list of strings and token ids: checked where it is used
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    n: int = 1

    def unsupported(self) -> str | None:
        """The first unsupported field the request sets (to anything but null, false or 0), if any."""
        return next((f for f in UNSUPPORTED if (self.model_extra or {}).get(f) not in (None, False, 0)), None)


class CompletionRequest(_Generation):
    prompt: Any  # a string or token ids (or a batch of one of either): checked where it is encoded


class ChatMessage(_Strict):
    role: str
    content: str


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)


class LoadLoraRequest(_Strict):
    lora_name: str
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(_Strict):
    lora_name: str


Model = TypeVar("Model", bound=BaseModel)


def parse(model: type[Model], body: bytes) -> Model:
    """`body` parsed into `model`; a 400 `ApiError` naming the first problem otherwise."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
    if first["type"] == "json_invalid":
        raise ApiError(400, f"the request body is not valid JSON: {first['ctx']['error']}")
    loc = [str(part) for part in first["loc"]]
    if not loc:
        raise ApiError(400, "the request body must be a JSON object")
    field = ".".join(loc)
    if first["type"] == "missing":
        raise ApiError(400, f"'{field}' is required", loc[0])
    raise ApiError(400, f"invalid '{field}': {first['msg']}", loc[0])
