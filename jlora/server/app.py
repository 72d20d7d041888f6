"""The OpenAI-compatible HTTP API over an `OnlineEngine` (a Starlette app, served by uvicorn).

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events or not), GET
/v1/models, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with `allow_runtime_lora`), GET
/health, GET /metrics. The OpenAI `model` field names the served base model or a loaded adapter. Errors
answer 4xx (or 503 when the queue is full) with OpenAI's error body, and the server keeps serving; an
unexpected exception answers a JSON 500 with a request id, its traceback going only to the log.

A request's cost is bounded before any heavy work: its body by `max_body_bytes` while it is read, a text
prompt by its characters before it is tokenized; parsing, chat rendering and tokenizing run on worker
threads, so the event loop (and /health) stays responsive. A client that disconnects cancels its request,
streamed or not, and its row frees before the engine's next step.
Beyond OpenAI's fields, every choice (and streamed chunk) carries `token_ids`, the generated token ids (as
vLLM's `return_token_ids`), and requests may give `stop_token_ids` and `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jlora.adapters import AdapterError, check_adapter_name
from jlora.scheduler import Request
from jlora.server.chat import ChatTemplate, ChatTemplateError
from jlora.server.config import ServerConfig
from jlora.server.errors import ApiError
from jlora.server.online import OnlineEngine, QueueFull
from jlora.server.schemas import ChatRequest, CompletionRequest, LoadLoraRequest, UnloadLoraRequest, parse
from jlora.server.text import StreamText

__all__ = ["build_app"]

logger = logging.getLogger("jlora.server")


class _Api:
    """The routes' shared state and request handling: the online engine, options, chat template, stop tokens."""

    def __init__(self, online: OnlineEngine, config: ServerConfig, chat: ChatTemplate, eos_token_ids: frozenset[int]):
        self.online = online
        self.engine = online.engine
        self.config = config
        self.name = config.served_model_name
        self.chat = chat
        self.eos = eos_token_ids
        self.key = None if config.api_key is None else f"Bearer {config.api_key}".encode()
        tokenizer = self.engine.tokenizer
        # A text longer than this has more than max_seq_len tokens whatever it holds (a token covers at most its
        # vocabulary string's characters), so it is refused before any tokenizing.
        longest = 0 if tokenizer is None else max(map(len, tokenizer.get_vocab()), default=0)
        self.max_prompt_chars = self.engine.max_seq_len * max(16, longest)
        self.loads_in_progress = 0

    def authorized(self, http: HTTPRequest) -> bool:
        given = http.headers.get("authorization", "").encode("latin-1")  # as the header's bytes arrived
        return self.key is None or hmac.compare_digest(given, self.key)

    # --- request parsing (off the event loop but for the body's reading) -----------------------------------
    async def read_body(self, http: HTTPRequest) -> bytes:
        """The request's body, refused (413) once it passes max_body_bytes and (408) after body_timeout."""
        limit = self.config.max_body_bytes
        declared = http.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or len(declared) > 18 or int(declared) > limit):
            raise ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.config.body_timeout):
                async for chunk in http.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)")
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout:g} s") from None
        except ClientDisconnect:  # nobody hears the answer; it only keeps the log free of a traceback
            raise ApiError(400, "the client disconnected while sending the body") from None
        return b"".join(chunks)

    def adapter_of(self, model: str) -> str | None:
        if model == self.name:
            return None
        if model in self.engine.registry:
            return model
        raise ApiError(404, f"the model {_quoted(model)} does not exist; GET /v1/models lists them", "model",
                       "NotFoundError")

    def prepare_completion(self, body: bytes) -> _Prepared:
        request = parse(CompletionRequest, body)
        adapter = self.adapter_of(request.model)
        prompt = self.encode_prompt(request.prompt, adapter)
        return _Prepared(prompt, adapter, self.sampling(request, prompt, "prompt"), request.stream)

    def prepare_chat(self, body: bytes) -> _Prepared:
        request = parse(ChatRequest, body)
        adapter = self.adapter_of(request.model)
        if self.engine.tokenizer is None:
            raise ApiError(400, "chat needs a tokenizer; the model directory has no tokenizer.json", "messages")
        if sum(len(m["content"]) for m in request.messages) > self.max_prompt_chars:
            raise ApiError(400, f"the messages are longer than the maximum context of {self.engine.max_seq_len} "
                                "tokens can hold", "messages")
        try:
            text = self.chat.render(request.messages)
        except ChatTemplateError as err:
            raise ApiError(400, str(err), "messages") from None
        prompt = self.tokenize(text, "messages", add_special_tokens=False)
        if not prompt:
            raise ApiError(400, "the rendered chat prompt is empty", "messages")
        return _Prepared(prompt, adapter, self.sampling(request, prompt, "messages"), request.stream)

    def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"the {param} has {len(text)} characters, more than the maximum context of "
                                f"{self.engine.max_seq_len} tokens can hold", param)
        # encode_batch releases the interpreter lock (encode holds it), so the event loop runs meanwhile
        return self.engine.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def sampling(self, request: CompletionRequest | ChatRequest, prompt: list[int], param: str) -> dict:
        """Request settings, checked against the prompt: max_new, temperature, top_p, seed, stop ids, stop strings."""
        if request.n != 1:
            raise ApiError(400, "'n' must be 1: one choice per request is supported", "n")
        room = self.engine.max_seq_len - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the maximum context is "
                                f"{self.engine.max_seq_len} tokens", param)
        max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
        max_tokens = (room if isinstance(request, ChatRequest) else 16) if max_tokens is None else max_tokens
        if max_tokens > room:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"maximum context of {self.engine.max_seq_len} tokens", "max_tokens")
        stop = [] if request.stop is None else [request.stop] if isinstance(request.stop, str) else request.stop
        ids = frozenset(request.stop_token_ids or ()) | {s for s in stop if isinstance(s, int)}
        if not request.ignore_eos:
            ids |= self.eos
        strings = [s for s in stop if isinstance(s, str) and s]
        if strings and self.engine.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer; the model directory has no tokenizer.json", "stop")
        seed = uuid.uuid4().int % 2**32 if request.seed is None else request.seed
        return dict(max_new=max_tokens, temperature=1.0 if request.temperature is None else request.temperature,
                    top_p=1.0 if request.top_p is None else request.top_p, seed=seed, stop=ids, strings=strings)

    def encode_prompt(self, prompt: str | list, adapter: str | None) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one (the schema allows no more)
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ApiError(400, "text prompts need a tokenizer; the model directory has no tokenizer.json; "
                                    "send token ids", "prompt")
            ids = self.tokenize(prompt, "prompt")
        else:
            ids = prompt
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        try:
            vocab = self.engine.vocab_size(adapter)  # the base vocabulary and the adapter's added tokens
        except KeyError:
            raise ApiError(404, f"the model {adapter!r} does not exist", "model", "NotFoundError") from None
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"the prompt has token ids outside [0, {vocab})", "prompt")
        return list(ids)

    # --- generation --------------------------------------------------------------------------------------
    async def run(self, http: HTTPRequest, prepared: _Prepared, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        settings = dict(prepared.settings)
        strings = settings.pop("strings")
        woken = threading.Event()  # an update is on its way to the event loop: later ones ride along

        def wake() -> None:
            woken.clear()
            updates.put_nowait(None)

        def on_update(r: Request) -> None:  # on the engine thread, after every token
            if not woken.is_set():
                woken.set()
                loop.call_soon_threadsafe(wake)

        request = Request(prepared.prompt, -1, **settings, on_update=on_update)
        try:
            self.online.submit(request, prepared.adapter)
        except QueueFull as err:
            raise ApiError(503, f"the server is busy: {err}; retry later", kind="server_error",
                           headers={"Retry-After": "1"}) from None
        text = StreamText(self.engine.tokenizer, strings)
        meta = dict(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                    model=prepared.adapter or self.name)
        if prepared.stream:  # Starlette cancels the stream when its client disconnects
            return StreamingResponse(self._stream(request, updates, text, meta, chat), media_type="text/event-stream")
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, request))
        try:
            while not await _finished(request, updates, text):
                pass
        finally:
            watcher.cancel()
            if request.finish is None:
                self.online.cancel(request)  # a stop string ended it, or this handler was cancelled
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

    async def _cancel_on_disconnect(self, http: HTTPRequest, request: Request) -> None:
        """Cancels `request` as soon as its client disconnects (the body is read, so the next message the
        server gets for it is the disconnect): its row frees before the engine's next step."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self.online.cancel(request)

    async def _stream(self, request: Request, updates, text: StreamText, meta: dict, chat: bool
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
                done = await _finished(request, updates, text)
                if request.finish in ("error", "failed"):
                    yield f"data: {json.dumps(_request_error(request).body())}\n\n"
                    break
                piece, ids = text.take(), request.out[sent:]
                sent += len(ids)
                if piece or ids:
                    yield chunk(piece, None, ids)
                if done:
                    yield chunk(None, text.finish or _finish_reason(request), [], _usage(request))
                    break
            yield "data: [DONE]\n\n"
        except Exception as err:  # the status line has gone out: the error travels as the stream's last event
            yield f"data: {json.dumps(_internal_error(err).body())}\n\n"
        finally:
            if request.finish is None:
                self.online.cancel(request)  # the client disconnected mid-stream: its row frees at once


async def _finished(request: Request, updates: asyncio.Queue, text: StreamText) -> bool:
    """Waits for the request's next update; True once it has ended, for a stop string too (then the request is
    cancelled: no more tokens are needed)."""
    await updates.get()
    while not updates.empty():
        updates.get_nowait()
    done = request.finish is not None
    return text.update(request.out, done) or done  # the caller cancels a request a stop string ended


def _quoted(text: str) -> str:
    """A client's string in a message: quoted, at most 80 characters (a name may be a megabyte long)."""
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _internal_error(err: Exception) -> ApiError:
    """A 500 for an unexpected exception: the traceback goes to the log under a request id the client is told."""
    request_id = uuid.uuid4().hex
    logger.error("request %s failed", request_id, exc_info=err)
    return ApiError(500, f"internal server error (request id {request_id}; the server's log has the details)",
                    kind="server_error")


