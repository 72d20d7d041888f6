"""`jlora serve` probed as an attacker on the network would probe it: every row of the probe table (issue 35)
answers 4xx JSON naming the problem, generated hostile bodies never reach a 500 and leave a greedy request's
tokens as they were, costs are bounded before heavy work (body size, prompt characters, tokenizing off the
event loop, memory), disconnects free rows whether streamed or not, slow clients are cut off, and runtime
loads stay inside --lora-root."""

import json
import os
import shutil
import socket
import threading
import time

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

for _module in ("uvicorn", "starlette", "prometheus_client", "jinja2", "pydantic"):  # the server's packages
    pytest.importorskip(_module)
httpx = pytest.importorskip("httpx")

from jlora import testing  # noqa: E402
from tests.server.launch import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.xdist_group("hardening")  # one server for the module (make test runs --dist loadgroup)

CFG = testing.tiny_config("llama", vocab_size=120)
MAX_SEQ = 1 << 16  # its prompts may have 2^20 characters (2^16 tokens x 16): a tokenization that takes a while
MAX_BODY = 2 << 20  # room for the longest prompt (2^20 characters)
GREEDY = {"model": "m", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    testing.write_model(str(root / "m"), CFG, seed=5)
    testing.write_tokenizer(str(root / "m"), CFG["vocab_size"])
    os.makedirs(root / "adapters")
    testing.write_adapter(str(root / "adapters" / "good"), CFG, r=4, alpha=8, seed=1)
    testing.write_adapter(str(root / "outside"), CFG, r=4, alpha=8, seed=2)  # a real adapter outside the root
    os.symlink(root / "outside", root / "adapters" / "link-out")
    os.symlink(root / "adapters" / "good", root / "adapters" / "link-in")
    for name, target in [("file-out", root / "outside"), ("file-in", root / "adapters" / "good")]:
        os.makedirs(root / "adapters" / name)  # a directory inside the root whose weights file is a link
        shutil.copy(root / "adapters" / "good" / "adapter_config.json", root / "adapters" / name)
        os.symlink(target / "adapter_model.safetensors", root / "adapters" / name / "adapter_model.safetensors")
    os.makedirs(root / "adapters" / "config-out")  # ... whose config is a link out of it
    shutil.copy(root / "adapters" / "good" / "adapter_model.safetensors", root / "adapters" / "config-out")
    os.symlink(root / "outside" / "adapter_config.json", root / "adapters" / "config-out" / "adapter_config.json")
    return root


@pytest.fixture(scope="module")
def server(root):
    proc, url = start_server(str(root / "m"), "--max-seq-len", str(MAX_SEQ), "--max-batch", "2", "--max-loras", "2",
                       "--max-lora-rank", "8", "--allow-runtime-lora", "--lora-root", str(root / "adapters"),
                       "--max-body-bytes", str(MAX_BODY), "--body-timeout", "1", "--header-timeout", "1",
                       "--max-connections", "24", "--lora", f"a={root / 'adapters' / 'good'}")
    yield url, proc
    stop_server(proc)


# The module's one client, which keeps no connection open between requests, as httpx.post does: building a client
# costs about 50 ms (its TLS context), more than most requests here take.
CLIENT = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


def post(url: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return CLIENT.post(url + path, content=content, headers={"content-type": "application/json"}, **kw)


def assert_clean(response: httpx.Response, *what) -> None:
    """2xx, or a 4xx whose body is OpenAI's JSON error with a message: never a 5xx (`what` names the case)."""
    assert response.status_code < 500, (*what, response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["code"] == response.status_code


def metric(url: str, name: str) -> float:
    text = CLIENT.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def greedy(url: str) -> list[int]:
    response = post(url, "/v1/completions", GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def rss(proc) -> int:
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _config(**changes) -> bytes:
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    return json.dumps(cfg | changes).encode()


# The probe table: (route, body, status, what the message says). Rows 7-9 are tests of their own below.
PROBES = {
    "1 a body of 100k [ and 100k ]": ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
    "2 an object nested 50k deep in a field": (
        "/v1/completions", b'{"model": "m", "prompt": "x", "user": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001,
        400, "recursion limit"),
    "3 max_tokens of 5000 digits": ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": '
                                    + b"9" * 5000 + b"}", 400, "number out of range"),
    "4 a lone surrogate in a prompt": ("/v1/completions", b'{"model": "m", "prompt": "a\\ud800b"}', 400,
                                       "not valid JSON"),
    "5 a lone surrogate in a chat message": (
        "/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}', 400,
        "not valid JSON"),
    "6 stream as a string": ("/v1/completions", {"model": "m", "prompt": "x", "stream": "false"}, 400,
                             "invalid 'stream'"),
    "6 ignore_eos as a string": ("/v1/completions", {"model": "m", "prompt": "x", "ignore_eos": "false"}, 400,
                                 "invalid 'ignore_eos'"),
    "non-string chat content": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]},
                                400, "messages.0.content"),
    "invalid UTF-8": ("/v1/completions", b'{"model": "m", "prompt": "\xff"}', 400, "not valid JSON"),
    "a prompt too long in characters": ("/v1/completions", {"model": "m", "prompt": "a" * (MAX_SEQ * 16 + 1)}, 400,
                                        "characters, more than the maximum context"),
    "messages too long in characters": (
        "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a" * (MAX_SEQ * 16 + 1)}]},
        400, "longer than the maximum context"),
    "a float max_tokens": ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2.0}, 400,
                           "invalid 'max_tokens'"),
    "a NaN temperature": ("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": NaN}', 400,
                          "invalid 'temperature'"),
    "a huge seed": ("/v1/completions", {"model": "m", "prompt": "x", "seed": 2**64}, 400, "invalid 'seed'"),
    "a stop list of objects": ("/v1/completions", {"model": "m", "prompt": "x", "stop": [{}]}, 400, "'stop' must be"),
    "a negative stop token": ("/v1/completions", {"model": "m", "prompt": "x", "stop_token_ids": [-1]}, 400,
                              "invalid 'stop_token_ids.0'"),
    "a stop token past the vocabulary": ("/v1/completions", {"model": "m", "prompt": "x", "stop_token_ids": [10**6]},
                                         400, "stop token ids [1000000] are outside [0, 120)"),
    "a stop id past the vocabulary": ("/v1/completions", {"model": "m", "prompt": "x", "stop": ["a", 2**31 - 1]},
                                      400, "would never match"),
    "17 a lora_path with a lone surrogate": ("/v1/load_lora_adapter",
                                             b'{"lora_name": "x", "lora_path": "\\ud800"}', 400, "not valid JSON"),
    "18 an adapter name with a lone surrogate": ("/v1/load_lora_adapter",
                                                 b'{"lora_name": "\\ud800", "lora_path": "good"}', 400, "not valid JSON"),
    "an adapter name with a space": ("/v1/load_lora_adapter", {"lora_name": "a b", "lora_path": "good"}, 400,
                                     "invalid adapter name"),
    "an adapter name of 200 characters": ("/v1/load_lora_adapter", {"lora_name": "a" * 200, "lora_path": "good"},
                                          400, "invalid adapter name"),
    "a lora_path with a NUL": ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "go\x00od"}, 400, "NUL"),
    "a name already served": ("/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "good"}, 400, "already served"),
    "an empty list as the prompt": ("/v1/completions", {"model": "m", "prompt": []}, 400, "the prompt is empty"),
    "an empty prompt in a batch": ("/v1/completions", {"model": "m", "prompt": ["the fox", ""]}, 400,
                                   "prompt 1 is empty"),
    "a token past the vocabulary in a batch": ("/v1/completions", {"model": "m", "prompt": [[1, 2], [3, 120, 4]]},
                                               400, "prompt 1 has token ids outside [0, 120) (120 at position 1)"),
    "a model name of a megabyte": ("/v1/completions", {"model": "x" * (1 << 20), "prompt": "a"}, 404,
                                   "'" + "x" * 77 + "...' does not exist"),
}


