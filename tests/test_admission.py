"""Many adapters over few slots: every request, whatever arrives around it, gets the tokens it gets on an engine
where every adapter is resident; a slot rewritten while a step that read it is in flight leaves that step's
tokens alone; a corrupt adapter fails only its own requests, and is not read again until adapter_retry_after
has passed."""

import collections
import concurrent.futures
import threading
import time

import jax
import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.admission import Admission
from jlora.engine import Engine
from jlora.runner import bucket
from jlora.scheduler import Batcher, Request

CFG = testing.tiny_config("llama")
N = 56  # adapters: 50 registered at start, 5 during the run, and one corrupt
TARGETS = [["q_proj", "v_proj"], list(LINEAR_MODULES), ["o_proj", "down_proj"], ["gate_proj", "up_proj"]]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("admission")
    testing.write_model(str(root / "m"), CFG, seed=1)
    for i in range(N):
        testing.write_adapter(str(root / "lib" / f"a{i:02d}"), CFG, r=2 + i % 7, alpha=4 + i % 5, seed=100 + i,
                              target_modules=TARGETS[i % 4])
    (root / "lib" / "a55" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": "8"}')  # found at load
    return root


@pytest.fixture(scope="module")
def resident(root):
    """The truth: every adapter in a slot of its own, none ever evicted."""
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=N - 1, max_lora_rank=8,
                                    max_batch=8, progress=False)
    for i in range(N - 1):
        engine.load_adapter(f"a{i:02d}", str(root / "lib" / f"a{i:02d}"))
    return engine


def _requests(rng, n: int, names: list[str]):
    """(prompt, adapter, max_new, temperature, seed) with power-law popularity over `names` and the base."""
    weights = 1 / np.arange(1, len(names) + 2)
    picks = rng.choice(len(names) + 1, n, p=weights / weights.sum())
    return [(rng.integers(0, CFG["vocab_size"], int(rng.integers(1, 12))).tolist(),
             None if k == len(names) else names[k], int(rng.choice([3, 6])), float(rng.choice([0.0, 1.0])),
             int(rng.integers(0, 2**31))) for k in picks]


def _truth(engine: Engine, specs) -> list[list[int]]:
    out = [None] * len(specs)
    for max_new, temp in {(s[2], s[3]) for s in specs}:
        idx = [i for i, s in enumerate(specs) if (s[2], s[3]) == (max_new, temp)]
        gens = engine.generate([specs[i][0] for i in idx], [specs[i][1] for i in idx], max_new_tokens=max_new,
                               temperature=temp, seed=[specs[i][4] for i in idx])
        for i, g in zip(idx, gens):
            out[i] = list(g)
    return out


@pytest.mark.parametrize("slots, host, cache, seed",
                         [(2, 2, None, 0), (3, 8, None, 1), (4, 0, None, 2), (2, 0, 1.0, 3)])
