"""jlora on Ray Serve (`jlora.ray`): a local Ray cluster with 2 replicas of a tiny model behind the router, driven
over HTTP as a client would. Requests for 7 adapters and the base model from concurrent clients return what
`Engine.generate` gives each alone; an adapter's requests stay on the replica that loaded it; bad input gets
the server's 4xx through the router; a replica killed mid-answer fails its requests with a clear error, not a
hang, and Ray Serve replaces it."""

import asyncio
import dataclasses
import os
import re
import signal
import socket
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from jlora import testing  # noqa: E402
from jlora.adapters.peft import LINEAR_MODULES  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from jlora.engine_config import EngineConfig  # noqa: E402
from tests.server.launch import process_ids, start_server  # noqa: E402

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.slow]
CFG = testing.tiny_config("llama", vocab_size=120)
TARGETS = [["q_proj", "v_proj"], LINEAR_MODULES, ["o_proj", "down_proj"], ["gate_proj", "up_proj"]]
NAMES = [f"t{i}" for i in range(7)]
# Ray Serve's router gives up on a replica whose queue-length reply takes longer than 0.1 s, and on the replicas
# holding a request's adapter after 1-2 s: then it routes to another replica, which loads the adapter a second
# time. On a loaded 2-core CI machine both happen by chance; the local cluster's processes inherit these.
PATIENT_ROUTING = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5",
                   "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10",
                   "RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S": "60"}
# The host tier holds every adapter: a replica that took more than its share in the first wave (routing falls
# back under load) keeps them all, and Ray's multiplexed LRU does not drop one from the routing tables.
OPTIONS = EngineConfig(dtype="float32", max_loras=4, max_cpu_loras=len(NAMES), max_lora_rank=8, max_batch=8,
                       max_seq_len=160)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    testing.write_model(str(root / "m"), CFG, seed=9)
    testing.write_tokenizer(str(root / "m"), CFG["vocab_size"])
    for i, name in enumerate(NAMES):
        r = (2, 4, 8)[i % 3]
        testing.write_adapter(str(root / "adapters" / name), CFG, r=r, alpha=2 * r, seed=60 + i,
                              target_modules=TARGETS[i % len(TARGETS)])
    return root


@pytest.fixture(scope="module")
def url(root):
    from jlora.ray import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    patch = pytest.MonkeyPatch()
    for name, value in PATIENT_ROUTING.items():
        patch.setenv(name, value)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        for attempt in range(3):  # on a loaded 2-core machine Serve's proxy actor may miss Ray's 60 s to start
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                break
            except (ray.exceptions.RayError, TimeoutError):
                if attempt == 2:
                    raise
                serve.shutdown()
        # Through `serve run jlora.ray:app`'s entry point, as a Serve config file's args give them (its numbers as
        # numbers, the adapter directories as a list; the text of `serve run KEY=VALUE` is test_engine_config's).
        options = {f.name: getattr(OPTIONS, f.name) for f in dataclasses.fields(OPTIONS)
                   if getattr(OPTIONS, f.name) != f.default}
        serve.run(app({"model": str(root / "m"), "served_model_name": "tiny", "lora_dir": [str(root / "adapters")],
                       "replicas": 2, **options}), name="jlora", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        patch.undo()


@pytest.fixture(scope="module")
def engine(root):
    eng = Engine.from_pretrained(str(root / "m"), OPTIONS, progress=False)
    eng.registry.scan(str(root / "adapters"))
    return eng


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_with_replicas_stops_on_ctrl_c_and_sigterm_as_one_server_does(root, signum):
    """`jlora serve --replicas 1` on a local cluster of its own, stopped by Ctrl-C (130 and one line) or SIGTERM (by
    the signal, where under Ray's handler it ended by SIGABRT), with no traceback; Ray's processes go with it.
    (First in the module: the module's own cluster has not started yet.)"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc, url = start_server(str(root / "m"), "--replicas", "1", "--lora-dir", str(root / "adapters"), "--max-batch",
                             "2", "--max-seq-len", "64", env=env)
    try:
        answer = httpx.post(url + "/v1/completions", json=body(NAMES[0], 0), timeout=120)
        assert answer.status_code == 200, answer.text
        before = set(_ray_processes())
        proc.send_signal(signum)
        out = proc.communicate(timeout=180)[0].decode()
    finally:
        proc.kill()
    assert proc.returncode == (130 if signum == signal.SIGINT else -signal.SIGTERM), out[-3000:]
    assert "jlora: shutting down" in out and "Traceback" not in out, out[-3000:]
    assert ("jlora serve: interrupted" in out) == (signum == signal.SIGINT)
    deadline = time.monotonic() + 120  # Ray's agents notice their node has gone within a minute or so
    while (left := before & set(_ray_processes())) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"Ray processes {left} outlived `jlora serve`"


def _ray_processes() -> list[int]:
    """The pids of this machine's Ray processes (`ray::...`, raylet, gcs_server)."""
    found = []
    for pid in process_ids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().split(b"\0")[0]
        except OSError:
            continue
        if command.startswith(b"ray::") or os.path.basename(command) in (b"raylet", b"gcs_server"):
            found.append(pid)
    return found


def body(model: str, i: int) -> dict:
    """Request i for `model`: greedy for even i, seeded sampling for odd."""
    return {"model": model, "prompt": [1 + i, 2 + 3 * i, 5, 8 + i], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0.0 if i % 2 == 0 else 1.0, "seed": 100 + i}


async def send_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))


