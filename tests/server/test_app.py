"""The app in process (httpx's ASGI transport), for what needs the server's insides at hand: runtime loads past
the cap answer 429, and an unexpected exception answers a JSON 500 with a request id (mid-stream: the stream's
last event) while its traceback goes only to the log, and the server serves on; a storm of requests of every kind,
hang-ups and reloads of an adapter answers each whole greedy completion as an engine alone does and holds nothing
after."""

import asyncio
import json
import logging
import threading
import time

import pytest

for _module in ("uvicorn", "starlette", "prometheus_client", "jinja2", "pydantic"):  # the server's packages
    pytest.importorskip(_module)
httpx = pytest.importorskip("httpx")

from jlora import testing  # noqa: E402
from jlora.adapters import PoolFullError  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from jlora.models.loading import GenerationDefaults, generation_defaults  # noqa: E402
from jlora.server.app import build_app  # noqa: E402
from jlora.server.config import ServerConfig  # noqa: E402
from jlora.server.online import OnlineEngine  # noqa: E402
from jlora.server.text import StreamText  # noqa: E402

CFG = testing.tiny_config("llama", vocab_size=120)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("app")
    testing.write_model(str(root / "m"), CFG, seed=5)
    testing.write_tokenizer(str(root / "m"), CFG["vocab_size"])
    for name in ("a", "b", "c"):
        testing.write_adapter(str(root / "adapters" / name), CFG, r=4, alpha=8, seed=len(name))
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=4, max_lora_rank=8, max_batch=2,
                                    max_seq_len=64, progress=False)
    online = OnlineEngine(engine)
    config = ServerConfig(served_model_name="m", allow_runtime_lora=True, lora_roots=(str(root / "adapters"),),
                          max_concurrent_loads=2)
    app = build_app(online, config)
    online.start()  # the ASGI transport runs no lifespan
    yield engine, app, online
    assert online._thread.is_alive()  # no test's failure ended the loop
    online.stop()


def run(app, scenario):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            return await scenario(c)
    return asyncio.run(main())


def test_runtime_loads_past_the_cap_answer_429(served, monkeypatch):
    engine, app, online = served
    gate, prepare = threading.Event(), engine.pool.prepare
    monkeypatch.setattr(engine.pool, "prepare", lambda path, *roots: (gate.wait(30), prepare(path, *roots))[1])

    async def scenario(c):
        first = [asyncio.create_task(c.post("/v1/load_lora_adapter", json={"lora_name": n, "lora_path": n}))
                 for n in ("a", "b")]
        await asyncio.sleep(0.3)  # both are reading their files
        third = await c.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "c"})
        gate.set()
        return third, [await t for t in first]

    third, first = run(app, scenario)
    assert third.status_code == 429 and third.headers["retry-after"] == "1"
    assert "adapter loads are in progress" in third.json()["error"]["message"]
    assert [r.status_code for r in first] == [200, 200] and sorted(engine.adapters) == ["a", "b"]
    for name in ("a", "b"):  # on the loop's thread, like the server's own unloads
        online.unload_adapter(name).result(timeout=30)


def test_a_model_is_retrieved_by_any_adapter_name_and_gone_once_unloaded(served):
    """GET /v1/models/{id} (OpenAI's retrieve) for adapter names with "/", ":", "@" and "+", given plain or with
    "/" percent-encoded: the adapter's entry while it is loaded, 404 once it is unloaded."""
    engine, app, online = served
    names = ("org/a", "org:v1@2+a")

    async def scenario(c):
        for name in names:
            load = await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "a"})
            assert load.status_code == 200, load.text
        loaded = [(await c.get(f"/v1/models/{path}")).json() for name in names
                  for path in (name, name.replace("/", "%2F"))]
        for name in names:
            assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": name})).status_code == 200
        return loaded, [await c.get(f"/v1/models/{name}") for name in names]

    loaded, gone = run(app, scenario)
    assert [(m["id"], m["parent"]) for m in loaded] == [(n, "m") for n in names for _ in range(2)]
    assert [r.status_code for r in gone] == [404, 404] and "does not exist" in gone[0].json()["error"]["message"]


