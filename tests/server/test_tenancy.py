"""`jlora serve --lora-dir DIR --max-loras 2`: 105 adapters served from one process over two device slots. Concurrent
requests over 8 of them equal the engine's own generation with all 8 resident; a corrupt adapter fails its own
requests with a clear error, every other tenant is served, and once fixed it is served after
--adapter-retry-after; an adapter added to the directory while serving is served by its name; an adapter evicted
from its slot comes back from the device cache without another copy; the tiers' metrics count what happened."""

import asyncio
import time

import pytest

for _module in ("uvicorn", "starlette", "prometheus_client", "jinja2", "pydantic"):  # the server's packages
    pytest.importorskip(_module)
httpx = pytest.importorskip("httpx")

from jlora import testing  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from tests.server.launch import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.xdist_group("tenancy")
CFG = testing.tiny_config("llama", vocab_size=120)
USED = [f"t{i:03d}" for i in range(0, 104, 13)]  # 8 of the 104
RETRY = 3  # seconds a failed load is remembered (--adapter-retry-after)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenancy")
    testing.write_model(str(root / "m"), CFG, seed=5)
    testing.write_tokenizer(str(root / "m"), CFG["vocab_size"])
    for i in range(104):
        testing.write_adapter(str(root / "lib" / f"t{i:03d}"), CFG, r=2 + i % 7, alpha=8, seed=i)
    testing.write_adapter(str(root / "lib" / "broken"), CFG, r=4, alpha=8, seed=1)
    (root / "lib" / "broken" / "adapter_model.safetensors").write_bytes(b"\x10garbage")
    return root


@pytest.fixture(scope="module")
def server(root):
    proc, url = start_server(str(root / "m"), "--lora-dir", str(root / "lib"), "--max-loras", "2",
                             "--max-cpu-loras", "3", "--device-cache-memory", "1", "--max-lora-rank", "8",
                             "--max-batch", "4", "--max-seq-len", "64", "--adapter-retry-after", str(RETRY))
    yield url
    stop_server(proc)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_many_adapters_over_two_slots_equal_the_resident_engine(server, root):
    models = {m["id"] for m in httpx.get(server + "/v1/models").json()["data"]}
    assert len(models) == 106 and {"m", "broken", *USED} <= models
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=8, max_lora_rank=8, max_seq_len=64,
                                    progress=False)
    for name in USED:
        engine.load_adapter(name, str(root / "lib" / name))
    jobs = [(USED[(3 * i) % 8], [1 + i, 2 + 2 * i, 3], 2 + i % 5) for i in range(24)]
    want = [list(engine.generate([p], [a], max_new_tokens=n)[0]) for a, p, n in jobs]

    async def one(http, adapter, prompt, n, delay):
        await asyncio.sleep(delay)
        body = {"model": adapter, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        response = await http.post(server + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, a, p, n, 0.01 * (i % 6)) for i, (a, p, n) in enumerate(jobs)))

    assert asyncio.run(run()) == want
    # then each adapter once more, one at a time: at least six were evicted, and come back from the device cache
    for name in USED:
        i = next(i for i, job in enumerate(jobs) if job[0] == name)
        body = {"model": name, "prompt": jobs[i][1], "max_tokens": jobs[i][2], "temperature": 0, "ignore_eos": True}
        out = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
        assert out["choices"][0]["token_ids"] == want[i]
    assert metric(server, 'jlora_adapter_tier_hits_total{tier="device_cache"}') >= 6
    assert metric(server, 'jlora_adapter_load_seconds_count{stage="host_to_device"}') == 8  # each copied once
    assert metric(server, "jlora_adapters_device_cache ") == 8  # (the space: not the _bytes gauge)
    assert metric(server, "jlora_adapters_device_cache_bytes") > 0
    assert metric(server, "jlora_adapter_evictions_total") > 0
    assert metric(server, 'jlora_adapter_tier_misses_total{tier="device"}') >= 8
    assert metric(server, 'jlora_adapter_load_seconds_count{stage="slot_write"}') >= 8
    assert metric(server, 'jlora_adapter_load_seconds_count{stage="queued"}') >= 8
    assert metric(server, 'jlora_adapter_load_seconds_count{stage="slot_wait"}') >= 8
    assert metric(server, "jlora_adapters_registered") == 105 and metric(server, "jlora_adapters_resident") <= 2
    assert metric(server, "jlora_adapter_slots_bytes") > 0
    assert metric(server, "jlora_requests_running") == 0