@pytest.mark.parametrize("case", list(PROBES))
def test_each_probe_answers_4xx_json_naming_the_problem(server, case):
    url, _ = server
    route, body, status, match = PROBES[case]
    response = post(url, route, body)
    assert response.status_code == status, response.text[:300]
    assert match in response.json()["error"]["message"]
    assert CLIENT.get(url + "/v1/models").status_code == 200 and CLIENT.get(url + "/metrics").status_code == 200


# Rows 10-16: adapter configs at runtime load, each a 400 naming the field; /v1/models and /metrics unchanged.
CONFIGS = {
    "10 target_modules: 5": (_config(target_modules=5), "'target_modules' must be"),
    "11 lora_alpha: '16'": (_config(lora_alpha="16"), "'lora_alpha' must be a finite number"),
    "12 rank_pattern: 'x'": (_config(rank_pattern="x"), "'rank_pattern' must be"),
    "13 layers_to_transform: 'abc'": (_config(layers_to_transform="abc"), "'layers_to_transform' must be"),
    "14 a JSON list as the config": (b"[" + _config() + b"]", "must hold a JSON object"),
    "15 nesting 100k deep": (b'{"r": 4, "lora_alpha": 8, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                             "nested too deeply"),
    "16 r: 0": (_config(r=0), "'r' must be a positive integer"),
    "a NaN lora_alpha": (_config(lora_alpha=float("nan")), "'lora_alpha' must be a finite number"),
    "an infinite lora_alpha": (_config(lora_alpha=float("inf")), "'lora_alpha' must be a finite number"),
    "lora_alpha 1e38": (_config(lora_alpha=1e38), "magnitude at most"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_adapter_configs_at_runtime_answer_400_and_change_nothing(server, root, case):
    url, _ = server
    text, match = CONFIGS[case]
    name = "bad-" + case.split()[0]
    path = root / "adapters" / name
    testing.write_adapter(str(path), CFG, r=4, alpha=8, seed=3)
    (path / "adapter_config.json").write_bytes(text)
    models, metrics = CLIENT.get(url + "/v1/models").json(), metric(url, "jlora_adapter_loads_total")
    response = post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": name})
    assert response.status_code == 400 and match in response.json()["error"]["message"], response.text
    assert str(root) not in response.json()["error"]["message"]  # the caller's path, not the server's
    assert [m["id"] for m in CLIENT.get(url + "/v1/models").json()["data"]] == [m["id"] for m in models["data"]]
    assert metric(url, "jlora_adapter_loads_total") == metrics


def test_runtime_loads_stay_inside_the_lora_root(server, root):
    url, _ = server
    for path in ("../outside", str(root / "outside"), "link-out", "/etc", "good/../../outside", "/"):
        response = post(url, "/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": path})
        assert response.status_code == 403 and "outside the directories" in response.json()["error"]["message"], path
    for path in ("file-out", "config-out"):  # a directory inside, a file of it linked to one outside
        response = post(url, "/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": path})
        message = response.json()["error"]["message"]
        assert response.status_code == 403 and "leads through a link outside the directories" in message, path
        assert str(root) not in message
        assert "escape" not in [m["id"] for m in CLIENT.get(url + "/v1/models").json()["data"]]
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nope"}).status_code == 400
    want = {"model": "in", "prompt": "the fox", "max_tokens": 4, "temperature": 0}
    # inside: as a symlink, absolute, relative, and with its weights a link to a file inside (a Hugging Face cache's
    # snapshot linking to its blobs)
    for path in ("link-in", str(root / "adapters" / "good"), "./good/", "file-in"):
        assert post(url, "/v1/load_lora_adapter", {"lora_name": "in", "lora_path": path}).status_code == 200, path
        models = CLIENT.get(url + "/v1/models").json()["data"]
        assert all(m["root"] == m["id"] for m in models)  # names, never server paths
        tokens = post(url, "/v1/completions", want).json()["choices"][0]["token_ids"]
        assert tokens == post(url, "/v1/completions", want | {"model": "a"}).json()["choices"][0]["token_ids"]
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": "in"}).status_code == 200


def test_a_body_over_the_limit_is_refused_while_read_and_memory_returns(server):
    url, proc = server
    post(url, "/v1/completions", {"model": "m", "prompt": "a" * (MAX_BODY - 100)})  # warm the allocator
    before = rss(proc)
    start = time.monotonic()
    big = b'{"model": "m", "prompt": "' + b"a" * (20 << 20) + b'"}'  # row 8: a 20 MB prompt
    response = post(url, "/v1/completions", big)
    assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(40):
            yield b"a" * (1 << 20)

    response = CLIENT.post(url + "/v1/completions", content=chunks())
    assert response.status_code == 413
    for _ in range(3):  # the largest body accepted, refused by its characters before tokenizing
        response = post(url, "/v1/completions", {"model": "m", "prompt": "a" * (MAX_BODY - 100)})
        assert response.status_code == 400 and "characters" in response.json()["error"]["message"]
    assert time.monotonic() - start < 10
    assert rss(proc) - before < 64 << 20, (before, rss(proc))
    assert greedy(url) == greedy(url)


def test_health_answers_within_100ms_while_a_maximal_prompt_is_tokenized(server):
    url, _ = server
    text = "the w55 " * (MAX_SEQ * 16 // 8)  # exactly the characters a prompt may have: tokenized, then refused
    result = {}

    def big():
        result["response"] = post(url, "/v1/completions", {"model": "m", "prompt": text})

    with httpx.Client() as client:
        client.get(url + "/health")
        thread = threading.Thread(target=big)
        thread.start()
        latencies = []
        while thread.is_alive():
            start = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.005)
        thread.join()
    assert result["response"].status_code == 400 and "maximum context" in result["response"].json()["error"]["message"]
    assert len(latencies) >= 5 and max(latencies) < 0.1, latencies


def test_a_non_streamed_client_that_disconnects_frees_its_row(server):
    url, _ = server
    cancelled = metric(url, 'jlora_requests_total{adapter="base",outcome="cancelled"}')
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "m", "prompt": "the dog", "max_tokens": 60_000, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        for _ in range(200):
            if metric(url, "jlora_requests_running") == 1:
                break
            time.sleep(0.05)
        assert metric(url, "jlora_requests_running") == 1
        assert metric(url, "jlora_kv_cache_blocks_used") == 1  # a contiguous cache: one block per request
    start = time.monotonic()
    while metric(url, 'jlora_requests_total{adapter="base",outcome="cancelled"}') == cancelled:
        assert time.monotonic() - start < 5, "the row was not freed"
        time.sleep(0.02)
    assert metric(url, "jlora_requests_running") == 0
    assert metric(url, "jlora_kv_cache_blocks_used") == 0 and metric(url, "jlora_kv_cache_blocks ") >= 1


def test_slow_clients_are_cut_off(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:  # headers that never finish: closed after 1 s
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        s.settimeout(5)
        start = time.monotonic()
        assert s.recv(1024) == b"" and time.monotonic() - start < 4
    with socket.create_connection((host, int(port))) as s:  # a body that never arrives: 408 after 1 s
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"mo")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 408")
    idle = [socket.create_connection((host, int(port))) for _ in range(24)]  # the connection cap (24)
    try:
        assert CLIENT.get(url + "/health").status_code == 503
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert CLIENT.get(url + "/health").status_code == 200


# --- fuzzing -----------------------------------------------------------------------------------------------------
_scalar = (st.none() | st.booleans() | st.integers(-3, 40) | st.integers(min_value=2**31) | st.integers(max_value=-2**31)
           | st.floats() | st.text(st.characters(categories=["Cs", "L", "N", "P", "Z"]), max_size=12)  # Cs: surrogates
           | st.sampled_from(["m", "a", "true", "", "the fox"]))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=4), max_leaves=10)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stop_token_ids",
           "ignore_eos", "stream", "n", "best_of", "logprobs", "top_logprobs", "echo", "user", "stream_options",
           "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "skip_special_tokens", "bad_words", "prompt_logprobs",
           "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "add_special_tokens",
           "cache_salt", "chat_template", "priority"]