def test_an_unexpected_exception_is_a_json_500_with_a_request_id(served, monkeypatch, caplog):
    engine, app, online = served

    def boom(adapter):
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "vocab_size", boom)
    with caplog.at_level(logging.ERROR, logger="jlora.server"):
        response = run(app, lambda c: c.post("/v1/completions", json={"model": "m", "prompt": [1, 2]}))
    assert response.status_code == 500
    error = response.json()["error"]
    assert "request id" in error["message"] and "a bug" not in error["message"] and error["type"] == "server_error"
    request_id = error["message"].split("request id ")[1].split(";")[0]
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)  # the traceback, in the log
    monkeypatch.undo()
    ok = run(app, lambda c: c.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2}))
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_an_exception_mid_stream_ends_the_stream_with_an_error_event(served, monkeypatch):
    engine, app, online = served
    monkeypatch.setattr(StreamText, "take", lambda self: 1 / 0)
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 40, "stream": True, "ignore_eos": True}
    response = run(app, lambda c: c.post("/v1/completions", json=body))
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert response.status_code == 200 and "request id" in events[-1]["error"]["message"]
    assert events[-1]["error"]["code"] == 500
    monkeypatch.undo()
    for _ in range(100):  # the request was cancelled: its row frees
        if online.batcher.num_running == 0:
            break
        time.sleep(0.05)
    assert online.batcher.num_running == 0
    ok = run(app, lambda c: c.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2}))
    assert ok.status_code == 200


def test_requests_stop_at_the_engines_eos_unless_they_ignore_it(served, monkeypatch):
    engine, app, online = served
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0}
    full = run(app, lambda c: c.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]
    monkeypatch.setattr(engine, "eos_token_ids", frozenset({full[2]}))
    cut = full.index(full[2])
    stopped = run(app, lambda c: c.post("/v1/completions", json=body)).json()["choices"][0]
    assert stopped["token_ids"] == full[:cut] and stopped["finish_reason"] == "stop"
    past = run(app, lambda c: c.post("/v1/completions", json={**body, "ignore_eos": True})).json()["choices"][0]
    assert past["token_ids"] == full and past["finish_reason"] == "length"