def test_a_corrupt_adapter_fails_its_own_requests_until_its_retry_and_others_are_served(server, root):
    """Its requests fail with the reason, read once: later ones at once, for --adapter-retry-after seconds. Its
    files fixed in place meanwhile (a copy that was still being written), the first request after reads them again
    and is served: a fault that passes disables no adapter for good."""
    body = {"model": "broken", "prompt": "the fox", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    for _ in range(2):
        response = httpx.post(server + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 500
        assert "'broken' cannot be loaded" in response.json()["error"]["message"]
        assert "<broken>/adapter_model.safetensors: cannot read safetensors" in response.json()["error"]["message"]
        assert f"fail at once for {RETRY} s" in response.json()["error"]["message"]
        assert str(root) not in response.json()["error"]["message"]  # no server path
    assert metric(server, 'jlora_requests_total{adapter="broken",outcome="failed"}') == 2
    ok = httpx.post(server + "/v1/completions", json=body | {"model": USED[0]}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
    testing.write_adapter(str(root / "lib" / "broken"), CFG, r=2, alpha=8, seed=0)  # t000's weights
    assert httpx.post(server + "/v1/completions", json=body, timeout=60).status_code == 500
    assert metric(server, "jlora_adapter_load_failures_total") == 1  # read once
    time.sleep(RETRY)
    fixed = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert fixed.status_code == 200, fixed.text
    want = httpx.post(server + "/v1/completions", json=body | {"model": "t000"}, timeout=60)
    assert fixed.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    assert metric(server, "jlora_adapter_load_failures_total") == 1


def test_an_adapter_added_to_the_lora_dir_while_serving_is_served_by_its_name(server, root):
    """A subdirectory added to --lora-dir after the start: named by a request, it is registered and served (before:
    404 until a restart); GET /v1/models lists one added since. Only a subdirectory's own name resolves. One
    removed is neither listed nor served (404) until it is back."""
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    want = httpx.post(server + "/v1/completions", json=body | {"model": "t013"}, timeout=60).json()
    testing.write_adapter(str(root / "lib" / "late"), CFG, r=2 + 13 % 7, alpha=8, seed=13)  # t013's weights
    testing.write_adapter(str(root / "lib" / "listed"), CFG, r=2, alpha=8, seed=0)
    testing.write_adapter(str(root / "outside"), CFG, r=2, alpha=8, seed=0)
    for name in ("../outside", "late/..", "lib/late", "nope"):
        response = httpx.post(server + "/v1/completions", json=body | {"model": name}, timeout=60)
        assert response.status_code == 404, (name, response.text)
    late = httpx.post(server + "/v1/completions", json=body | {"model": "late"}, timeout=60)
    assert late.status_code == 200, late.text
    assert late.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    models = [m["id"] for m in httpx.get(server + "/v1/models").json()["data"]]
    assert {"late", "listed"} <= set(models) and "outside" not in models and len(models) == 108
    assert metric(server, "jlora_adapters_registered") == 107
    (root / "lib" / "late").rename(root / "late-away")  # removed: not listed, not served, until it is back
    models = [m["id"] for m in httpx.get(server + "/v1/models").json()["data"]]
    assert "late" not in models and len(models) == 107 and metric(server, "jlora_adapters_registered") == 106
    assert httpx.post(server + "/v1/completions", json=body | {"model": "late"}, timeout=60).status_code == 404
    (root / "late-away").rename(root / "lib" / "late")
    again = httpx.post(server + "/v1/completions", json=body | {"model": "late"}, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


def test_lora_dir_registers_each_adapter_and_names_what_it_skips(root, tmp_path, capsys):
    """`--lora-dir` beside `--lora`: a subdirectory named like the served model, one with an invalid adapter name
    and one a `--lora` registered already are skipped, each said on stderr with why; a directory without an
    adapter_config.json is not an adapter. `--lora` names that collide are refused before the model loads."""
    from jlora.engine_config import EngineConfig
    from jlora.server import ServerConfig
    from jlora.server.serve import build

    lib = tmp_path / "lib"
    for name in ("ok", "m", "-dash", "dup"):
        testing.write_adapter(str(lib / name), CFG, r=2, alpha=4, seed=3)
    (lib / "notes").mkdir()
    options = EngineConfig(dtype="float32", max_loras=2, max_lora_rank=8, max_batch=2, max_seq_len=32)
    for loras, message in (([("m", str(lib / "ok"))], "'m': that is the served base model's name"),
                           ([("x", str(lib / "ok")), ("x", str(lib / "dup"))], "--lora 'x' is given twice")):
        with pytest.raises(ValueError, match=message):
            build(str(root / "nowhere"), ServerConfig(served_model_name="m"), options, loras=loras)
    _, online, config = build(str(root / "m"), ServerConfig(), options, loras=[("dup", str(lib / "ok"))],
                              lora_dirs=[str(lib)])
    assert config.served_model_name == "m"
    registry = online.engine.registry
    assert registry.names == ["dup", "ok"] and registry.get("dup").adapter_dir == str(lib / "ok")
    err = capsys.readouterr().err
    assert f"1 adapter registered from {lib}" in err
    for sub, why in (("-dash", "invalid adapter name"), ("dup", "registered already"),
                     ("m", "the served base model's name")):
        assert f"skipped {lib / sub}: {why}" in err, err
    assert "notes" not in err