def _request_error(request: Request) -> ApiError:
    """The error of a request refused at intake (404: its adapter is not registered; 400: bad input) or failed
    in the engine or while its adapter loaded (500)."""
    if request.finish == "error":
        status = request.status or 400
        return ApiError(status, request.error, "model" if status == 404 else "prompt",
                        "NotFoundError" if status == 404 else "invalid_request_error")
    return ApiError(500, request.error, kind="server_error")


def _finish_reason(request: Request) -> str:
    return "length" if request.finish == "length" else "stop"


def _usage(request: Request) -> dict:
    n, m = len(request.prompt), len(request.out)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A generation request parsed and checked: its prompt's token ids, adapter and settings."""

    prompt: list[int]
    adapter: str | None
    settings: dict  # Request's fields (max_new, temperature, top_p, seed, stop) and the stop strings
    stream: bool


def build_app(online: OnlineEngine, config: ServerConfig, *, chat: ChatTemplate,
              eos_token_ids: frozenset[int] = frozenset()) -> Starlette:
    """The Starlette app serving `online` (started and stopped with the app). `config.served_model_name` must
    be set."""
    if not config.served_model_name:
        raise ValueError("config.served_model_name must be set")
    api = _Api(online, config, chat, frozenset(eos_token_ids))

    def handler(fn):
        async def wrapped(request: HTTPRequest) -> Response:
            if request.url.path != "/health" and not api.authorized(request):
                return ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                kind="authentication_error").response()
            try:
                return await fn(request)
            except ApiError as err:
                return err.response()
            except Exception as err:  # a bug, not the client's input: a JSON 500, the traceback to the log
                return _internal_error(err).response()
        return wrapped

    async def completions(request: HTTPRequest) -> Response:
        body = await api.read_body(request)
        return await api.run(request, await asyncio.to_thread(api.prepare_completion, body), chat=False)

    async def chat_completions(request: HTTPRequest) -> Response:
        body = await api.read_body(request)
        return await api.run(request, await asyncio.to_thread(api.prepare_chat, body), chat=True)

    async def models(request: HTTPRequest) -> Response:
        created = int(time.time())
        data = [{"id": api.name, "object": "model", "created": created, "owned_by": "jlora", "root": api.name,
                 "parent": None}]
        for name in api.engine.adapters:
            data.append({"id": name, "object": "model", "created": created, "owned_by": "jlora", "root": name,
                         "parent": api.name})
        return JSONResponse({"object": "list", "data": data})

    async def load_lora(request: HTTPRequest) -> Response:
        body = parse(LoadLoraRequest, await api.read_body(request))
        name = body.lora_name
        try:
            check_adapter_name(name)
        except ValueError as err:
            raise ApiError(400, str(err), "lora_name") from None
        try:
            path = config.resolve_lora_path(body.lora_path)
        except ValueError as err:
            raise ApiError(400, str(err), "lora_path") from None
        except PermissionError as err:
            raise ApiError(403, f"{err} (--lora-root)", "lora_path", "permission_error") from None
        if name == api.name or name in api.engine.registry:
            raise ApiError(400, f"{name!r} is already served; unload it first", "lora_name")
        if api.loads_in_progress >= config.max_concurrent_loads:
            raise ApiError(429, f"{api.loads_in_progress} adapter loads are in progress; retry later",
                           kind="rate_limit_error", headers={"Retry-After": "1"})
        api.loads_in_progress += 1
        try:  # read and checked on a worker thread; it takes a device slot when a request first needs it
            prepared = await asyncio.to_thread(api.engine.pool.prepare, path)
            api.engine.host.put(api.engine.registry.register(name, path).generation, prepared)
        except AdapterError as err:  # its messages name the real path: the caller sees the path it gave
            raise ApiError(400, str(err).replace(path, body.lora_path), "lora_path") from None
        except ValueError as err:  # registered meanwhile
            raise ApiError(400, str(err), "lora_name") from None
        finally:
            api.loads_in_progress -= 1
        online.metrics.adapter_loads.inc()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request: HTTPRequest) -> Response:
        name = parse(UnloadLoraRequest, await api.read_body(request)).lora_name
        try:
            await asyncio.wrap_future(online.unload_adapter(name))
        except KeyError:
            raise ApiError(404, f"the adapter {_quoted(name)} is not registered", "lora_name",
                           "NotFoundError") from None
        except RuntimeError as err:
            raise ApiError(409, f"{err}; retry when they finish", "lora_name", "conflict_error") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(request: HTTPRequest) -> Response:
        return PlainTextResponse("ok")

    async def metrics(request: HTTPRequest) -> Response:
        return Response(generate_latest(online.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: HTTPRequest, exc) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", kind="NotFoundError").response()

    async def not_allowed(request: HTTPRequest, exc) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def server_error(request: HTTPRequest, exc: Exception) -> Response:
        return _internal_error(exc).response()

    routes = [Route("/v1/completions", handler(completions), methods=["POST"]),
              Route("/v1/chat/completions", handler(chat_completions), methods=["POST"]),
              Route("/v1/models", handler(models), methods=["GET"]),
              Route("/health", handler(health), methods=["GET"]),
              Route("/metrics", handler(metrics), methods=["GET"])]
    if config.allow_runtime_lora:
        routes += [Route("/v1/load_lora_adapter", handler(load_lora), methods=["POST"]),
                   Route("/v1/unload_lora_adapter", handler(unload_lora), methods=["POST"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        online.start()
        try:
            yield
        finally:
            online.stop()

    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={404: not_found, 405: not_allowed, Exception: server_error})