def test_a_stop_string_shows_the_tokens_through_the_one_that_completed_it(served, monkeypatch):
    """The engine generates past a stop string until its request is cancelled; the answer, streamed or not, shows
    the tokens through the one whose text completed the stop string (their log-probabilities, and usage counts
    them), however many more the engine made. Here the text is read only once all 10 tokens are out."""
    engine, app, online = served
    body = {"model": "m", "prompt": [9, 10], "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    full = run(app, lambda c: c.post("/v1/completions", json=body)).json()["choices"][0]
    decode = engine.tokenizer.decode
    stop = decode(full["token_ids"][2:4])[:-1]  # two tokens' text, the second's cut short: "w75 w5"
    k = next(k for k in range(1, 11) if stop in decode(full["token_ids"][:k]))
    assert k == 4 and full["text"].index(stop) > 0
    update = StreamText.update

    def late_update(self, tokens, done):  # as a busy event loop would read them
        for _ in range(500):
            if len(tokens) == 10 or done:
                break
            time.sleep(0.01)
        return update(self, tokens, done)

    monkeypatch.setattr(StreamText, "update", late_update)
    cut = {**body, "stop": [stop]}
    plain = run(app, lambda c: c.post("/v1/completions", json=cut)).json()
    choice = plain["choices"][0]
    assert choice["text"] == full["text"][:full["text"].index(stop)] and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == full["token_ids"][:k] and plain["usage"]["completion_tokens"] == k
    assert choice["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][:k]
    stream = {**cut, "stream": True, "stream_options": {"include_usage": True}}
    events = [json.loads(line[6:]) for line in run(app, lambda c: c.post("/v1/completions", json=stream)).text
              .splitlines() if line.startswith("data: {")]
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == full["token_ids"][:k]
    assert events[-1]["usage"]["completion_tokens"] == k


def test_top_k_and_min_p_per_request(served):
    """top_k 1 (or min_p 1) samples the argmax; a sampled request beside a filtered one draws what it draws alone
    (the filtered step runs for both)."""
    engine, app, online = served
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}
    tokens = lambda r: r.json()["choices"][0]["token_ids"]
    greedy = tokens(run(app, lambda c: c.post("/v1/completions", json={**body, "temperature": 0})))
    for one in ({"top_k": 1}, {"min_p": 1.0}):
        assert tokens(run(app, lambda c: c.post("/v1/completions", json={**body, "temperature": 1.5, **one}))) == greedy
    plain = {**body, "temperature": 1.0, "seed": 7}
    alone = tokens(run(app, lambda c: c.post("/v1/completions", json=plain)))

    async def both(c):
        return await asyncio.gather(c.post("/v1/completions", json=plain), c.post(
            "/v1/completions", json={**body, "temperature": 1.0, "seed": 8, "top_k": 3, "min_p": 0.05}))

    beside, filtered = run(app, both)
    assert tokens(beside) == alone and len(tokens(filtered)) == 8


def test_unset_sampling_settings_take_the_models_generation_config(served, monkeypatch, tmp_path):
    """As vLLM's server: a request's unset temperature, top_p, top_k, min_p and (chat) max_tokens take the model's
    generation_config.json values; its own settings win; `generation_config="none"` gives OpenAI's defaults."""
    engine, _, online = served
    tokens = lambda r: r.json()["choices"][0]["token_ids"]

    def app_with(recommended: dict, generation_config: str = "auto"):
        (tmp_path / "generation_config.json").write_text(json.dumps(recommended))
        monkeypatch.setattr(engine, "generation_defaults", generation_defaults(str(tmp_path)))
        return build_app(online, ServerConfig(served_model_name="m", generation_config=generation_config))

    def ask(app, **fields):
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True, **fields}
        return tokens(run(app, lambda c: c.post("/v1/completions", json=body)))

    openai = app_with({}, "none")
    greedy, sampled = ask(openai, temperature=0), ask(openai, seed=3)  # OpenAI's default: temperature 1
    assert sampled != greedy and ask(openai, seed=3, temperature=1.0) == sampled
    model = app_with({"temperature": 0.0, "top_p": 0.9})
    assert ask(model, seed=3) == ask(model, seed=4) == greedy  # the model's temperature 0
    assert ask(model, seed=3, temperature=1.0, top_p=1.0) == sampled  # the request's own settings win
    assert ask(app_with({"temperature": 0.0}, "none"), seed=3) == sampled  # "none": the file is not read
    model = app_with({"top_k": 1, "do_sample": False})  # do_sample is not read
    assert engine.generation_defaults == GenerationDefaults(top_k=1)
    assert ask(model, seed=3, temperature=1.5) == greedy  # top_k 1: the argmax at any temperature
    assert ask(model, seed=3, top_k=-1) == sampled  # a request's top_k -1 turns the model's off
    assert ask(app_with({"min_p": 1.0}), seed=3) == greedy
    model = app_with({"repetition_penalty": 1.9, "temperature": 0.0})
    penalized = ask(openai, temperature=0, repetition_penalty=1.9)
    assert penalized != greedy and ask(model) == penalized and ask(model, repetition_penalty=1.0) == greedy
    model = app_with({"max_new_tokens": 3})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    answer = run(model, lambda c: c.post("/v1/chat/completions", json=chat)).json()
    assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"
    answer = run(model, lambda c: c.post("/v1/chat/completions", json={**chat, "max_tokens": 5})).json()
    assert answer["usage"]["completion_tokens"] == 5
    completion = {"model": "m", "prompt": [1, 2, 3], "ignore_eos": True}  # a completion's default stays 16
    assert len(tokens(run(model, lambda c: c.post("/v1/completions", json=completion)))) == 16