def test_requests_over_many_adapters_equal_the_all_resident_engine(root, resident, slots, host, cache, seed,
                                                                   monkeypatch):
    pytest.importorskip("prometheus_client")  # the online engine's metrics
    from jlora.server.online import OnlineEngine

    rng = np.random.default_rng(seed)
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=slots, max_cpu_loras=host,
                                    max_lora_rank=8, max_batch=4, device_cache_memory=cache, progress=False)
    reads = []
    prepare = engine.pool.prepare
    monkeypatch.setattr(engine.pool, "prepare", lambda path, *roots: (reads.append(path), prepare(path, *roots))[1])
    for entry in engine.registry.scan(str(root / "lib")).registered:  # --lora-dir: all 56, a50-a54 unregistered again
        if entry.name in {f"a{i}" for i in range(50, 55)}:
            engine.registry.unregister(entry.name)
    early = [f"a{i:02d}" for i in range(50)]
    late = [f"a{i}" for i in range(50, 55)]
    specs = _requests(rng, 60, early) + _requests(rng, 12, late)
    cancel = set(rng.choice(len(specs), 6, replace=False).tolist())
    specs += [([1, 2, 3], "a55", 3, 0.0, 0)] * 2 + [([1, 2], "nope", 3, 0.0, 0)]  # corrupt; not registered
    online = OnlineEngine(engine)
    online.start()
    done = [threading.Event() for _ in specs]
    requests = []
    try:
        for i, (prompt, adapter, max_new, temp, sd) in enumerate(specs):
            if i == 60:  # runtime registration while the first 60 run
                for name in late:
                    engine.register_adapter(name, str(root / "lib" / name))
            r = Request(prompt, -1, max_new, temp, 1.0, sd, on_update=lambda r, e=done[i]: r.finish and e.set())
            requests.append(r)
            online.submit(r, adapter)
            if i in cancel:
                online.cancel(r)
            time.sleep(float(rng.exponential(0.004)))
        assert all(e.wait(120) for e in done)
        # Whether a random arrival finds its adapter in a slot, or one evicted before, depends on the machine's
        # pace: two more requests, one at a time, for an adapter now in a slot (a device hit for certain) and for
        # one loaded and evicted before (from the device cache where there is one).
        evicted = next(n for n in early if f"{root}/lib/{n}" in reads and engine.pool.peek(n) is None)
        for again in (engine.resident_adapters[0], evicted):
            specs.append(([4, 5, 6], again, 3, 0.0, 0))
            done.append(threading.Event())
            requests.append(Request([4, 5, 6], -1, 3, 0.0, 1.0, 0,
                                    on_update=lambda r, e=done[-1]: r.finish and e.set()))
            online.submit(requests[-1], again)
            assert done[-1].wait(120)
    finally:
        online.stop()
    assert [r.out for r in requests[-2:]] == _truth(resident, specs[-2:])
    want = _truth(resident, [s for s in specs[:72]])
    for i, r in enumerate(requests[:72]):
        if r.finish == "cancelled":  # what it had generated when the cancel arrived
            assert i in cancel and r.out == want[i][: len(r.out)], i
        else:
            assert r.finish in ("length", "stop") and r.out == want[i], (i, specs[i][1])
    assert sum(requests[i].finish == "cancelled" for i in cancel) >= 3
    broken = requests[72:74]
    assert all(r.finish == "failed" and "'lora_alpha' must be a finite number" in r.error for r in broken)
    assert reads.count(str(root / "lib" / "a55")) == 1  # read once: not again within adapter_retry_after
    assert requests[74].finish == "error" and requests[74].status == 404
    assert engine.pool.evictions > 0 and len(engine.resident_adapters) <= slots
    assert not any(engine.pool.in_use(name) for name in engine.resident_adapters)  # every hold released
    stats = online.admission.stats
    assert stats.device_misses > 0 and stats.device_hits > 0 and stats.host_misses > 0
    if cache:  # it holds every adapter: each is read from its files once, however often it is evicted
        assert stats.device_cache_hits > 0 and max(collections.Counter(reads).values()) == 1


def test_loads_are_bounded_and_the_loop_writes_only_staged_copies(root, resident, monkeypatch):
    """Six requests for six cold adapters over one slot with max_loads 2: no poll leaves more than 2 loads
    outstanding, every slot write gets A and B already on the device (copied on a loader thread), and every
    request gets its adapter's tokens."""
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=1, max_cpu_loras=0, max_lora_rank=8,
                                    progress=False)
    names = [f"a{i:02d}" for i in range(6)]
    for name in names:
        engine.register_adapter(name, str(root / "lib" / name))
    staged, install = [], engine.pool.install

    def spy(name, prepared, generation=0):
        slot = install(name, prepared, generation)  # raises PoolFullError while the slot's holder runs
        parts = [x for layer in prepared.host.layers for ab in layer.values() for x in ab]
        staged.append(bool(parts) and all(isinstance(x, jax.Array) for x in parts))
        return slot

    monkeypatch.setattr(engine.pool, "install", spy)
    admission = Admission(engine.pool, engine.registry, engine.tiers, engine.loader, max_loads=2)
    batcher = Batcher(engine.runner, 4, bucket(32, 16))
    requests = [Request([3, 4, 5], -1, 3) for _ in names]
    for r, name in zip(requests, names):
        admission.submit(r, name)
    outstanding = []
    while admission.pending or batcher.busy:
        admission.poll(batcher.add)
        outstanding.append(len(admission._loads))
        if batcher.busy:
            batcher.step()
        else:
            time.sleep(0.005)
    assert max(outstanding) == 2 and staged == [True] * 6
    want = resident.generate([[3, 4, 5]] * 6, names, max_new_tokens=3)
    assert [r.out for r in requests] == [list(w) for w in want]


