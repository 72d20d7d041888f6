"""The OpenAI-compatible HTTP API over an `OnlineEngine` (a Starlette app, served by uvicorn).

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events or not), GET
/v1/models, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with `allow_runtime_lora`), GET
/health, GET /metrics. The OpenAI `model` field names the served base model or a loaded adapter. Errors
answer 4xx (or 503 when the queue is full) with OpenAI's error body, and the server keeps serving.
Beyond OpenAI's fields, every choice (and streamed chunk) carries `token_ids`, the generated token ids (as
vLLM's `return_token_ids`), and requests may give `stop_token_ids` and `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jlora.adapters import AdapterError, PoolFullError
from jlora.scheduler import Request
from jlora.server.chat import ChatTemplate, ChatTemplateError
from jlora.server.online import OnlineEngine, QueueFull
from jlora.server.text import StreamText

__all__ = ["ApiError", "build_app"]

# Fields of the OpenAI request bodies we do not implement: a request that sets one is refused, naming it.
_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "tool_choice",
                "functions", "function_call", "response_format", "presence_penalty", "frequency_penalty")


class ApiError(Exception):
    """An error answered to the client: HTTP status, message, OpenAI error type and the offending param."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class _Api:
    """The routes' shared state: the online engine, names, chat template, stop tokens."""

    def __init__(self, online: OnlineEngine, *, served_model_name: str, chat: ChatTemplate,
                 eos_token_ids: frozenset[int], api_key: str | None, adapter_paths: dict[str, str]):
        self.online = online
        self.engine = online.engine
        self.name = served_model_name
        self.chat = chat
        self.eos = eos_token_ids
        self.api_key = api_key
        self.adapter_paths = adapter_paths  # name -> directory, for /v1/models

    # --- request parsing -------------------------------------------------------------------------------
    async def body(self, request: HTTPRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not valid JSON ({err})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def adapter_of(self, body: dict) -> str | None:
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' is required: the served model name or an adapter name", "model")
        if model == self.name:
            return None
        if model in self.engine.adapters:
            return model
        raise ApiError(404, f"the model {model!r} does not exist; served: {[self.name, *self.engine.adapters]}",
                       "model", "NotFoundError")

    def sampling(self, body: dict, prompt: list[int]) -> dict:
        """Request settings from the body, checked: max_new, temperature, top_p, seed, stop ids, stop strings."""
        for field in _UNSUPPORTED:
            if body.get(field) not in (None, False, 0):
                raise ApiError(400, f"'{field}' is not supported by this server", field)
        if body.get("n", 1) != 1:
            raise ApiError(400, "'n' must be 1: one choice per request is supported", "n")
        room = self.engine.max_seq_len - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the maximum context is "
                                f"{self.engine.max_seq_len} tokens", "messages" if "messages" in body else "prompt")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = (16 if "messages" not in body else room) if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}", "max_tokens")
        if max_tokens > room:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"maximum context of {self.engine.max_seq_len} tokens", "max_tokens")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0:
            raise ApiError(400, "'top_p' must be in (0, 1]", "top_p")
        seed = body.get("seed")
        if seed is None:
            seed = uuid.uuid4().int % 2**32
        elif not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
            raise ApiError(400, f"'seed' must be an integer in [0, 2**32), got {seed!r}", "seed")
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in stop):
            raise ApiError(400, "'stop' must be a string or a list of strings (or token ids)", "stop")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
            raise ApiError(400, "'stop_token_ids' must be a list of token ids", "stop_token_ids")
        ids = frozenset(stop_ids) | {s for s in stop if isinstance(s, int)}
        if not body.get("ignore_eos", False):
            ids |= self.eos
        strings = [s for s in stop if isinstance(s, str) and s]
        if strings and self.engine.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer; the model directory has no tokenizer.json", "stop")
        return dict(max_new=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=ids, strings=strings)

    def encode_prompt(self, prompt, adapter: str | None) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ApiError(400, "text prompts need a tokenizer; the model directory has no tokenizer.json; "
                                    "send token ids", "prompt")
            ids = self.engine.tokenizer.encode(prompt).ids
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        try:
            vocab = self.engine.vocab_size(adapter)  # the base vocabulary and the adapter's added tokens
        except KeyError:
            raise ApiError(404, f"the model {adapter!r} does not exist", "model", "model_not_found") from None
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"the prompt has token ids outside [0, {vocab})", "prompt")
        return list(ids)

    # --- generation --------------------------------------------------------------------------------------
    async def run(self, http: HTTPRequest, prompt: list[int], adapter: str | None, settings: dict,
                  chat: bool, stream: bool) -> Response:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        strings = settings.pop("strings")
        woken = threading.Event()  # an update is on its way to the event loop: later ones ride along

        def wake() -> None:
            woken.clear()
            updates.put_nowait(None)

        def on_update(r: Request) -> None:  # on the engine thread, after every token
            if not woken.is_set():
                woken.set()
                loop.call_soon_threadsafe(wake)

        request = Request(prompt, -1, **settings, on_update=on_update)
        try:
            self.online.submit(request, adapter)
        except QueueFull as err:
            raise ApiError(503, f"the server is busy: {err}; retry later", kind="server_error",
                           headers={"Retry-After": "1"}) from None
        text = StreamText(self.engine.tokenizer, strings)
        meta = dict(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                    model=adapter or self.name)
        if stream:
            return StreamingResponse(self._stream(http, request, updates, text, meta, chat),
                                     media_type="text/event-stream")
        try:
            while not await _finished(http, request, updates, text):
                pass
        finally:
            if request.finish is None:
                self.online.cancel(request)  # the client went away
        if request.finish in ("error", "failed"):
            raise _request_error(request)
        finish = text.finish or _finish_reason(request)
        usage = _usage(request)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text.final()}, "finish_reason": finish,
                      "token_ids": list(request.out)}
            return JSONResponse({**meta, "object": "chat.completion", "choices": [choice], "usage": usage})
        choice = {"index": 0, "text": text.final(), "logprobs": None, "finish_reason": finish,
                  "token_ids": list(request.out)}
        return JSONResponse({**meta, "object": "text_completion", "choices": [choice], "usage": usage})

    async def _stream(self, http, request: Request, updates, text: StreamText, meta: dict, chat: bool
                      ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, finish: str | None, ids: list[int], usage: dict | None = None) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids}
            else:
                choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish, "token_ids": ids}
            body = {**meta, "object": kind, "choices": [choice]}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:  # the first chunk names the role
                role = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}
                yield f"data: {json.dumps({**meta, 'object': kind, 'choices': [role]})}\n\n"
            sent = 0  # tokens reported so far
            while True:
                done = await _finished(http, request, updates, text)
                if request.finish in ("error", "failed"):
                    yield f"data: {_request_error(request).response().body.decode()}\n\n"
                    break
                piece, ids = text.take(), request.out[sent:]
                sent += len(ids)
                if piece or ids:
                    yield chunk(piece, None, ids)
                if done:
                    yield chunk(None, text.finish or _finish_reason(request), [], _usage(request))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if request.finish is None:
                self.online.cancel(request)  # the client disconnected mid-stream: its row frees at once