def test_a_chat_without_max_tokens_takes_the_room_left_and_one_that_fills_the_context_is_refused_as_such(served):
    """A chat's unset max_tokens is the context's room after its rendered prompt: one token left gives one token;
    a prompt that fills the context or passes it answers 400 naming the context, not a max_tokens it never set."""
    engine, app, _ = served
    template = len(engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": ""}])).ids)

    def chat(words: int):
        body = {"model": "m", "messages": [{"role": "user", "content": " ".join(["the"] * words)}], "ignore_eos": True}
        return run(app, lambda c: c.post("/v1/chat/completions", json=body))

    room = engine.config.max_seq_len - template
    answer = chat(room - 1).json()
    assert answer["usage"] == {"prompt_tokens": engine.config.max_seq_len - 1, "completion_tokens": 1,
                               "total_tokens": engine.config.max_seq_len}
    for words in (room, room + 5):
        error = chat(words)
        assert error.status_code == 400 and error.json()["error"]["param"] == "messages", error.text
        assert error.json()["error"]["message"] == (f"the prompt has {template + words} tokens; the maximum context "
                                                    f"is {engine.config.max_seq_len} tokens")


def test_penalties_per_request_as_the_engine_applies_them(served):
    """repetition_penalty (vLLM's), frequency_penalty and presence_penalty (OpenAI's): a request generates what
    Engine.generate generates with them, alone or beside requests with other penalties; out of range: 400."""
    engine, app, online = served
    body = {"model": "m", "prompt": [1, 2, 3, 1, 2], "max_tokens": 10, "ignore_eos": True, "temperature": 0}
    tokens = lambda r: r.json()["choices"][0]["token_ids"]
    cases = [{}, {"repetition_penalty": 1.7}, {"frequency_penalty": 2.0}, {"presence_penalty": -2.0},
             {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "presence_penalty": 2.0}]
    want = [list(engine.generate([body["prompt"]], [None], 10, ignore_eos=True, **case)[0]) for case in cases]
    assert len({tuple(w) for w in want}) == len(cases)  # each changes the output
    alone = [tokens(run(app, lambda c, case=case: c.post("/v1/completions", json={**body, **case}))) for case in cases]
    assert alone == want

    async def together(c):
        return await asyncio.gather(*(c.post("/v1/completions", json={**body, **case}) for case in cases))

    assert [tokens(r) for r in run(app, together)] == want
    for field, value in (("repetition_penalty", 0), ("repetition_penalty", 2.5), ("frequency_penalty", -2.1),
                         ("presence_penalty", 3)):
        bad = run(app, lambda c: c.post("/v1/completions", json={**body, field: value}))
        assert bad.status_code == 400 and field in bad.json()["error"]["message"]


def test_an_engine_that_cannot_start_over_says_so_on_every_route_and_health(served, monkeypatch):
    """A step fails and the fresh cache to start over on cannot be made either (the device out of memory): the
    request in flight fails, /health answers 503 with the reason, and every later request and unload answers
    503 at once instead of waiting on a loop that is gone. Before: the loop thread died and they hung."""
    engine, _, _ = served
    online = OnlineEngine(engine)
    app = build_app(online, ServerConfig(served_model_name="m", allow_runtime_lora=True, lora_roots=("/",)))
    online.start()
    try:
        lost = RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        monkeypatch.setattr(engine.runner, "step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost")))
        monkeypatch.setattr(engine, "new_batcher", lambda *a, **k: (_ for _ in ()).throw(lost))
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 2}

        async def scenario(c):
            failed = await c.post("/v1/completions", json=body)
            return failed, await c.get("/health"), await c.post("/v1/completions", json=body), await c.post(
                "/v1/unload_lora_adapter", json={"lora_name": "a"})

        failed, health, after, unload = run(app, scenario)
        why = ("the engine step failed: RuntimeError: device lost; starting over on a fresh cache failed too "
               "(RuntimeError: RESOURCE_EXHAUSTED: out of memory): the engine takes no more requests")
        assert failed.status_code == 500 and why in failed.json()["error"]["message"]
        assert health.status_code == 503 and health.text == why
        for response in (after, unload):
            assert response.status_code == 503 and response.json()["error"]["message"] == why
        online._thread.join(10)  # the loop ends its last turn and returns
        assert online.down == why and not online._thread.is_alive()
    finally:
        online.stop()


