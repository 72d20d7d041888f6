"""The OpenAI-compatible HTTP API over an `OnlineEngine` (a Starlette app, served by uvicorn).

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events or not), GET
/v1/models and /v1/models/{id}, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with
`allow_runtime_lora`), vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info (lm-eval's remote
tokenizer), GET /health, GET /metrics. The OpenAI `model` field names the served base model or a loaded
adapter. Completions take a list of prompts, `n` and `best_of` choices each, `logprobs` (the top k, OpenAI's
legacy format) and `echo` (the prompt and, with logprobs, its tokens' log-probabilities; with `max_tokens` 0
nothing is generated: scoring); chat takes `n`, `logprobs` and `top_logprobs`. Errors answer 4xx (or 503 when
the queue is full) with OpenAI's error body, and the server keeps serving; an unexpected exception answers a
JSON 500 with a request id, its traceback going only to the log.

A request's cost is bounded before any heavy work: its body by `max_body_bytes` while it is read, a text
prompt by its characters before it is tokenized; parsing, chat rendering and tokenizing run on worker
threads, so the event loop (and /health) stays responsive. A client that disconnects cancels its request,
streamed or not, and its row frees before the engine's next step.
Beyond OpenAI's fields, every choice (and streamed chunk) carries `token_ids`, the generated token ids (as
vLLM's `return_token_ids`; after a stop string, through the token that completed it), and requests may give
`stop_token_ids` and `ignore_eos`.
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
from jlora.adapters.config import OutsideRootsError
from jlora.logprobs import TokenLogprob
from jlora.models.loading import GenerationDefaults
from jlora.sampling import sample_seeds
from jlora.scheduler import Request
from jlora.chat import ChatOptions, ChatTemplateError, text_content
from jlora.server.config import ServerConfig
from jlora.server.errors import ApiError
from jlora.server.logprob_format import TokenTexts, chat_logprobs, completion_logprobs
from jlora.server.online import EngineStopped, OnlineEngine, QueueFull
from jlora.server.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, LoadLoraRequest, TokenizeRequest,
                                  UnloadLoraRequest, parse)
from jlora.server.text import StreamText

__all__ = ["build_app", "read_body"]

logger = logging.getLogger("jlora.server")


class _Api:
    """The routes' shared state and request handling: the online engine, options, chat template, stop tokens."""

    def __init__(self, online: OnlineEngine, config: ServerConfig):
        self.online = online
        self.engine = online.engine
        self.config = config
        self.name = config.served_model_name
        self.chat = self.engine.chat_template
        # the sampling settings a request that sets none gets: the model's (generation_config.json), or OpenAI's
        self.defaults = (self.engine.generation_defaults if config.generation_config == "auto"
                         else GenerationDefaults())
        self.key = None if config.api_key is None else f"Bearer {config.api_key}".encode()
        tokenizer = self.engine.tokenizer
        # A text longer than this has more than max_seq_len tokens whatever it holds (a token covers at most its
        # vocabulary string's characters), so it is refused before any tokenizing.
        longest = 0 if tokenizer is None else max(map(len, tokenizer.get_vocab()), default=0)
        self.max_prompt_chars = self.engine.config.max_seq_len * max(16, longest)
        self.loads_in_progress = 0
        self.token_texts = TokenTexts(tokenizer)

    def authorized(self, http: HTTPRequest) -> bool:
        given = http.headers.get("authorization", "").encode("latin-1")  # as the header's bytes arrived
        return self.key is None or hmac.compare_digest(given, self.key)

    # --- request parsing (off the event loop but for the body's reading) -----------------------------------
    async def read_body(self, http: HTTPRequest) -> bytes:
        return await read_body(http, self.config)

    def adapter_of(self, model: str) -> str | None:
        if model == self.name:
            return None
        if self.engine.registry.find(model) is not None:  # a --lora-dir's as it is now
            return model
        raise ApiError(404, f"the model {_quoted(model)} does not exist; GET /v1/models lists them", "model",
                       "NotFoundError")

    def prepare_completion(self, body: bytes) -> _Prepared:
        request = parse(CompletionRequest, body)
        adapter = self.adapter_of(request.model)
        prompt = request.prompt  # [] is one prompt of no ids, refused as empty below
        batched = isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], (str, list))
        given = prompt if batched else [prompt]
        prompts = [self.encode_prompt(p, adapter, "the prompt" if not batched else f"prompt {i}",
                                      request.add_special_tokens) for i, p in enumerate(given)]
        best_of = request.n if request.best_of is None else request.best_of
        if best_of < request.n:
            raise ApiError(400, f"'best_of' ({best_of}) must be at least 'n' ({request.n})", "best_of")
        if best_of > request.n and request.stream:
            raise ApiError(400, "'best_of' above 'n' cannot be streamed (the best are known at the end)", "best_of")
        echo = None
        if request.echo:
            echo = [p if isinstance(p, str) else self.decode(ids) for p, ids in zip(given, prompts)]
        return self.prepared(request, prompts, adapter, "prompt", best_of=best_of, logprobs=request.logprobs,
                             echo=echo)

    def prepare_chat(self, body: bytes) -> _Prepared:
        request = parse(ChatRequest, body)
        adapter = self.adapter_of(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        prompt = self.tokenize(self.render(request), "messages", request.add_special_tokens)
        if not prompt:
            raise ApiError(400, "the rendered chat prompt is empty", "messages")
        return self.prepared(request, [prompt], adapter, "messages",
                             logprobs=(request.top_logprobs or 0) if request.logprobs else None)

    def render(self, request: ChatRequest | TokenizeRequest) -> str:
        """The chat prompt's text of the request's messages, rendered with its options, its size bounded first."""
        self.need_tokenizer("chat", "messages")
        options = ChatOptions(request.add_generation_prompt, request.continue_final_message,
                              request.chat_template_kwargs or {})
        try:
            messages = [text_content(m, i) for i, m in enumerate(request.messages)]
            if sum(len(m["content"]) for m in messages) > self.max_prompt_chars:
                raise ApiError(400, "the messages are longer than the maximum context of "
                                    f"{self.engine.config.max_seq_len} tokens can hold", "messages")
            return self.chat.render(messages, options)
        except ChatTemplateError as err:
            raise ApiError(400, str(err), "messages") from None

    def need_tokenizer(self, what: str, param: str) -> None:
        if self.engine.tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer; the model directory has no tokenizer.json", param)

    # --- vLLM's tokenizer routes, which lm-eval's remote tokenizer uses ---------------------------------------
    def tokenize_request(self, body: bytes) -> dict:
        request = parse(TokenizeRequest, body)
        if (request.prompt is None) == (request.messages is None):
            raise ApiError(400, "give either 'prompt' or 'messages'", "prompt")
        if request.messages is not None:
            ids = self.tokenize(self.render(request), "messages", request.add_special_tokens is True)
        else:
            self.need_tokenizer("tokenizing", "prompt")
            ids = self.tokenize(request.prompt, "prompt", request.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": self.engine.config.max_seq_len, "tokens": ids, "token_strs": None}

    def detokenize_request(self, body: bytes) -> dict:
        ids = parse(DetokenizeRequest, body).tokens
        self.need_tokenizer("detokenizing", "tokens")
        vocab = self.engine.tokenizer.get_vocab_size()
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"'tokens' holds ids outside the tokenizer's [0, {vocab})", "tokens")
        return {"prompt": self.engine.tokenizer.decode(ids)}

    def tokenizer_info(self) -> dict:
        self.need_tokenizer("tokenizer_info", "model")
        special = dict(self.chat.special)
        if special["eos_token"] is None and self.engine.eos_token_ids:
            special["eos_token"] = self.engine.tokenizer.id_to_token(min(self.engine.eos_token_ids))
        return {"tokenizer_class": "tokenizers.Tokenizer", **special, "chat_template": self.chat.source,
                "model_max_length": self.engine.config.max_seq_len,
                "vocab_size": self.engine.tokenizer.get_vocab_size()}

    def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"the {param} has {len(text)} characters, more than the maximum context of "
                                f"{self.engine.config.max_seq_len} tokens can hold", param)
        # encode_batch releases the interpreter lock (encode holds it), so the event loop runs meanwhile
        return self.engine.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        """The text of token ids ("" without a tokenizer; an adapter's added tokens have none)."""
        vocab = self.engine.model_config.vocab_size
        return "" if self.engine.tokenizer is None else self.engine.tokenizer.decode([t for t in ids if t < vocab])

    def prepared(self, request: CompletionRequest | ChatRequest, prompts: list[list[int]], adapter: str | None,
                 param: str, *, best_of: int | None = None, logprobs: int | None = None,
                 echo: list[str] | None = None) -> _Prepared:
        """The request's engine settings, checked against its prompts."""
        longest = max(map(len, prompts))
        room = self.engine.config.max_seq_len - longest
        defaults = self.defaults
        max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
        if max_tokens is None:  # as vLLM: a chat's room (at most the model's max_new_tokens; at least 1, so that a
            # prompt that fills the context is refused as one), a completion's 16
            max_tokens = max(min(room, defaults.max_tokens or room), 1) if isinstance(request, ChatRequest) else 16
        if max_tokens == 0 and echo is None:
            raise ApiError(400, "'max_tokens' 0 needs 'echo': true (a request that scores its prompt)", "max_tokens")
        if room < min(max_tokens, 1):
            raise ApiError(400, f"the prompt has {longest} tokens; the maximum context is "
                                f"{self.engine.config.max_seq_len} tokens", param)
        if max_tokens > room:
            raise ApiError(400, f"the prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"maximum context of {self.engine.config.max_seq_len} tokens", "max_tokens")
        best_of = best_of or request.n
        if len(prompts) * best_of > self.online.max_waiting:
            raise ApiError(400, f"{len(prompts)} prompt(s) x {best_of} choices are more requests than the server "
                                f"queues ({self.online.max_waiting}, --max-waiting)", "n")
        stop = [] if request.stop is None else [request.stop] if isinstance(request.stop, str) else request.stop
        ids = frozenset(request.stop_token_ids or ()) | {s for s in stop if isinstance(s, int)}
        vocab = self.engine.vocab_size(adapter)
        if bad := sorted(t for t in ids if t >= vocab):
            raise ApiError(400, f"stop token ids {bad[:5]} are outside [0, {vocab}), the model's vocabulary: "
                                "they would never match", "stop_token_ids")
        if not request.ignore_eos:
            ids |= self.engine.eos_token_ids
        strings = [s for s in stop if isinstance(s, str) and s]
        if strings and self.engine.tokenizer is None:
            raise ApiError(400, "stop strings need a tokenizer; the model directory has no tokenizer.json", "stop")
        if request.stream_options is not None and not request.stream:
            raise ApiError(400, "'stream_options' needs 'stream': true", "stream_options")
        stream_usage = request.stream and bool((request.stream_options or {}).get("include_usage"))
        seed = uuid.uuid4().int % 2**32 if request.seed is None else request.seed
        # best_of ranks samples by log-probability: computed then even when the answer does not show them
        sample_logprobs = logprobs if logprobs is not None or best_of == request.n else 0
        # echo shows the prompt's with logprobs; a scoring request (max_tokens 0) asks for them to run at all
        prompt_logprobs = (logprobs or 0) if echo is not None and (logprobs is not None or max_tokens == 0) else None
        unset = lambda value, default: default if value is None else value  # noqa: E731
        settings = dict(max_new=max_tokens, temperature=unset(request.temperature, unset(defaults.temperature, 1.0)),
                        top_p=unset(request.top_p, unset(defaults.top_p, 1.0)),
                        top_k=max(unset(request.top_k, defaults.top_k) or 0, 0),
                        min_p=unset(request.min_p, defaults.min_p) or 0.0, stop=ids, logprobs=sample_logprobs,
                        prompt_logprobs=prompt_logprobs,
                        repetition_penalty=unset(request.repetition_penalty, unset(defaults.repetition_penalty, 1.0)),
                        frequency_penalty=request.frequency_penalty or 0.0,
                        presence_penalty=request.presence_penalty or 0.0, cache_salt=request.cache_salt)
        return _Prepared(prompts, adapter, settings, sample_seeds(seed, best_of), strings, request.stream,
                         stream_usage, request.n, logprobs, echo)

    def encode_prompt(self, prompt: str | list[int], adapter: str | None, what: str = "the prompt",
                      add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, checked against the adapter's vocabulary; `what` names it in errors ("prompt 3"
        of a batch); a text's with the tokenizer's special tokens (BOS) unless `add_special_tokens` is False."""
        if isinstance(prompt, str):
            self.need_tokenizer("a text prompt (send token ids)", "prompt")
            ids = self.tokenize(prompt, "prompt", add_special_tokens)
        else:
            ids = prompt
        if not ids:
            raise ApiError(400, f"{what} is empty", "prompt")
        try:
            vocab = self.engine.vocab_size(adapter)  # the base vocabulary and the adapter's added tokens
        except KeyError:
            raise ApiError(404, f"the model {adapter!r} does not exist", "model", "NotFoundError") from None
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{what} has token ids outside [0, {vocab}) ({ids[bad]} at position {bad})", "prompt")
        return list(ids)

    # --- generation --------------------------------------------------------------------------------------
    async def run(self, http: HTTPRequest, prepared: _Prepared, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        woken = threading.Event()  # an update is on its way to the event loop: later ones ride along

        def wake() -> None:
            woken.clear()
            updates.put_nowait(None)

        def on_update(r: Request) -> None:  # on the engine thread, after every token
            if not woken.is_set():
                woken.set()
                loop.call_soon_threadsafe(wake)

        settings = dict(prepared.settings)
        prompt_logprobs = settings.pop("prompt_logprobs")
        samples = []
        for i, prompt in enumerate(prepared.prompts):
            first = None  # the prompt's other samples share its prefill, and its prompt's log-probabilities
            for seed in prepared.seeds:
                request = Request(prompt, -1, seed=seed, on_update=on_update, fork_of=first,
                                  prompt_logprobs=None if first else prompt_logprobs, **settings)
                samples.append(_Sample(i, request, StreamText(self.engine.tokenizer, prepared.strings, prompt)))
                first = first or request
        requests = [s.request for s in samples]
        try:
            self.online.submit(requests, prepared.adapter)
        except QueueFull as err:
            raise ApiError(503, f"the server is busy: {err}; retry later", kind="server_error",
                           headers={"Retry-After": "1"}) from None
        meta = dict(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                    model=prepared.adapter or self.name)
        if prepared.stream:  # Starlette cancels the stream when its client disconnects
            return StreamingResponse(self._stream(samples, prepared, updates, meta, chat),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, requests))
        try:
            while not await self._next_update(samples, updates):
                pass
        finally:
            watcher.cancel()
            self._cancel_unfinished(requests)  # stop strings ended them, or this handler was cancelled
        failed = next((r for r in requests if r.finish in ("error", "failed")), None)
        if failed is not None:
            raise _request_error(failed)
        chosen = _most_likely(samples, len(prepared.seeds), prepared.n)
        choices = []
        for index, sample in enumerate(chosen):
            tokens, logprobs = sample.shown(sample.request.out), sample.shown(sample.request.out_logprobs)
            choice = {"index": index, "finish_reason": sample.finish_reason(), "token_ids": list(tokens)}
            if chat:
                choice["message"] = {"role": "assistant", "content": sample.text.final()}
                choice["logprobs"] = None if prepared.logprobs is None else chat_logprobs(logprobs, self.token_texts)
            else:
                echo = "" if prepared.echo is None else prepared.echo[sample.prompt]
                choice["text"] = echo + sample.text.final()
                choice["logprobs"] = self._legacy_logprobs(sample, prepared, logprobs, True, 0)
            choices.append(choice)
        return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                             "usage": _usage(prepared, samples)})

    def _legacy_logprobs(self, sample: _Sample, prepared: _Prepared, generated: list[TokenLogprob], echo: bool,
                         offset: int) -> dict | None:
        """A completion choice's legacy logprobs (None unless asked for): with `echo` the prompt's tokens first
        (when the request echoes), then `generated`'s; text offsets from `offset`."""
        if prepared.logprobs is None:
            return None
        first = sample.request.fork_of or sample.request
        entries = list(zip(first.prompt, first.prompt_out_logprobs)) if echo and prepared.echo is not None else []
        return completion_logprobs(entries + [(lp.token, lp) for lp in generated], self.token_texts, offset)

    def _cancel_unfinished(self, requests: list[Request]) -> None:
        for r in requests:
            if r.finish is None:
                self.online.cancel(r)

    async def _next_update(self, samples: list[_Sample], updates: asyncio.Queue) -> bool:
        """Waits for the requests' next update; True once each has ended or met a stop string (a request a stop
        string ended is cancelled: no more tokens are needed)."""
        await updates.get()
        while not updates.empty():
            updates.get_nowait()
        for sample in samples:
            if sample.done:
                continue
            r = sample.request
            ended = r.finish is not None  # before the text reads `out`: once ended, `out` is whole
            if sample.text.update(r.out, ended) and not ended:
                self.online.cancel(r)
            sample.done = ended or sample.text.finish is not None
        return all(s.done for s in samples)

    async def _cancel_on_disconnect(self, http: HTTPRequest, requests: list[Request]) -> None:
        """Cancels the requests as soon as their client disconnects (the body is read, so the next message the
        server gets for it is the disconnect): their rows free before the engine's next step."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        self._cancel_unfinished(requests)

    async def _stream(self, samples: list[_Sample], prepared: _Prepared, updates, meta: dict, chat: bool
                      ) -> AsyncIterator[str]:
        """Server-sent events: per choice, a chunk of each update's new text and tokens (with their logprobs), an
        echoed prompt first, and a last chunk with its finish reason; with `include_usage`, as OpenAI sends it, a
        chunk without choices after them carries the usage, and every other chunk "usage": null."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage_field = {"usage": None} if prepared.stream_usage else {}

        def event(choice: dict) -> str:
            return f"data: {json.dumps({**meta, 'object': kind, 'choices': [choice], **usage_field})}\n\n"

        def chunk(sample: _Sample, index: int, piece: str | None, finish: str | None, ids: list[int]) -> dict:
            """A choice's chunk: `ids` and their logprobs, or with `finish` the stop token's (if one ended it)."""
            r, sent = sample.request, sample.sent
            stop_token = r.finish == "stop" and sample.text.finish is None  # not a stop string
            generated = (r.out_logprobs[sent.tokens:sent.tokens + len(ids)] if finish is None
                         else r.out_logprobs[sent.tokens:] if stop_token else [])
            if chat:
                logprobs = None if prepared.logprobs is None else chat_logprobs(generated, self.token_texts)
                delta = {} if piece is None else {"content": piece}
                return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}
            echo = prepared.echo is not None and not sent.echo
            text = (prepared.echo[sample.prompt] if echo else "") + (piece or "")
            return {"index": index, "text": text,
                    "logprobs": self._legacy_logprobs(sample, prepared, generated, echo, sent.offset),
                    "finish_reason": finish, "token_ids": ids}

        try:
            if chat:  # the first chunk of each choice names the role
                for index in range(len(samples)):
                    yield event({"index": index, "delta": {"role": "assistant"}, "logprobs": None,
                                 "finish_reason": None})
            open_ = set(range(len(samples)))
            while open_:
                await self._next_update(samples, updates)
                failed = next((s.request for s in samples if s.request.finish in ("error", "failed")), None)
                if failed is not None:
                    yield f"data: {json.dumps(_request_error(failed).body())}\n\n"
                    break
                for index in sorted(open_):
                    sample = samples[index]
                    r, sent = sample.request, sample.sent
                    echo_due = prepared.echo is not None and not sent.echo and (r.out or sample.done)
                    piece, ids = sample.text.take(), r.out[sent.tokens:sample.text.shown]
                    if piece or ids or echo_due:
                        choice = chunk(sample, index, piece, None, ids)
                        yield event(choice)
                        sample.advance(ids, choice)
                    if sample.done:
                        open_.discard(index)
                        yield event(chunk(sample, index, None, sample.finish_reason(), []))
            else:  # no error ended the stream
                if prepared.stream_usage:
                    usage = {**meta, "object": kind, "choices": [], "usage": _usage(prepared, samples)}
                    yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as err:  # the status line has gone out: the error travels as the stream's last event
            yield f"data: {json.dumps(_internal_error(err).body())}\n\n"
        finally:
            self._cancel_unfinished([s.request for s in samples])  # a client that left mid-stream: rows free