async def _finished(http: HTTPRequest, request: Request, updates: asyncio.Queue, text: StreamText) -> bool:
    """Waits for the request's next update (or the client's disconnect); True once it has ended, for a stop
    string too (then the request is cancelled: no more tokens are needed)."""
    while True:
        try:
            await asyncio.wait_for(updates.get(), timeout=0.5)
            break
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                raise asyncio.CancelledError("the client disconnected") from None
    while not updates.empty():
        updates.get_nowait()
    done = request.finish is not None
    return text.update(request.out, done) or done  # the caller cancels a request a stop string ended


def _request_error(request: Request) -> ApiError:
    """The error of a request refused at intake (its adapter gone: 404) or failed in the engine (500)."""
    if request.finish == "error":
        return ApiError(404, request.error, "model", "NotFoundError")
    return ApiError(500, request.error, kind="server_error")


def _finish_reason(request: Request) -> str:
    return "length" if request.finish == "length" else "stop"


def _usage(request: Request) -> dict:
    n, m = len(request.prompt), len(request.out)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _number(body: dict, field: str, default: float, low: float, high: float) -> float:
    value = body.get(field, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ApiError(400, f"'{field}' must be a number in [{low}, {high}], got {value!r}", field)
    return float(value)


def build_app(online: OnlineEngine, *, served_model_name: str, chat: ChatTemplate, eos_token_ids=frozenset(),
              api_key: str | None = None, allow_runtime_lora: bool = False,
              adapter_paths: dict[str, str] | None = None) -> Starlette:
    """The Starlette app serving `online` (started and stopped with the app)."""
    api = _Api(online, served_model_name=served_model_name, chat=chat, eos_token_ids=frozenset(eos_token_ids),
               api_key=api_key, adapter_paths=dict(adapter_paths or {}))

    def handler(fn):
        async def wrapped(request: HTTPRequest) -> Response:
            if api.api_key is not None and request.url.path != "/health":
                if request.headers.get("authorization") != f"Bearer {api.api_key}":
                    return ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                    kind="authentication_error").response()
            try:
                return await fn(request)
            except ApiError as err:
                return err.response()
        return wrapped

    async def completions(request: HTTPRequest) -> Response:
        body = await api.body(request)
        adapter = api.adapter_of(body)
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", "prompt")
        prompt = api.encode_prompt(body["prompt"], adapter)
        return await api.run(request, prompt, adapter, api.sampling(body, prompt), False, bool(body.get("stream")))

    async def chat_completions(request: HTTPRequest) -> Response:
        body = await api.body(request)
        adapter = api.adapter_of(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        if api.engine.tokenizer is None:
            raise ApiError(400, "chat needs a tokenizer; the model directory has no tokenizer.json", "messages")
        try:
            text = api.chat.render(messages)
        except ChatTemplateError as err:
            raise ApiError(400, str(err), "messages") from None
        prompt = api.engine.tokenizer.encode(text, add_special_tokens=False).ids
        if not prompt:
            raise ApiError(400, "the rendered chat prompt is empty", "messages")
        return await api.run(request, prompt, adapter, api.sampling(body, prompt), True, bool(body.get("stream")))

    async def models(request: HTTPRequest) -> Response:
        created = int(time.time())
        data = [{"id": api.name, "object": "model", "created": created, "owned_by": "jlora", "root": api.name,
                 "parent": None}]
        for name in api.engine.adapters:
            data.append({"id": name, "object": "model", "created": created, "owned_by": "jlora",
                         "root": api.adapter_paths.get(name, name), "parent": api.name})
        return JSONResponse({"object": "list", "data": data})

    async def load_lora(request: HTTPRequest) -> Response:
        body = await api.body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "'lora_name' and 'lora_path' are required strings")
        if name == api.name:
            raise ApiError(400, f"{name!r} is the served base model's name", "lora_name")

        def load():
            before = set(api.engine.adapters)
            api.engine.load_adapter(name, path)
            return before - set(api.engine.adapters)

        try:
            evicted = await asyncio.wrap_future(online.call(load))
        except AdapterError as err:
            raise ApiError(400, str(err), "lora_path") from None
        except PoolFullError as err:
            raise ApiError(409, str(err), "lora_name", "conflict_error") from None
        except ValueError as err:  # already loaded
            raise ApiError(400, str(err), "lora_name") from None
        online.metrics.adapter_loads.inc()
        online.metrics.adapter_evictions.inc(len(evicted))
        for gone in evicted:
            api.adapter_paths.pop(gone, None)
        api.adapter_paths[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request: HTTPRequest) -> Response:
        body = await api.body(request)
        name = body.get("lora_name")
        if not isinstance(name, str):
            raise ApiError(400, "'lora_name' is required", "lora_name")
        try:
            await asyncio.wrap_future(online.call(lambda: api.engine.unload_adapter(name)))
        except KeyError:
            raise ApiError(404, f"the adapter {name!r} is not loaded", "lora_name", "NotFoundError") from None
        except RuntimeError as err:
            raise ApiError(409, f"{err}; retry when they finish", "lora_name", "conflict_error") from None
        api.adapter_paths.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(request: HTTPRequest) -> Response:
        return PlainTextResponse("ok")

    async def metrics(request: HTTPRequest) -> Response:
        return Response(generate_latest(online.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: HTTPRequest, exc) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", kind="NotFoundError").response()

    async def not_allowed(request: HTTPRequest, exc) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    routes = [Route("/v1/completions", handler(completions), methods=["POST"]),
              Route("/v1/chat/completions", handler(chat_completions), methods=["POST"]),
              Route("/v1/models", handler(models), methods=["GET"]),
              Route("/health", handler(health), methods=["GET"]),
              Route("/metrics", handler(metrics), methods=["GET"])]
    if allow_runtime_lora:
        routes += [Route("/v1/load_lora_adapter", handler(load_lora), methods=["POST"]),
                   Route("/v1/unload_lora_adapter", handler(unload_lora), methods=["POST"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        online.start()
        try:
            yield
        finally:
            online.stop()

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed}, lifespan=lifespan)
