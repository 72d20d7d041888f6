"""The online engine in process: requests over time equal the engine's own generation, and a failing step
ends its requests with an error instead of hanging them, and the loop serves on."""

import threading

import jax
import pytest

pytest.importorskip("prometheus_client")  # the server's packages (absent on the GPU machine)
pytest.importorskip("starlette")

from jlora import testing  # noqa: E402
from jlora.engine import Engine  # noqa: E402
from jlora.scheduler import Request  # noqa: E402
from jlora.server.online import EngineStopped, OnlineEngine, QueueFull  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    cfg = testing.tiny_config("llama")
    testing.write_model(str(root / "m"), cfg, seed=3)
    testing.write_adapter(str(root / "a"), cfg, r=4, alpha=8, seed=4)
    eng = Engine.from_pretrained(str(root / "m"), dtype="float32", max_batch=2, max_seq_len=32, progress=False)
    eng.load_adapter("a", str(root / "a"))
    eng.root_a, eng.root_m = str(root / "a"), str(root / "m")
    return eng


def run(online: OnlineEngine, prompt, adapter, max_new: int) -> Request:
    done = threading.Event()
    request = Request(prompt, -1, max_new, on_update=lambda r: r.finish is not None and done.set())
    online.submit(request, adapter)
    assert done.wait(60)
    return request


def test_the_gauges_hold_the_cache_and_the_slots_before_the_first_request(engine):
    """A scrape between the server's start and its first request (a dashboard after a restart) reads the KV cache's
    blocks and the adapters loaded at start, not zeros."""
    online = OnlineEngine(engine)
    gauge = online.metrics.registry.get_sample_value
    assert gauge("jlora_kv_cache_blocks") == online.batcher.blocks.num_blocks > 0
    assert gauge("jlora_kv_cache_blocks_used") == 0
    assert gauge("jlora_adapters_resident") == len(engine.pool.names) == 1  # "a", loaded by the fixture
    assert gauge("jlora_adapter_slots_bytes") == engine.pool.nbytes > 0
    online.stop()  # a server whose start failed before its loop started stops it as one that served
    assert online.down == "the engine loop is not running"


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(engine, monkeypatch):
    online = OnlineEngine(engine)
    online.start()
    try:
        want = [list(g) for g in engine.generate([[1, 2, 3], [4, 5]], ["a", None], max_new_tokens=5)]
        assert [run(online, [1, 2, 3], "a", 5).out, run(online, [4, 5], None, 5).out] == want
        step = engine.runner.step
        monkeypatch.setattr(engine.runner, "step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost")))
        failed = run(online, [1, 2, 3], "a", 5)
        assert failed.finish == "failed" and "device lost" in failed.error
        monkeypatch.setattr(engine.runner, "step", step)
        assert run(online, [1, 2, 3], "a", 5).out == want[0]
        assert run(online, [1], "gone", 5).finish == "error"  # an adapter not loaded: refused at intake
        online.call(lambda: engine.unload_adapter("a")).result(timeout=10)  # no hold leaked by the failed request
    finally:
        online.stop()


def test_a_step_out_of_device_memory_empties_the_device_cache_and_the_loop_goes_on(engine, tmp_path, monkeypatch):
    """A step that runs the device out of memory while the device cache holds adapters fails its batch; the cache
    lets go of them, so the steps after (the same shapes, needing the same memory) have it back, and they give
    the tokens they would have."""
    cached = Engine.from_pretrained(engine.root_m, dtype="float32", max_batch=2, max_seq_len=32, max_loras=1,
                                    device_cache_memory=1.0, progress=False)
    testing.write_adapter(str(tmp_path / "b"), testing.tiny_config("llama"), r=2, alpha=4, seed=6)
    for name, path in [("a", engine.root_a), ("b", str(tmp_path / "b"))]:
        cached.register_adapter(name, path)
    want = [list(cached.generate([[1, 2, 3]], [n], max_new_tokens=5)[0]) for n in ["a", "b"]]
    assert len(cached.tiers.device) == 2
    online = OnlineEngine(cached)
    online.start()
    try:
        step = cached.runner.step
        oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")
        monkeypatch.setattr(cached.runner, "step", lambda *a, **k: (_ for _ in ()).throw(oom))
        released, new_batcher = [], cached.new_batcher  # the old cache is let go before the fresh one is made
        monkeypatch.setattr(cached, "new_batcher", lambda *a: (released.append(online.batcher.cache is None),
                                                               new_batcher(*a))[1])
        failed = run(online, [1, 2, 3], "a", 5)
        assert failed.finish == "failed" and "RESOURCE_EXHAUSTED" in failed.error and released == [True]
        assert len(cached.tiers.device) == 0 and cached.tiers.device.nbytes == 0
        monkeypatch.setattr(cached.runner, "step", step)
        assert [run(online, [1, 2, 3], n, 5).out for n in ["a", "b"]] == want
    finally:
        online.stop()