def test_the_engine_loop_writes_slots_while_a_step_runs(root, resident, monkeypatch):
    """A slot write costs the loop host time: while requests run, the loop writes slots only between a step's
    dispatch and the read of the step before it (`Batcher.step`'s `while_in_flight`), where the device has two
    steps to run; a poll just before a step admits without writing. Every request gets its adapter's tokens."""
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=2, max_cpu_loras=0, max_lora_rank=8,
                                    progress=False)
    names = [f"a{i:02d}" for i in range(6)]
    for name in names:
        engine.register_adapter(name, str(root / "lib" / name))
    writes, batchers, step, install = [], [], Batcher.step, engine.pool.install
    dispatched = threading.local()

    def spy_step(self, while_in_flight=None):
        batchers[:] = [self]

        def hook():
            dispatched.on = True
            try:
                while_in_flight()
            finally:
                dispatched.on = False
        step(self, hook if while_in_flight else None)

    def spy_install(name, prepared, generation=0):
        slot = install(name, prepared, generation)  # raises PoolFullError while both slots' holders run
        writes.append((getattr(dispatched, "on", False), batchers[0].busy if batchers else False))
        return slot

    monkeypatch.setattr(Batcher, "step", spy_step)
    monkeypatch.setattr(engine.pool, "install", spy_install)
    lengths = [14, 2, 3, 2, 3, 2]  # the first request holds a slot while the others take turns in the other
    requests = [Request([3, 4, 5], -1, m) for m in lengths]
    engine._run(requests, names)
    assert len(writes) == 6 and any(inside for inside, _ in writes)
    assert all(inside or not busy for inside, busy in writes), writes  # never just before a step
    for r, name, m in zip(requests, names, lengths):
        assert r.out == list(resident.generate([[3, 4, 5]], [name], max_new_tokens=m)[0]), name


def test_a_staged_adapter_is_written_when_the_last_running_request_ends_in_the_step_in_flight(root, resident):
    """One slot, three adapters: each request's adapter waits for the one before to end, and that request ends
    with the step in flight, after which `Batcher.step` dispatches nothing (so no `while_in_flight` writes):
    the next poll, the batcher idle, writes the slot. Every request gets its adapter's tokens."""
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=1, max_cpu_loras=0, max_lora_rank=8,
                                    progress=False)
    names = ["a03", "a04", "a05"]
    for name in names:
        engine.register_adapter(name, str(root / "lib" / name))
    lengths = [2, 3, 1]
    requests = [Request([3, 4, 5], -1, m) for m in lengths]
    engine._run(requests, names)
    for r, name, m in zip(requests, names, lengths):
        assert r.out == list(resident.generate([[3, 4, 5]], [name], max_new_tokens=m)[0]), name


def _wait_for_loads(admission: Admission) -> None:
    concurrent.futures.wait(list(admission._loads.values()), timeout=60)


def test_passing_is_free_while_an_adapter_loads_and_bounded_once_it_waits_for_a_slot(root, monkeypatch):
    """max_passes 0: a request for the resident adapter passes one whose adapter is still loading, but not one
    whose adapter is loaded and waits for the slot; that one gets the slot once its holder ends."""
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=1, max_lora_rank=8, progress=False)
    engine.load_adapter("hot", str(root / "lib" / "a01"))
    engine.register_adapter("cold", str(root / "lib" / "a02"))
    gate, prepare = threading.Event(), engine.pool.prepare
    monkeypatch.setattr(engine.pool, "prepare", lambda path, *roots: (gate.wait(30), prepare(path, *roots))[1])
    admission = Admission(engine.pool, engine.registry, engine.tiers, engine.loader, max_passes=0)
    admitted = []
    cold, hot, later = (Request([1, 2], -1, 2) for _ in range(3))
    admission.submit(cold, "cold")
    admission.submit(hot, "hot")
    admission.poll(admitted.append)
    assert admitted == [hot]  # passed the loading request: free
    gate.set()
    _wait_for_loads(admission)
    admission.submit(later, "hot")
    admission.poll(admitted.append)
    assert admitted == [hot]  # cold is loaded and waits for the slot `hot` holds: no more passing
    time.sleep(0.5)
    hot.finish = "length"
    hot._notify()  # releases the slot
    admission.poll(admitted.append)
    assert admitted == [hot, cold] and engine.resident_adapters == ["cold"]
    stats = admission.stats  # the load's waits: for a loader thread (one was free), then for the slot
    assert len(stats.queued) == 1 and stats.queued[0] < 0.5
    assert len(stats.slot_wait) == 1 and stats.slot_wait[0] >= 0.5