def test_a_model_without_a_tokenizer_serves_token_ids_and_names_what_needs_one(tmp_path):
    """No tokenizer.json: prompts of token ids are served, streamed or not, with empty text and the ids (log-
    probabilities as `token_id:N`); what needs text answers 400 naming the tokenizer."""
    testing.write_model(str(tmp_path / "m"), CFG, seed=5)
    engine = Engine.from_pretrained(str(tmp_path / "m"), dtype="float32", max_loras=1, max_lora_rank=8, max_batch=2,
                                    max_seq_len=64, progress=False)
    want = list(engine.generate([[9, 10]], [None], max_new_tokens=6)[0])
    online = OnlineEngine(engine)
    app = build_app(online, ServerConfig(served_model_name="m"))
    online.start()
    body = {"model": "m", "prompt": [9, 10], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}

    async def scenario(c):
        never = next(t for t in range(CFG["vocab_size"]) if t not in want)
        plain = (await c.post("/v1/completions", json={**body, "stop": [never]})).json()["choices"][0]
        streamed = await c.post("/v1/completions", json={**body, "stream": True})
        refused = [await c.post(path, json=b) for path, b in [
            ("/v1/completions", {**body, "prompt": "the dog"}), ("/v1/completions", {**body, "stop": ["x"]}),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
            ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]]
        return plain, streamed, refused

    try:
        plain, streamed, refused = run(app, scenario)
    finally:
        online.stop()
    assert plain["token_ids"] == want and plain["text"] == "" and plain["finish_reason"] == "length"
    assert plain["logprobs"]["tokens"] == [f"token_id:{t}" for t in want]
    chunks = [c for line in streamed.text.splitlines() if line.startswith("data: {")
              for c in json.loads(line[6:])["choices"]]
    assert [t for c in chunks for t in c["token_ids"]] == want and not any(c["text"] for c in chunks)
    for response, field in zip(refused, ["prompt", "stop", "messages", "prompt", "tokens"]):
        error = response.json()["error"]
        assert response.status_code == 400 and "no tokenizer.json" in error["message"] and error["param"] == field


def test_with_eviction_off_a_request_no_slot_can_take_ends_at_once(tmp_path):
    """--evict refuse, one slot held by an idle adapter: a request for another adapter answers 503 at once (it
    used to wait for good), naming the setting; once the holder is unloaded it is served. Engine.generate raises
    PoolFullError there."""
    testing.write_model(str(tmp_path / "m"), CFG, seed=5)
    for name in ("a", "b"):
        testing.write_adapter(str(tmp_path / name), CFG, r=4, alpha=8, seed=len(name))
    engine = Engine.from_pretrained(str(tmp_path / "m"), dtype="float32", max_loras=1, max_lora_rank=8, max_batch=2,
                                    max_seq_len=64, evict="refuse", progress=False)
    engine.load_adapter("a", str(tmp_path / "a"))
    engine.register_adapter("b", str(tmp_path / "b"))
    with pytest.raises(PoolFullError, match="eviction is off"):
        engine.generate([[1, 2]], ["b"], max_new_tokens=2)
    online = OnlineEngine(engine)
    app = build_app(online, ServerConfig(served_model_name="m"))
    online.start()
    body = {"prompt": [1, 2], "max_tokens": 2}

    async def scenario(c):
        first = await c.post("/v1/completions", json={**body, "model": "a"})
        refused = await asyncio.wait_for(c.post("/v1/completions", json={**body, "model": "b"}), 30)
        online.unload_adapter("a").result(timeout=30)
        return first, refused, await c.post("/v1/completions", json={**body, "model": "b"})

    try:
        first, refused, served = run(app, scenario)
    finally:
        online.stop()
    assert first.status_code == 200 and served.status_code == 200 and engine.resident_adapters == ["b"]
    error = refused.json()["error"]
    assert refused.status_code == 503 and error["param"] == "model"
    assert error["message"] == ("no slot for adapter 'b': all 1 slots hold other adapters and eviction is off "
                                "(evict='refuse'); unload one")