def test_many_adapters_from_concurrent_clients_and_affinity(url, engine):
    """Each adapter's first request (one at a time) loads it on one replica; then 4 requests per adapter at
    once. Every answer equals `Engine.generate` of the request alone; an adapter's requests go to the replica
    that loaded it. Ray Serve routes by adapter on a best-effort basis (a replica slow to tell its queue length
    loses the request to another) so one adapter of 7 may land on both replicas on a loaded machine; routing
    that ignored the adapter would split nearly all of them (each with probability 7/8)."""
    models = ["tiny", *NAMES]
    first = [httpx.post(url + "/v1/completions", json=body(m, 0), timeout=300) for m in models]
    time.sleep(5)  # the replicas' adapters reach the routers' routing tables (pushed through the controller)
    bodies = [body(m, i) for m in models for i in range(1, 5)]
    responses = first + asyncio.run(send_all(url, bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    replica_of: dict[str, set[str]] = {}
    loads: dict[str, int] = {}
    for b, r in zip([body(m, 0) for m in models] + bodies, responses):
        adapter = None if b["model"] == "tiny" else b["model"]
        alone = engine.generate([b["prompt"]], [adapter], max_new_tokens=6, temperature=b["temperature"],
                                seed=b["seed"])[0]
        assert r.json()["choices"][0]["token_ids"] == list(alone), b
        replica = r.headers["x-jlora-replica"]
        loads[replica] = max(loads.get(replica, 0), int(r.headers["x-jlora-replica-loads"]))
        if adapter is not None:
            replica_of.setdefault(adapter, set()).add(replica)
    placed = {m: r.headers["x-jlora-replica"] for m, r in zip(models, first)}
    split = [a for a, replicas in replica_of.items() if len(replicas) > 1]
    assert len(split) <= 1, (replica_of, placed)
    assert len(set().union(*replica_of.values())) == 2  # both replicas serve
    assert sum(loads.values()) == len(NAMES) + len(split), (loads, placed)  # one load per (adapter, replica)


def test_streams_and_bad_input_through_the_router(url):
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json={"model": "t1", "messages": [{"role": "user", "content": "the dog"}], "max_tokens": 4,
                            "stream": True, "logprobs": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 4
    for path, payload, status, match in [
            ("/v1/completions", b"{not json", 400, "not valid JSON"),
            ("/v1/completions", {"model": "nope", "prompt": "the"}, 404, "does not exist"),
            ("/v1/completions", {"model": "t2", "prompt": "the", "max_tokens": 10**4}, 400, "maximum context"),
            ("/v1/chat/completions", {"model": "t3", "messages": "hi"}, 400, "messages"),
            ("/v1/nothing", {}, 404, "no route")]:
        kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
        response = httpx.post(url + path, timeout=120, **kw)
        assert response.status_code == status and match in response.json()["error"]["message"], response.text
    assert {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]} == {"tiny", *NAMES}


def served(url: str) -> tuple[set[str], float]:
    """What `/metrics` shows: the replicas it labels, and the requests they finished in all."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url + "/metrics", timeout=60)
    assert response.status_code == 200, response.text
    replicas, finished = set(), 0.0
    for family in text_string_to_metric_families(response.text):
        replicas |= {sample.labels["replica"] for sample in family.samples}
        finished += sum(s.value for s in family.samples if s.name == "jlora_requests_total")
    return replicas, finished


def test_metrics_show_every_replica(url):
    """`/metrics`, answered by one replica, holds both replicas' metrics, each sample labelled with its replica
    (one replica's alone, unlabelled, went to whichever answered): the count of finished requests over both
    grows by exactly the requests sent, whichever replicas served them."""
    deadline, before = time.monotonic() + 30, None
    while before is None or len(before[0]) < 2 or served(url) != before:  # the counts settled: a replica that
        assert time.monotonic() < deadline, f"/metrics shows {before}"  # did not answer sent them 2 s ago at most
        before = served(url)
        time.sleep(2.5)
    responses = asyncio.run(send_all(url, [body(model, i) for i, model in enumerate(["tiny", "t0", "t1"] * 2)]))
    assert all(r.status_code == 200 for r in responses)
    assert {r.headers["x-jlora-replica"] for r in responses} <= before[0]
    while (after := served(url))[1] != before[1] + 6:  # the replica that answers sends its own as of now
        assert time.monotonic() < deadline + 30 and after[1] < before[1] + 6, (before, after)
        time.sleep(0.5)
    assert after[0] == before[0]


def test_a_killed_replica_fails_its_requests_clearly_and_is_replaced(url):
    long = {"model": "t4", "prompt": [3, 4, 5], "max_tokens": 150, "ignore_eos": True, "temperature": 0}
    first = httpx.post(url + "/v1/completions", json={**long, "max_tokens": 1}, timeout=120)
    replica = first.headers["x-jlora-replica"]
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if replica in a["name"]]
    assert len(actors) == 1, actors

    async def run() -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            waiting = asyncio.create_task(client.post(url + "/v1/completions", json=long))
            async with client.stream("POST", url + "/v1/completions", json={**long, "stream": True}) as stream:
                events = []
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        if len(events) == 3:  # mid-answer
                            ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]))
            return events, await waiting

    events, answer = asyncio.run(asyncio.wait_for(run(), 120))
    assert "failed mid-answer" in events[-1] and "[DONE]" not in events[-1]
    if answer.status_code == 200:  # routed to the other replica
        assert answer.headers["x-jlora-replica"] != replica
    else:  # held by the killed replica, its answer not begun
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
        assert "failed (ActorDiedError); retry" in answer.json()["error"]["message"]
    deadline = time.time() + 180
    while time.time() < deadline:  # Ray Serve starts a new replica; t4's requests go on
        response = httpx.post(url + "/v1/completions", json={**long, "max_tokens": 2}, timeout=120)
        if response.status_code == 200 and response.headers["x-jlora-replica"] != replica:
            break
        time.sleep(1)
    else:
        raise AssertionError("no replica answered after the kill")
    status = serve.status().applications["jlora"].deployments["Replica"]
    assert sum(status.replica_states.values()) >= 2 or status.status == "HEALTHY"


def test_removing_the_app_leaves_serve_and_kills_its_metrics_actor(url):
    """What `jlora serve --replicas` leaves on a shared cluster (RAY_ADDRESS) when it stops: no "jlora" app and no
    detached metrics actor, but Ray Serve still running for the cluster's other applications. (Runs last of the
    tests that use the deployment.)"""
    from jlora.ray import remove_app

    named = lambda: {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert "jlora-metrics" in named() and "jlora" in serve.status().applications
    remove_app()
    deadline = time.time() + 60
    while "jlora" in serve.status().applications and time.time() < deadline:
        time.sleep(0.5)
    assert "jlora" not in serve.status().applications and "jlora-metrics" not in named()
    assert serve.status().proxies  # Serve itself is up
    remove_app()  # again: nothing to remove is not an error


def test_a_replica_whose_engine_stopped_for_good_fails_its_health_check():
    """Ray Serve replaces a replica whose `check_health` raises: one whose engine loop stopped for good (a failure
    it could not start over from) says why; a running one passes."""
    from types import SimpleNamespace

    from jlora.ray import Replica

    check = Replica.func_or_class.check_health
    check(SimpleNamespace(online=SimpleNamespace(down=None)))
    stopped = SimpleNamespace(online=SimpleNamespace(down="the engine step failed: ..."))
    with pytest.raises(RuntimeError, match="the engine step failed"):
        check(stopped)


def test_replicas_that_fail_to_start_say_why(monkeypatch):
    """A deployment whose replicas fail in __init__ ends `jlora serve --replicas` with the replica's own error,
    which Ray Serve keeps as the last line of the traceback in the deployment's status (its exception says only
    "Failed to update the deployments"); with no such message, Ray's error stands."""
    from types import SimpleNamespace

    import jlora.ray as jlora_ray

    def failed(*args, **kwargs):
        raise RuntimeError("Deploying application jlora failed: Failed to update the deployments ['Replica'].")

    def status(message):
        replica = SimpleNamespace(message=message)
        return lambda: SimpleNamespace(applications={"jlora": SimpleNamespace(deployments={"Replica": replica})})

    monkeypatch.setattr(jlora_ray.serve, "run", failed)
    monkeypatch.setattr(jlora_ray.serve, "status", status(
        "Traceback (most recent call last):\n  File \"jlora/ray.py\", line 75, in __init__\n"
        "jlora.adapters.config.AdapterError: /a/adapter_model.safetensors: cannot read safetensors (header too large)"))
    with pytest.raises(RuntimeError, match=r"^the replicas failed to start: /a/adapter_model.safetensors: cannot "
                                           r"read safetensors \(header too large\)$"):
        jlora_ray._deploy(None)
    monkeypatch.setattr(jlora_ray.serve, "status", status(""))
    with pytest.raises(RuntimeError, match="Failed to update the deployments"):
        jlora_ray._deploy(None)


@pytest.mark.parametrize("args, message", [
    ({}, "needs model=DIR"),
    ({"replicas": "two"}, "replicas must be an integer >= 1, got 'two'"),
    ({"replicas": "0"}, "replicas must be an integer >= 1, got 0"),
    ({"lora": "a"}, "lora takes NAME=DIR"),
    ({"lora": "a=,b=x"}, "lora takes NAME=DIR"),
    ({"max_loras": "lots"}, "max_loras must be an integer, got 'lots'"),
    ({"max_lora": "8"}, "unknown engine option(s) 'max_lora'"),
    ({"lora": "a={root}/nowhere"}, "{root}/nowhere: adapter_config.json not found"),
    ({"lora_dir": 5}, "lora_dir takes comma-separated text or a list of text, got 5"),
    ({"replicas": 1.5}, "replicas must be an integer >= 1, got 1.5"),
    ({"max_loras": "8", "prefix_caching": "maybe"}, "prefix_caching must be true or false, got 'maybe'"),
])
def test_serve_run_app_refuses_bad_arguments_before_deploying(root, args, message):
    """`serve run jlora.ray:app KEY=VALUE ...`: each bad argument is named before anything is deployed."""
    from jlora.ray import app

    args = {k: v.format(root=root) if isinstance(v, str) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=re.escape(message.format(root=root))):
        app({"model": str(root / "m"), **args} if args else {})


def test_replica_options_keep_the_defaults_they_do_not_set():
    """--ray-replica-options over jlora's defaults: an actor option given (a runtime_env) leaves the replica its
    CPU and GPUs (the whole ray_actor_options replaced them: a replica on a GPU cluster got none); an
    autoscaling_config takes the place of the replica count; a key given wins."""
    from jlora.ray import _replica_options

    defaults = _replica_options(None, replicas=3, gpus=2, max_waiting=10)
    assert defaults == {"num_replicas": 3, "max_ongoing_requests": 74,
                        "ray_actor_options": {"num_cpus": 1, "num_gpus": 2}}
    env = {"env_vars": {"XLA_FLAGS": "--xla_dump_to=/tmp"}}
    given = {"ray_actor_options": {"runtime_env": env, "num_cpus": 4},
             "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}, "max_ongoing_requests": 8}
    assert _replica_options(given, replicas=3, gpus=2, max_waiting=10) == {
        "max_ongoing_requests": 8, "autoscaling_config": {"min_replicas": 1, "max_replicas": 4},
        "ray_actor_options": {"num_cpus": 4, "num_gpus": 2, "runtime_env": env}}
    assert given["ray_actor_options"] == {"runtime_env": env, "num_cpus": 4}  # the caller's dict is left as it was


def test_merged_metrics_label_each_replicas_samples():
    """Two replicas' `/metrics` texts become one exposition that Prometheus' parser reads: every family once,
    holding each replica's samples with `replica` added to their labels and their values as they were."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from jlora.ray import merged_metrics
    from jlora.server.metrics import Metrics

    texts = {}
    for replica, n in [("r1", 3), ("r2", 5)]:
        metrics = Metrics()
        metrics.requests.labels("t0", "stop").inc(n)
        metrics.step_seconds.observe(0.01 * n)
        metrics.running.set(n)
        texts[replica] = generate_latest(metrics.registry).decode()
    merged = list(text_string_to_metric_families(merged_metrics(texts).decode()))
    assert len({f.name for f in merged}) == len(merged) == len(list(text_string_to_metric_families(texts["r1"])))
    for family in merged:
        for replica, text in texts.items():
            (alone,) = [f for f in text_string_to_metric_families(text) if f.name == family.name]
            assert [(s.name, {**s.labels, "replica": replica}, s.value) for s in alone.samples] == [
                (s.name, s.labels, s.value) for s in family.samples if s.labels["replica"] == replica]
    (running,) = [f for f in merged if f.name == "jlora_requests_running"]
    assert {s.labels["replica"]: s.value for s in running.samples} == {"r1": 3, "r2": 5}