_VALID = {"/v1/completions": {"model": "m", "prompt": "the quick fox", "max_tokens": 3},
          "/v1/chat/completions": {"model": "a", "messages": [{"role": "user", "content": "the dog"}],
                                   "max_completion_tokens": 3}}


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    route = draw(st.sampled_from(list(_VALID)))
    body = dict(_VALID[route])
    kind = draw(st.sampled_from(["fields", "fields", "fields", "not an object", "raw", "nested", "number"]))
    if kind == "fields":  # max_completion_tokens stays: a chat without a limit would generate to the context
        for field in draw(st.lists(st.sampled_from(_FIELDS) | st.text(max_size=6), min_size=1, max_size=3)):
            if field in body and draw(st.booleans()):
                del body[field]
            else:
                body[field] = draw(_json)
        return route, json.dumps(body).encode()
    if kind == "not an object":
        return route, json.dumps(draw(_json)).encode()
    if kind == "raw":
        return route, draw(st.binary(max_size=64) | st.just(json.dumps(body).encode()[: draw(st.integers(0, 40))]))
    depth = draw(st.integers(150, 20_000))
    if kind == "nested":
        field = draw(st.sampled_from(_FIELDS))
        return route, json.dumps(body).encode()[:-1] + b', "%s": ' % field.encode() + b"[" * depth + b"]" * depth + b"}"
    field = draw(st.sampled_from(_FIELDS))
    return route, json.dumps(body).encode()[:-1] + b', "%s": %s}' % (field.encode(), b"7" * draw(st.integers(1, 6000)))


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_generated_bodies_never_reach_a_500(server, fuzz_baseline, case):
    url, _ = server
    route, body = case
    assert_clean(post(url, route, body))