def test_an_adapter_read_again_from_rewritten_files_reuses_no_prefix_of_the_old_weights(engine, tmp_path):
    """An operator rewrites a served adapter's files in place. Once the adapter has left its slot and the host tier
    its files are read again: other weights under the same registration. A prompt prefix cached from the old
    weights is not reused with the new (before: the request's first tokens took their keys and values from the
    old weights and it generated neither adapter's tokens); one cached from the new weights is."""
    cfg = testing.tiny_config("llama")
    one_slot = Engine.from_pretrained(engine.root_m, dtype="float32", max_batch=2, max_seq_len=64, max_loras=1,
                                      max_cpu_loras=1, block_size=16, progress=False)
    path = str(tmp_path / "x")
    testing.write_adapter(path, cfg, r=4, alpha=64, seed=7)
    one_slot.register_adapter("x", path)
    one_slot.register_adapter("a", engine.root_a)
    prompt = list(range(1, 40))  # two full blocks cached
    online = OnlineEngine(one_slot)
    online.start()
    try:
        old = run(online, prompt, "x", 6).out
        testing.write_adapter(path, cfg, r=4, alpha=64, seed=8)
        run(online, [5, 6], "a", 2)  # "x" leaves the one slot and the one place of the host tier
        stats = online.batcher.blocks.stats
        hits = stats.hit_tokens
        new = run(online, prompt, "x", 6).out
        assert stats.hit_tokens == hits  # nothing of the old weights' prefix taken
        again = run(online, prompt, "x", 6).out
        assert stats.hit_tokens == hits + 32  # the new weights' prefix taken
    finally:
        online.stop()
    want = list(one_slot.generate([prompt], ["x"], max_new_tokens=6)[0])  # alone, on a fresh cache
    assert new == again == want != old


def test_a_request_the_batcher_refuses_ends_alone_and_the_loop_goes_on(engine):
    """Before: a request that `Batcher.add` refused (max_new 0 without scoring, a prompt longer than the rows)
    raised on the loop thread and stopped it, hanging every request after it."""
    if "a" not in engine.adapters:  # unloaded by the test before
        engine.load_adapter("a", engine.root_a)
    online = OnlineEngine(engine)
    online.start()
    try:
        for prompt, adapter, max_new in [([1, 2], "a", 0), ([1] * 40, None, 4)]:
            refused = run(online, prompt, adapter, max_new)
            assert refused.finish == "error" and refused.status == 400 and refused.error
        assert run(online, [1, 2, 3], "a", 5).out == list(engine.generate([[1, 2, 3]], ["a"], max_new_tokens=5)[0])
        online.call(lambda: engine.unload_adapter("a")).result(timeout=10)  # the refused request gave "a" back
    finally:
        online.stop()


def _raises_once(monkeypatch, owner, name: str, armed: threading.Event) -> None:
    """Makes `owner.name` raise once, on its first call after `armed` is set."""
    method = getattr(owner, name)

    def once(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError(f"a bug in {name}")
        return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, once)