def test_add_special_tokens_adds_the_tokenizers_bos_where_vllm_does(served):
    """A text prompt gets the tokenizer's special tokens (here "the", id 1, as BOS) unless add_special_tokens is
    false; a chat prompt, rendered by its template, only when it is true; /tokenize as either, by its form."""
    from tokenizers import processors

    engine, app, _ = served
    engine.tokenizer.post_processor = processors.TemplateProcessing(single="the $A", special_tokens=[("the", 1)])
    messages = [{"role": "user", "content": "fox"}]

    async def scenario(c):
        async def post(path, **body):
            reply = await c.post(path, json={"model": "m", **body})
            assert reply.status_code == 200, reply.text
            return reply.json()

        async def prompt_tokens(path, **body):
            return (await post(path, max_tokens=1, **body))["usage"]["prompt_tokens"]

        assert (await post("/tokenize", prompt="fox"))["tokens"] == [1, 4]
        assert (await post("/tokenize", prompt="fox", add_special_tokens=False))["tokens"] == [4]
        chat = (await post("/tokenize", messages=messages))["tokens"]
        assert chat[0] != 1 and (await post("/tokenize", messages=messages, add_special_tokens=True))["tokens"] == [1, *chat]
        assert await prompt_tokens("/v1/completions", prompt="fox") == 2
        assert await prompt_tokens("/v1/completions", prompt="fox", add_special_tokens=False) == 1
        assert await prompt_tokens("/v1/completions", prompt=[4], add_special_tokens=True) == 1  # ids stay as given
        assert await prompt_tokens("/v1/chat/completions", messages=messages) == len(chat)
        assert await prompt_tokens("/v1/chat/completions", messages=messages, add_special_tokens=True) == len(chat) + 1

    try:
        run(app, scenario)
    finally:
        engine.tokenizer.post_processor = None


def test_a_cache_salt_keeps_a_prompts_cached_blocks_to_its_own_salt(served):
    """Completions of one prompt of 3 full blocks: a salt the cache has not seen reuses nothing, the same salt
    again its first 2 blocks; each answers what the first did."""
    _, app, online = served
    prompt = list(range(5, 53))

    async def scenario(c):
        answers, reused = [], []
        for salt in ("tenant-a", "tenant-b", "tenant-a"):
            hits = online.batcher.blocks.stats.hit_tokens
            reply = await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3,
                                                           "temperature": 0, "cache_salt": salt})
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["choices"][0]["text"])
            reused.append(online.batcher.blocks.stats.hit_tokens - hits)
        return answers, reused

    answers, reused = run(app, scenario)
    assert reused == [0, 0, 32] and len(set(answers)) == 1


