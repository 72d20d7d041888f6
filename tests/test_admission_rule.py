"""`Admission.poll` visits the waiting requests by adapter (`_Pending`'s groups), not one by one. Over random
arrivals, polls, load completions, ends, cancels and re-registrations, it admits exactly what a plain list
visited request by request admits: the rule (first come, first served; a request whose adapter is in a slot
passes one that waits for its adapter, at most `max_passes` times once that one's load is done; one slot write a
poll; with eviction off, a request for an adapter no slot can take ends) stated as its own loop below."""

import collections
import concurrent.futures
import random
import time

import pytest

from jlora.adapters import AdapterError, PoolFullError
from jlora.adapters.registry import AdapterRegistry
from jlora.admission import Admission
from jlora.scheduler import Request

NAMES = ["a", "b", "c", "d", "e", "bad", "unwritable"]  # "bad" fails its load, "unwritable" its slot write


class FakePool:
    """The slots as `AdapterPool` keeps them (free first, else the least recently used idle one), without weights."""

    def __init__(self, num_slots: int, evict: str):
        self.num_slots, self.evict = num_slots, evict
        self._slots: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._generation: dict[str, int] = {}
        self._in_use: collections.Counter = collections.Counter()

    def generation(self, name):
        return self._generation.get(name)

    def prefix_id(self, name):
        return f"adapter-{self._generation[name]}"

    def in_use(self, name):
        return self._in_use[name] > 0

    def unload(self, name):
        del self._slots[name], self._generation[name]

    def install(self, name, prepared, generation=0):
        if name == "unwritable":
            raise RuntimeError("out of memory")
        free = sorted(set(range(self.num_slots)) - set(self._slots.values()))
        if free:
            slot = free[0]
        else:
            victim = next((v for v in self._slots if not self._in_use[v] and self.evict == "lru"), None)
            if victim is None:
                raise PoolFullError("full")
            slot = self._slots[victim]
            self.unload(victim)
        self._slots[name], self._generation[name] = slot, generation
        return slot

    @property
    def names(self):
        return list(self._slots)

    def slot(self, name):
        self._slots.move_to_end(name)
        return self._slots[name]

    def hold(self, names):
        for n in names:
            self.slot(n)
            self._in_use[n] += 1

    def release(self, names):
        for n in names:
            self._in_use[n] -= 1

    def vocab_size(self, slot):
        return 100

    def write_compiled(self, prepared):
        return True


class FakeTiers:
    """Every adapter on disk, except "c", which the device cache holds (its load done at once)."""

    def __init__(self, registry):
        self.registry = registry

    def find(self, generation):
        name = next(e.name for e in map(self.registry.get, self.registry.names) if e.generation == generation)
        return ("device", f"staged {name}") if name == "c" else ("disk", None)

    def staged(self, pool, entry, found, timed):
        if entry.name == "bad":
            raise AdapterError("corrupt")
        return f"staged {entry.name}"

    def relieve(self, err):
        return False


class HeldLoader(concurrent.futures.Executor):
    """Runs a load only when the test says so (`finish`), in the test's thread."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn):
        future = concurrent.futures.Future()
        self.jobs.append((fn, future))
        return future

    def finish(self, index: int) -> None:
        fn, future = self.jobs.pop(index)
        try:
            future.set_result(fn())
        except Exception as err:
            future.set_exception(err)


class ListAdmission(Admission):
    """The rule as a plain list, each request judged on its own in arrival order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queue = []

    def submit(self, request, adapter):
        super().submit(request, adapter)
        if self.pending.remove(request):  # else it ended at once
            self.queue.append((request, None if adapter is None else self.registry.get(adapter)))

    def cancel(self, request):
        for item in self.queue:
            if item[0] is request:
                self.queue.remove(item)
                request.end("cancelled")
                return True
        return False

    def poll(self, add, write=True):
        keep, blocked, self._may_write = [], None, write
        for request, entry in self.queue:
            if entry is not None:
                current = self.registry.get(entry.name)
                if current is None:
                    request.end("error", f"adapter {entry.name!r} was unregistered", 404)
                    continue
                entry = current
                if self.registry.failure(entry) is not None:
                    request.end("failed", self.registry.failure(entry))
                    continue
                if self._load_error(entry) is not None:  # the load it waited for failed
                    request.end("failed", self._load_error(entry))
                    continue
            passing = blocked is not None and entry is not None
            if passing and blocked is not self._blocked:
                self._blocked, self._passes = blocked, 0
            may = not passing or self._passes < self.max_passes
            if may and (entry is None or self._resident(entry) or self._install(entry)):
                self._passes += passing
                if self._take(request, entry):
                    add(request)
            elif entry is not None and self._load_error(entry) is not None:  # its slot write failed just now
                request.end("failed", self._load_error(entry))
            else:
                if blocked is None and self._loaded(entry):
                    blocked = request
                keep.append((request, entry))
        if blocked is None:
            self._blocked = None
        for request, entry in keep:
            if entry is not None and self._no_slot(entry):
                request.end("error", f"no slot for adapter {entry.name!r}: all {self.pool.num_slots} slots hold other "
                                     f"adapters and eviction is off (evict='refuse'); unload one", 503)
        keep = [(request, entry) for request, entry in keep if request.finish is None]
        self.queue = keep
        wanted = {entry.generation for _, entry in keep if entry is not None}
        for generation in [g for g, f in self._loads.items() if f.done() and g not in wanted]:
            del self._loads[generation]
            self._staged_at.pop(generation, None)
        for _, entry in keep:
            if len(self._loads) >= self.max_loads:
                break
            if entry is not None and entry.generation not in self._loads and not self._resident(entry):
                self._load(entry)