@pytest.mark.parametrize("where", ["intake", "admission", "cancel"])
def test_a_failure_outside_the_step_fails_its_requests_and_the_loop_goes_on(engine, monkeypatch, where):
    """Before: only the step was guarded; an exception in admission or a cancel ended the loop thread, and every
    request after it hung."""
    online = OnlineEngine(engine)
    online.start()
    armed = threading.Event()
    try:
        want = list(engine.generate([[4, 5]], [None], max_new_tokens=5)[0])
        if where == "intake":  # only the request taken in fails: nothing else was touched
            _raises_once(monkeypatch, online.admission, "submit", armed)
            armed.set()
            failed = run(online, [4, 5], None, 5)
            assert failed.finish == "failed" and "taking the request in failed" in failed.error
        elif where == "admission":
            _raises_once(monkeypatch, online.admission, "poll", armed)
            armed.set()
            failed = run(online, [4, 5], None, 5)
            assert failed.finish == "failed" and "the engine loop failed" in failed.error
        else:  # a cancel that raises while the request runs: the batcher's state is unknown, so it starts over
            _raises_once(monkeypatch, online.batcher, "cancel", armed)
            started, queued, done = threading.Event(), threading.Event(), threading.Event()

            def on_update(r: Request) -> None:  # holds the loop at the first token until the cancel is queued
                started.set()
                queued.wait(60)
                if r.finish is not None:
                    done.set()

            running = Request([4, 5], -1, 20, on_update=on_update)
            online.submit(running, None)
            assert started.wait(60)
            armed.set()
            online.cancel(running)
            queued.set()
            assert done.wait(60)
            assert running.finish == "failed" and "the engine loop failed" in running.error
        assert not armed.is_set()  # the failure did happen
        assert online._thread.is_alive() and run(online, [4, 5], None, 5).out == want
    finally:
        online.stop()


def test_end_all_ends_every_request_at_the_next_turn_and_takes_no_more(engine):
    """`end_all` (a server's second Ctrl-C), asked while two requests run and one waits for a row: each ends with
    finish "failed", the message and HTTP 503, at the loop's next turn; no step runs after, so none gets a token
    past its end; later submits and calls raise EngineStopped, a second `end_all` is a no-op, and `stop` returns."""
    online = OnlineEngine(engine)
    updates = {}  # each request's updates: (finish, tokens) as on_update saw them

    def on_update(r: Request) -> None:  # on the loop thread: the first tokens ask for the end
        if r is requests[0] and not updates.get(r):
            online.end_all("the server is shutting down")
        updates.setdefault(r, []).append((r.finish, len(r.out)))

    requests = [Request([1, 2, 3], -1, 25, on_update=on_update) for _ in range(3)]  # 2 rows: one waits
    online.start()
    try:
        online.submit(requests, None)  # the base model: the module's first test unloads "a"
        online._thread.join(timeout=60)  # the loop ends once it took the call
        assert not online._thread.is_alive() and online.down == "the server is shutting down"
        # the step dispatched before the call ran to its end: a server exiting next has nothing on the device
        assert online.batcher.in_flight is None and all(a.is_ready() for a in jax.tree.leaves(online.batcher.cache))
        assert [(r.finish, r.error, r.status) for r in requests] == [("failed", "the server is shutting down", 503)] * 3
        for r in requests:  # its tokens, then its end with no token more, and nothing after it
            *running, (finish, tokens) = updates[r]
            assert finish == "failed" and tokens == len(r.out) and all(f is None for f, _ in running), updates[r]
            assert tokens == (running[-1][1] if running else 0) < 25
        assert len(requests[0].out) > 0 and len(requests[1].out) > 0 and not requests[2].out  # two ran, one waited
        with pytest.raises(EngineStopped, match="shutting down"):
            online.submit(Request([1], -1, 2), None)
        with pytest.raises(EngineStopped):
            online.call(lambda: None)
        online.end_all("again")  # no-op
        assert online.down == "the server is shutting down"
    finally:
        online.stop()


def test_a_batch_that_would_pass_max_waiting_is_refused_whole(engine):
    """`submit` of several requests (a list of prompts, n > 1) takes all or none: a batch of two with room for one
    more is refused and queues nothing; one that fits is taken whole."""
    online = OnlineEngine(engine, max_waiting=3)  # not started: what is submitted stays queued
    online.submit([Request([1, 2], -1, 1), Request([3], -1, 1)], None)
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        online.submit([Request([4], -1, 1), Request([5], -1, 1)], None)
    assert online.num_waiting == 2
    online.submit([Request([6], -1, 1)], None)
    assert online.num_waiting == 3