@pytest.mark.slow  # 100 requests of every kind, and a second engine for the truth
def test_a_storm_of_requests_cancellations_and_reloads_answers_each_as_alone_and_leaks_nothing(tmp_path):
    """Completions and chats, streamed or not, with n, log-probabilities, echo and stop strings, over two slots for
    three adapters and a cache of 8 blocks, while clients hang up mid-answer and an adapter is unloaded and loaded
    again under its name from the same files: no answer is a 5xx (a request for the adapter while it is unloaded may
    answer 404), every whole greedy completion is what an engine of one row generates for it alone, and at the end
    no row, block or adapter hold is left."""
    import random

    testing.write_model(str(tmp_path / "m"), CFG, seed=5)
    testing.write_tokenizer(str(tmp_path / "m"), CFG["vocab_size"])
    for i, name in enumerate("abc"):
        testing.write_adapter(str(tmp_path / "adapters" / name), CFG, r=4, alpha=8, seed=20 + i)
    options = dict(dtype="float32", max_lora_rank=8, max_seq_len=64, progress=False)
    engine = Engine.from_pretrained(str(tmp_path / "m"), max_loras=2, max_batch=4, kv_blocks=8, **options)
    truth = Engine.from_pretrained(str(tmp_path / "m"), max_loras=3, max_batch=1, **options)
    for name in "abc":
        truth.load_adapter(name, str(tmp_path / "adapters" / name))
    online = OnlineEngine(engine)
    app = build_app(online, ServerConfig(served_model_name="m", allow_runtime_lora=True,
                                         lora_roots=(str(tmp_path / "adapters"),)))
    online.start()
    rng, words = random.Random(0), [f"w{i}" for i in range(5, 100)]
    whole, statuses = [], []

    def request() -> tuple[float, str, dict, bool]:
        """(arrival s, path, body, hang up) of one request, drawn before any runs: the mix does not depend on
        timing."""
        body = {"model": rng.choice(["m", "a", "b", "c"]), "max_tokens": rng.randint(1, 16), "temperature": 0,
                "n": rng.choice([1, 1, 2]), "stream": rng.random() < 0.5}
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 20)))
        if rng.random() < 0.3:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
            body.update(logprobs=True, top_logprobs=2) if rng.random() < 0.5 else None
        else:
            path, body["prompt"] = "/v1/completions", prompt
            body.update(logprobs=2) if rng.random() < 0.5 else None
            body.update(echo=True) if rng.random() < 0.2 and not body["stream"] else None
            body.update(stop=[rng.choice(words)]) if rng.random() < 0.3 else None
        return rng.random() * 2, path, body, rng.random() < 0.2

    requests = [request() for _ in range(100)]
    pauses = [rng.random() * 1.5 for _ in range(4)]  # between the reloads

    async def one(c, arrival, path, body, hang_up):
        await asyncio.sleep(arrival)
        if body["stream"]:
            async with c.stream("POST", path, json=body) as response:
                statuses.append((body["model"], response.status_code))
                async for line in response.aiter_lines():
                    assert '"error"' not in line or response.status_code == 404, line
                    if hang_up:
                        return
            return
        task = asyncio.create_task(c.post(path, json=body))
        if hang_up:
            await asyncio.sleep(arrival / 4)
            task.cancel()
            return
        response = await task
        statuses.append((body["model"], response.status_code))
        if response.status_code == 200 and path == "/v1/completions" and not {"echo", "stop"} & set(body):
            whole.append((body, [choice["token_ids"] for choice in response.json()["choices"]]))

    async def reload(c):
        for pause in pauses:
            await asyncio.sleep(pause)
            for _ in range(500):  # 409 while requests use it
                unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
                if unload.status_code != 409:
                    break
                await asyncio.sleep(0.01)
            load = await c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "b"})
            assert (unload.status_code, load.status_code) == (200, 200), (unload.text, load.text)

    async def scenario(c):
        for name in "abc":
            assert (await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})).status_code == 200
        await asyncio.gather(*(one(c, *r) for r in requests), reload(c))

    try:
        run(app, scenario)
        assert all(status == 200 or (status == 404 and model == "b") for model, status in statuses), statuses
        assert len(whole) >= 10
        for body, got in whole:
            alone = truth.generate([body["prompt"]], [None if body["model"] == "m" else body["model"]],
                                   max_new_tokens=body["max_tokens"])[0]
            assert got == [list(alone)] * body["n"], body
        for _ in range(200):  # the hung-up requests end at the loop's next turns
            if online.batcher.num_running == 0 and online.num_waiting == 0:
                break
            time.sleep(0.05)
        blocks = online.batcher.blocks
        assert online.batcher.num_running == 0 and blocks.num_available == blocks.num_blocks
        assert not online.call(lambda: [n for n in "abc" if engine.pool.in_use(n)]).result(timeout=30)
    finally:
        online.stop()