async def read_body(http: HTTPRequest, config: ServerConfig) -> bytes:
    """The request's body, refused (413) once it passes max_body_bytes and (408) after body_timeout."""
    limit = config.max_body_bytes
    declared = http.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or len(declared) > 18 or int(declared) > limit):
        raise ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(config.body_timeout):
            async for chunk in http.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {config.body_timeout:g} s") from None
    except ClientDisconnect:  # nobody hears the answer; it only keeps the log free of a traceback
        raise ApiError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


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
    """The error of a request refused at intake (404: its adapter is not registered; 503: no slot can take it until
    an adapter is unloaded; 400: bad input) or failed in the engine or while its adapter loaded (500), or ended by
    the server's shutdown (503)."""
    if request.finish == "error":
        status = request.status or 400
        kind = {404: "NotFoundError", 503: "server_error"}.get(status, "invalid_request_error")
        return ApiError(status, request.error, "model" if status in (404, 503) else "prompt", kind)
    return ApiError(request.status or 500, request.error, kind="server_error")


def _usage(prepared: _Prepared, samples: list[_Sample]) -> dict:
    n = sum(map(len, prepared.prompts))
    m = sum(len(s.shown(s.request.out)) for s in samples)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _most_likely(samples: list[_Sample], best_of: int, n: int) -> list[_Sample]:
    """Of each prompt's best_of samples (consecutive), the n of highest log-probability (their tokens', and the
    stop token's); all of them, in order, when best_of is n."""
    if best_of == n:
        return samples
    chosen = []
    for i in range(0, len(samples), best_of):
        group = samples[i:i + best_of]
        chosen += sorted(group, key=lambda s: -sum(lp.logprob for lp in s.shown(s.request.out_logprobs)))[:n]
    return chosen


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A generation request parsed and checked: what the engine runs and what the answer shows."""

    prompts: list[list[int]]
    adapter: str | None
    settings: dict  # Request's max_new, sampling settings and penalties, stop, logprobs; the first's
    # prompt_logprobs
    seeds: list[int]  # each prompt's samples' (best_of of them)
    strings: list[str]  # stop strings
    stream: bool
    stream_usage: bool  # stream_options.include_usage: a last chunk carries the usage (the others "usage": null)
    n: int  # choices per prompt: of its best_of samples, the n of highest log-probability
    logprobs: int | None  # alternatives shown per token (None: no logprobs in the answer)
    echo: list[str] | None  # with echo, each prompt's text, put before its choices' text


@dataclasses.dataclass
class _Sent:
    """What a streamed choice has sent: tokens (with their logprobs), whether its echo, and the text offset of
    the next token in legacy logprobs (the token texts' lengths added up, as in an answer in one piece)."""

    tokens: int = 0
    echo: bool = False
    offset: int = 0


@dataclasses.dataclass
class _Sample:
    """One engine request of an HTTP request: the prompt it continues (an index), its text as it streams."""

    prompt: int
    request: Request
    text: StreamText
    sent: _Sent = dataclasses.field(default_factory=_Sent)
    done: bool = False  # ended, or met a stop string, when the HTTP handler last looked (`_next_update`)

    def shown(self, values: list) -> list:
        """Of `values`, the request's tokens or their log-probabilities, those its answer shows: all of them, or
        once a stop string ended its text, those through the token that completed it (`StreamText.shown`)."""
        return values if self.text.finish is None else values[:self.text.shown]

    def finish_reason(self) -> str:
        return self.text.finish or ("length" if self.request.finish == "length" else "stop")

    def advance(self, ids: list[int], choice: dict) -> None:
        """Counts a chunk (`choice`, of tokens `ids`) as sent: the echo goes with the first."""
        self.sent.echo = True
        self.sent.tokens += len(ids)
        legacy = choice.get("logprobs")
        if legacy and legacy.get("tokens"):
            self.sent.offset = legacy["text_offset"][-1] + len(legacy["tokens"][-1])


def build_app(online: OnlineEngine, config: ServerConfig) -> Starlette:
    """The Starlette app serving `online` (started and stopped with the app); chat renders with the engine's
    `chat_template`, and requests stop at its `eos_token_ids` unless they ask not to.
    `config.served_model_name` must be set."""
    if not config.served_model_name:
        raise ValueError("config.served_model_name must be set")
    api = _Api(online, config)

    def handler(fn):
        async def wrapped(request: HTTPRequest) -> Response:
            if request.url.path != "/health" and not api.authorized(request):
                return ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                kind="authentication_error").response()
            try:
                return await fn(request)
            except ApiError as err:
                return err.response()
            except EngineStopped as err:  # a retry cannot help: the server must be restarted (/health says so)
                return ApiError(503, str(err), kind="server_error").response()
            except Exception as err:  # a bug, not the client's input: a JSON 500, the traceback to the log
                return _internal_error(err).response()
        return wrapped

    async def completions(request: HTTPRequest) -> Response:
        body = await api.read_body(request)
        return await api.run(request, await asyncio.to_thread(api.prepare_completion, body), chat=False)

    async def chat_completions(request: HTTPRequest) -> Response:
        body = await api.read_body(request)
        return await api.run(request, await asyncio.to_thread(api.prepare_chat, body), chat=True)

    def card(name: str) -> dict:
        """A model's entry in /v1/models: the base model, or an adapter (whose parent is the base)."""
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "jlora", "root": name,
                "parent": None if name == api.name else api.name}

    async def models(request: HTTPRequest) -> Response:
        names = await asyncio.to_thread(api.engine.registry.available)  # a --lora-dir's as it is now
        return JSONResponse({"object": "list", "data": [card(name) for name in [api.name, *names]]})

    async def model(request: HTTPRequest) -> Response:  # OpenAI's retrieve: one model's entry, or 404
        name = request.path_params["name"]
        adapter = await asyncio.to_thread(api.adapter_of, name)
        return JSONResponse(card(adapter or api.name))

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
            prepared = await asyncio.to_thread(api.engine.pool.prepare, path, config.lora_roots)
            tiers = api.engine.tiers
            tiers.keep(tiers.host, api.engine.registry.register(name, path, config.lora_roots), prepared)
        except AdapterError as err:  # its messages name the real path: the caller sees the path it gave
            message = str(err).replace(path, body.lora_path)
            if isinstance(err, OutsideRootsError):  # a link in the directory to a file outside every root
                raise ApiError(403, f"{message} (--lora-root)", "lora_path", "permission_error") from None
            raise ApiError(400, message, "lora_path") from None
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

    async def tokenize(request: HTTPRequest) -> Response:
        return JSONResponse(await asyncio.to_thread(api.tokenize_request, await api.read_body(request)))

    async def detokenize(request: HTTPRequest) -> Response:
        return JSONResponse(await asyncio.to_thread(api.detokenize_request, await api.read_body(request)))

    async def tokenizer_info(request: HTTPRequest) -> Response:
        return JSONResponse(api.tokenizer_info())

    async def health(request: HTTPRequest) -> Response:
        if online.down:
            return PlainTextResponse(online.down, status_code=503)
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
              Route("/v1/models/{name:path}", handler(model), methods=["GET"]),
              Route("/tokenize", handler(tokenize), methods=["POST"]),
              Route("/detokenize", handler(detokenize), methods=["POST"]),
              Route("/tokenizer_info", handler(tokenizer_info), methods=["GET"]),
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