def test_one_slot_write_per_poll(root):
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=2, max_lora_rank=8, progress=False)
    for name in ("a03", "a04"):
        engine.register_adapter(name, str(root / "lib" / name))
    admission = Admission(engine.pool, engine.registry, engine.tiers, engine.loader)
    admitted, requests = [], [Request([1, 2], -1, 2) for _ in range(2)]
    admission.submit(requests[0], "a03")
    admission.submit(requests[1], "a04")
    admission.poll(admitted.append)  # starts both loads
    _wait_for_loads(admission)
    admission.poll(admitted.append)
    assert admitted == requests[:1]
    admission.poll(admitted.append)
    assert admitted == requests


def test_a_slot_rewritten_while_a_step_that_read_it_is_in_flight(root, resident):
    """Adapter A's request decodes; with its step in flight (dispatched, not read), A leaves its slot and B is
    written there. The tokens of that step are A's; the later ones are B's (the request keeps the slot)."""
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=1, max_lora_rank=8,
                                    progress=False)
    engine.load_adapter("A", str(root / "lib" / "a01"))
    b = engine.pool.stage(engine.pool.prepare(str(root / "lib" / "a02")))  # on the device, as a load leaves it
    prompt = [5, 6, 7]
    request = Request(prompt, engine.pool.slot("A"), 6)
    batcher = Batcher(engine.runner, 1, bucket(16, 16))
    batcher.add(request)
    for _ in range(3):  # the prompt, then two decode steps: the third is in flight
        batcher.step()
    assert batcher.in_flight is not None and len(request.out) == 2
    engine.pool.unload("A")
    engine.pool.install("B", b)
    while batcher.busy:
        batcher.step()
    with_a = resident.generate([prompt], ["a01"], max_new_tokens=3)[0]
    assert request.out[:3] == list(with_a)
    # From the fourth token on the request reads B's weights over A's cache: what a mixed engine computes.
    mixed = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=1, max_lora_rank=8, progress=False)
    mixed.load_adapter("A", str(root / "lib" / "a01"))
    again = Request(prompt, 0, 6)
    batcher = Batcher(mixed.runner, 1, bucket(16, 16))
    batcher.add(again)
    for _ in range(3):
        batcher.step()
    batcher._collect()  # the in-flight step read A, before the rewrite
    mixed.pool.unload("A")
    mixed.pool.install("B", mixed.pool.prepare(str(root / "lib" / "a02")))
    while batcher.busy:
        batcher.step()
    assert request.out == again.out


def test_an_adapter_of_new_modules_written_while_a_step_is_in_flight(root, resident):
    """A q_proj + v_proj adapter's request decodes; with its step in flight, an adapter of every linear module is
    written into the other slot, so the pool first adds the modules no adapter had targeted. The running request's
    tokens are those of its adapter alone, and the new adapter's are too."""
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=2, max_lora_rank=8,
                                    progress=False)
    engine.load_adapter("a00", str(root / "lib" / "a00"))
    assert sorted(engine.pool.weights.layers[0].a) == ["qkv"]
    new = engine.pool.stage(engine.pool.prepare(str(root / "lib" / "a01")))
    first = Request([5, 6, 7], engine.pool.slot("a00"), 6)
    batcher = Batcher(engine.runner, 2, bucket(16, 16))
    batcher.add(first)
    for _ in range(3):  # the prompt, then two decode steps: the third is in flight
        batcher.step()
    assert batcher.in_flight is not None and len(first.out) == 2
    second = Request([1, 2], engine.pool.install("a01", new), 4)
    assert sorted(engine.pool.weights.layers[0].a) == ["down", "gate_up", "o", "qkv"]
    batcher.add(second)
    while batcher.busy:
        batcher.step()
    want = _truth(resident, [([5, 6, 7], "a00", 6, 0.0, 0), ([1, 2], "a01", 4, 0.0, 0)])
    assert [first.out, second.out] == want