class World:
    def __init__(self, kind, root, slots, evict, max_passes, max_loads):
        self.registry = AdapterRegistry()
        for name in NAMES:
            self.registry.register(name, str(root))
        self.pool, self.loader = FakePool(slots, evict), HeldLoader()
        self.admission = kind(self.pool, self.registry, FakeTiers(self.registry), self.loader,
                              max_passes=max_passes, max_loads=max_loads)
        self.requests, self.admitted = {}, []

    def state(self):
        index = {e.generation: i for i, e in enumerate(map(self.registry.get, self.registry.names))}
        return (self.admitted, {k: (r.finish, r.error, r.status, r.slot) for k, r in self.requests.items()},
                dict(self.pool._slots), {n: index.get(g) for n, g in self.pool._generation.items()},
                +self.pool._in_use, sorted(index.get(g, -1) for g in self.admission._loads),
                len(self.loader.jobs))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("rule")
    (root / "adapter_config.json").write_text("{}")
    return root


@pytest.mark.parametrize("seed", range(40))
def test_the_grouped_poll_admits_what_the_list_admits(root, seed):
    rng = random.Random(seed)
    args = (root, rng.randint(1, 3), rng.choice(["lru", "lru", "refuse"]), rng.randint(0, 3), rng.randint(1, 3))
    worlds = [World(ListAdmission, *args), World(Admission, *args)]
    for _ in range(300):
        event = rng.random()
        if event < 0.4:
            key, adapter = len(worlds[0].requests), rng.choice([*NAMES[:5] * 3, None, None, "bad", "unwritable"])
            for w in worlds:
                w.requests[key] = Request([1, 2], -1, 2)
                w.admission.submit(w.requests[key], adapter)
        elif event < 0.65:
            write = rng.random() < 0.8
            for w in worlds:
                w.admission.poll(lambda r, w=w: w.admitted.append(next(k for k, v in w.requests.items() if v is r)),
                                 write)
        elif event < 0.78:
            running = [k for k in worlds[0].admitted if worlds[0].requests[k].finish is None]
            if running:
                key = rng.choice(running)
                for w in worlds:
                    w.requests[key].finish = "length"
                    w.requests[key]._notify()
        elif event < 0.9:
            if worlds[0].loader.jobs:
                index = rng.randrange(len(worlds[0].loader.jobs))
                for w in worlds:
                    w.loader.finish(index)
        elif event < 0.96:
            key = rng.randrange(len(worlds[0].requests) or 1)
            if key in worlds[0].requests:
                assert len({w.admission.cancel(w.requests[key]) for w in worlds}) == 1
        else:  # a name unregistered, or registered again: its waiting requests are served by the new registration
            name, again = rng.choice(NAMES[:5]), rng.random() < 0.8
            registered = name in worlds[0].registry
            for w in worlds:
                if registered:
                    w.registry.unregister(name)
                if again or not registered:
                    w.registry.register(name, str(root))
        assert worlds[0].state() == worlds[1].state()
        assert len(worlds[0].admission.queue) == len(worlds[1].admission.pending)


def test_cancels_anywhere_in_a_long_queue_take_constant_time_and_keep_the_order():
    """Requests cancelled from a queue of 40,000 (a client that sent them and left, with a large --max-waiting):
    before, each removal scanned its adapter's group, and cancelling them last first held the engine loop for
    about a minute (14 s for 20,000 of one adapter); now the whole queue goes in milliseconds. What stays keeps
    arrival order."""
    from jlora.admission import _Pending

    rng = random.Random(0)
    pending, requests = _Pending(), [Request([1], -1, 1) for _ in range(40_000)]
    adapters = [rng.choice(["a", "b", None]) for _ in requests]
    for request, adapter in zip(requests, adapters):
        pending.append(request, adapter)
    kept = set(rng.sample(range(len(requests)), 100))
    start = time.monotonic()
    for i in reversed(range(len(requests))):
        if i not in kept:
            assert pending.remove(requests[i])
    assert time.monotonic() - start < 5  # about a minute before
    assert pending.requests() == [requests[i] for i in sorted(kept)] and len(pending) == 100
    assert not pending.remove(requests[next(i for i in range(len(requests)) if i not in kept)])
    for adapter in ("a", "b"):
        want = [requests[i] for i in sorted(kept) if adapters[i] == adapter]
        assert pending.first(adapter) == min(i for i in kept if adapters[i] == adapter)
        assert [pending.popleft(adapter) for _ in want] == want and not pending.waits_for(adapter)