# Values a random draw puts in a given field rarely (an empty list as the prompt once reached a 500), each tried in
# every field of every route that parses a body; one token generated where the body is valid.
EDGES = [None, True, -1, 2**31, 1.5, "", [], [[]], [""], [-1], {}, [{}]]
_ROUTE_FIELDS = {
    "/v1/completions": (_VALID["/v1/completions"] | {"max_tokens": 1}, _FIELDS),
    "/v1/chat/completions": (_VALID["/v1/chat/completions"] | {"max_completion_tokens": 1}, _FIELDS),
    "/tokenize": ({"prompt": "the fox"}, ["prompt", "messages", "add_special_tokens", "chat_template"]),
    "/detokenize": ({"tokens": [1, 2]}, ["tokens"]),
}


def test_every_field_at_each_edge_value_never_reaches_a_500(server, fuzz_baseline):
    url, _ = server
    for route, (body, fields) in _ROUTE_FIELDS.items():
        for field in fields:
            for value in EDGES:
                assert_clean(post(url, route, body | {field: value}), route, field, value)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["f1", "f2", "a", "m", ""]) | _json,
       path=st.sampled_from(["good", "link-in", "link-out", "../outside", "/", ".", "nope", "bad-16"]) | _json)
def test_generated_loads_never_reach_a_500(server, fuzz_baseline, name, path):
    url, _ = server
    response = post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert_clean(response)
    if response.status_code == 200:
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


@pytest.fixture(scope="module")
def fuzz_baseline(server):
    """A greedy request's tokens before the fuzzing and, checked at the module's end, after it."""
    url, _ = server
    before = greedy(url)
    yield
    assert greedy(url) == before
    assert metric(url, "jlora_requests_running") == 0