def test_a_reload_under_the_same_name_and_a_request_cancelled_mid_load(root, resident, monkeypatch):
    """An adapter unloaded and registered again under its name serves the new weights; a request cancelled
    while its adapter loads leaves no load behind; and when the adapter is unloaded and its name registered again
    while that load still reads the files, the load ends keeping no copy in any tier, and the name serves its
    new files."""
    pytest.importorskip("prometheus_client")
    from jlora.server.online import OnlineEngine

    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=1, max_cpu_loras=0, max_lora_rank=8,
                                    device_cache_memory=1.0, progress=False)
    engine.load_adapter("x", str(root / "lib" / "a03"))
    assert list(engine.generate([[4, 5]], ["x"], max_new_tokens=4)[0]) == list(resident.generate([[4, 5]], ["a03"], 4)[0])
    engine.unload_adapter("x")
    engine.register_adapter("x", str(root / "lib" / "a04"))
    assert list(engine.generate([[4, 5]], ["x"], max_new_tokens=4)[0]) == list(resident.generate([[4, 5]], ["a04"], 4)[0])

    gate, prepare = threading.Event(), engine.pool.prepare
    monkeypatch.setattr(engine.pool, "prepare", lambda path, *roots: (gate.wait(30), prepare(path, *roots))[1])
    engine.register_adapter("slow", str(root / "lib" / "a05"))
    online = OnlineEngine(engine)
    online.start()
    try:
        done = threading.Event()
        request = Request([1, 2], -1, 3, on_update=lambda r: r.finish and done.set())
        online.submit(request, "slow")
        time.sleep(0.2)
        online.cancel(request)
        assert done.wait(10) and request.finish == "cancelled"
        loads = list(online.admission._loads.values())
        assert len(loads) == 1  # started though cancelled: the files are being read
        old = engine.registry.get("slow")
        online.unload_adapter("slow").result(10)
        engine.register_adapter("slow", str(root / "lib" / "a06"))
        gate.set()
        concurrent.futures.wait(loads, timeout=30)
        online.call(lambda: None).result(10)  # a loop turn (its poll follows) after the load ended
        online.call(lambda: None).result(10)
        assert not online.admission._loads and "slow" not in engine.resident_adapters
        assert engine.tiers.find(old.generation) == ("disk", None)  # the old load kept nothing
        done.clear()
        again = Request([1, 2], -1, 3, on_update=lambda r: r.finish and done.set())
        online.submit(again, "slow")
        assert done.wait(30) and again.out == list(resident.generate([[1, 2]], ["a06"], 3)[0])
    finally:
        online.stop()


def test_an_adapter_that_cannot_be_written_into_a_slot_fails_its_own_requests_until_its_retry(root, monkeypatch):
    """A slot write that raises (as when the device runs out of memory for a part no adapter targeted before)
    fails that adapter's requests with the reason, evicts nothing, is not tried again for adapter_retry_after
    seconds, and the others run; after them, the next request writes it."""
    from jlora.adapters.pool import AdapterPool

    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=2, max_lora_rank=8, progress=False,
                                    adapter_retry_after=1.0)
    for name in ("a00", "a01"):  # q_proj + v_proj; every linear module
        engine.register_adapter(name, str(root / "lib" / name))
    allocate = AdapterPool._allocate

    def out_of_memory(pool, features, targets):
        if "o" in targets:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 369 MB")
        return allocate(pool, features, targets)

    monkeypatch.setattr(AdapterPool, "_allocate", out_of_memory)
    admission = Admission(engine.pool, engine.registry, engine.tiers, engine.loader)
    admitted, ok, bad = [], Request([1, 2], -1, 2), Request([1, 2], -1, 2)
    admission.submit(ok, "a00")
    admission.poll(admitted.append)
    _wait_for_loads(admission)
    admission.poll(admitted.append)
    assert admitted == [ok] and engine.resident_adapters == ["a00"]
    admission.submit(bad, "a01")
    for _ in range(3):
        admission.poll(admitted.append)
        _wait_for_loads(admission)
    assert admitted == [ok] and bad.finish == "failed"
    assert "'a01' cannot be written into a slot" in bad.error and "RESOURCE_EXHAUSTED" in bad.error
    assert engine.resident_adapters == ["a00"] and sorted(engine.pool.weights.layers[0].a) == ["qkv"]
    assert "fail at once for 1 s" in bad.error and admission.stats.load_failures == ["a01"]
    again = Request([1, 2], -1, 2)
    admission.submit(again, "a01")
    admission.poll(admitted.append)
    assert again.finish == "failed" and again.error == bad.error and not admission._loads  # not loaded again
    monkeypatch.setattr(AdapterPool, "_allocate", allocate)  # the device's memory back
    time.sleep(1.0)
    later = Request([1, 2], -1, 2)
    admission.submit(later, "a01")
    for _ in range(3):
        admission.poll(admitted.append)
        _wait_for_loads(admission)
    assert admitted == [ok, later] and later.finish is None and sorted(engine.resident_adapters) == ["a00", "a01"]


def test_a_failed_load_ends_the_requests_that_waited_and_is_read_again_after_its_retry(root, monkeypatch):
    """A load that fails ends every request that waited for it, even once the registry has forgotten the failure
    (a retry_after shorter than the load: no request loads it forever). Requests after it fail at once, without
    a read, for retry_after; the first after reads the files again, and an adapter fixed in place meanwhile serves
    the tokens of an engine that loaded it whole."""
    import shutil

    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=2, max_lora_rank=8, progress=False,
                                    adapter_readers=0, adapter_retry_after=0.5)
    broken = root / "broken"
    shutil.copytree(root / "lib" / "a03", broken)
    good = (broken / "adapter_config.json").read_text()
    (broken / "adapter_config.json").write_text('{"r": 4, "lora_alpha": "8"}')
    reads = []
    prepare = engine.pool.prepare
    monkeypatch.setattr(engine.pool, "prepare", lambda path, *roots: (reads.append(path), prepare(path, *roots))[1])
    engine.register_adapter("b", str(broken))
    admission = Admission(engine.pool, engine.registry, engine.tiers, engine.loader)
    admitted, first = [], [Request([1, 2], -1, 2) for _ in range(3)]
    for r in first:
        admission.submit(r, "b")
    admission.poll(admitted.append)
    _wait_for_loads(admission)
    time.sleep(0.5)  # the registry forgets the failure before the poll that sees the load's end
    assert engine.registry.failure(engine.registry.get("b")) is None
    admission.poll(admitted.append)
    assert not admitted and all(r.finish == "failed" and "lora_alpha" in r.error for r in first)
    assert "<b>" in first[0].error and str(broken) not in first[0].error and not admission._loads and len(reads) == 1

    admission.submit(r := Request([1, 2], -1, 2), "b")  # a fresh failure: at once, with no read
    admission.poll(admitted.append)
    _wait_for_loads(admission)
    admission.poll(admitted.append)
    assert r.finish == "failed" and len(reads) == 2
    again = Request([1, 2], -1, 2)
    admission.submit(again, "b")
    assert again.finish == "failed" and again.error == r.error and len(reads) == 2
    (broken / "adapter_config.json").write_text(good)  # fixed in place
    time.sleep(0.5)
    fixed = Request([3, 1, 4], -1, 4)
    admission.submit(fixed, "b")
    for _ in range(3):
        admission.poll(admitted.append)
        _wait_for_loads(admission)
    assert admitted == [fixed] and len(reads) == 3 and engine.resident_adapters == ["b"]
    want = Engine.from_pretrained(str(root / "m"), dtype="float32", max_lora_rank=8, progress=False)
    want.load_adapter("b", str(root / "lib" / "a03"))
    assert engine.generate([[3, 1, 4]], ["b"], 4) == want.generate([[3, 1, 4]], ["b"], 4)


def test_generate_and_score_raise_a_refusal_and_keep_their_progress(root):
    """`Engine.generate` and `score` over a long queue raise the error of a request that intake failed (a corrupt
    adapter, registered: found at load) as `AdapterError`, and the engine serves after it; `score`'s progress
    still counts each request it ends."""
    from jlora.adapters import AdapterError

    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=2, max_lora_rank=8, max_batch=4,
                                    progress=False)
    for name in ("a00", "a55"):
        engine.register_adapter(name, str(root / "lib" / name))
    prompts, adapters = [[1, 2, 3]] * 40, ["a00", None] * 19 + ["a55", "a00"]
    with pytest.raises(AdapterError, match="lora_alpha"):
        engine.generate(prompts, adapters, max_new_tokens=2, n=2)
    with pytest.raises(AdapterError, match="lora_alpha"):
        engine.score(prompts, [[4]] * 40, adapters)
    done = []
    engine.score(prompts[:6], [[4]] * 6, adapters[:6], progress=done.append)
    assert done == [1] * 6 and engine.generate(prompts[:2], adapters[:2], max_new_tokens=2)[0]
