"""`Admission`: between an engine's requests and its `Batcher`, requests wait until their adapter sits in a device
slot, and adapters move disk -> host -> device without pausing the rows that decode.

- **Loads off the loop.** A request for a registered adapter that is not in a slot needs a load. From the
  device cache (`AdapterTiers`) it is done at once: the adapter is on the device already. Else it runs on the
  loader (worker threads): disk -> host when the host tier lacks the adapter (the files read, checked and
  converted, `AdapterPool.prepare`, into the host tier), then host -> device (`AdapterPool.stage`: the copy to
  the device, kept by the device cache within its budget). Requests for the same adapter share one load. At
  most `max_loads` loads are under way or staged on the device and not yet installed, started in the waiting
  requests' order: a staged copy holds device memory until a slot takes it. A load that fails fails the
  requests that waited for it ("failed", the loader's message), and the registry remembers the failure for its
  `retry_after` seconds: later requests for the adapter fail at once meanwhile, and the first one after loads it
  again. So does a slot write that fails (the device's memory for a part no adapter targeted before), which
  evicts nothing. With eviction off (`evict="refuse"`) and every slot holding another adapter, no slot frees
  until an adapter is unloaded: the requests waiting for one end at once (status 503), and later ones try again.
- **Slot writes while a step runs.** `poll` writes a staged adapter into a free slot or the slot of the least
  recently used idle adapter (`AdapterPool.install`: one jitted write of device memory), one per poll: a
  write costs the loop a few milliseconds of host time, and a burst of finished loads must not stall one step
  by all of them. The engine loops poll with writes while a step runs (`Batcher.step`'s `while_in_flight`),
  where that host time overlaps the device's, and without them just before a step. An adapter is idle when
  no admitted request holds it, so a slot is only rewritten once every request that used it has ended; a step
  still in flight that read the slot's old weights holds its own reference to them (the write donates the
  stack and XLA orders it after the step's reads).
- **Admission order.** Requests are taken first come, first served, except that a request whose adapter is
  in a slot passes one that waits for its adapter. While that adapter's load runs, passing costs it nothing
  (loads start in arrival order, whatever passes); once the load is done and the request waits only for a
  slot, it is passed at most `max_passes` times: past that, requests for adapters wait behind it, the slots'
  holders drain, and its adapter gets a slot. So no request starves, and neither a burst for a resident
  adapter nor the rows that decode wait for a cold adapter's files. The base model's requests hold no slot
  and always pass. `poll` visits the waiting requests by adapter, as requests for one adapter are admitted or kept
  alike: its host work follows the adapters waited for, not the queue's length.

A request is admitted by holding its adapter (`AdapterPool.hold`, released when it ends), taking its slot and
entering the batcher. `poll` runs on the thread that owns the pool and the batcher; `wake` is called from a
loader thread when a load finishes, so an idle loop can poll again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import ClassVar

from jlora.adapters import AdapterError, AdapterPool, PoolFullError, PreparedAdapter
from jlora.adapters.registry import AdapterRegistry, Registration
from jlora.adapters.tiers import AdapterTiers
from jlora.scheduler import Request

__all__ = ["Admission", "AdapterStats"]

logger = logging.getLogger("jlora.admission")


@dataclasses.dataclass
class AdapterStats:
    """What `Admission` counts, for metrics: per tier, requests that found their adapter there or not (device: the
    slots, on arrival; then per load, the device cache, and the host tier when the device cache had not), the loads
    that failed (reading the adapter, or writing it into a slot), and load latencies (seconds) not yet taken by a
    reader: queued (a started load waiting for a loader thread), disk to host and host to device on loader
    threads, slot_wait (a staged copy waiting to be written: for a slot that no running request holds, or for the
    next poll) and the slot write's host time on the engine loop (between two steps)."""

    device_hits: int = 0
    device_misses: int = 0
    device_cache_hits: int = 0
    device_cache_misses: int = 0
    host_hits: int = 0
    host_misses: int = 0
    load_failures: list[str] = dataclasses.field(default_factory=list)  # the adapters' names, not yet counted
    disk_to_host: list[float] = dataclasses.field(default_factory=list)
    host_to_device: list[float] = dataclasses.field(default_factory=list)
    slot_write: list[float] = dataclasses.field(default_factory=list)
    queued: list[float] = dataclasses.field(default_factory=list)
    slot_wait: list[float] = dataclasses.field(default_factory=list)

    # the load-latency lists above, in a load's order (jlora_adapter_load_seconds' stages)
    STAGES: ClassVar[tuple[str, ...]] = ("queued", "disk_to_host", "host_to_device", "slot_wait", "slot_write")


class _Pending:
    """The requests waiting in `Admission`, grouped by adapter name (None: the base model), each group in arrival
    order (arrival number -> request; an ordered dict, so that a request cancelled anywhere in a long queue is
    taken out at once). Requests for one adapter are admitted or kept alike, so a poll visits each group once, not
    each request: its host work follows the adapters waited for, not the queue's length."""

    def __init__(self):
        self._groups: dict[str | None, collections.OrderedDict[int, Request]] = {}
        self._where: dict[Request, tuple[str | None, int]] = {}  # request -> (its adapter, its arrival number)
        self._arrivals = itertools.count()

    def append(self, request: Request, adapter: str | None) -> None:
        arrival = next(self._arrivals)
        self._groups.setdefault(adapter, collections.OrderedDict())[arrival] = request
        self._where[request] = adapter, arrival

    def remove(self, request: Request) -> bool:
        """Takes out `request`; False when it is not here."""
        if request not in self._where:
            return False
        adapter, arrival = self._where.pop(request)
        group = self._groups[adapter]
        del group[arrival]
        if not group:
            del self._groups[adapter]
        return True

    def popleft(self, adapter: str | None) -> Request:
        """Takes out the first request waiting for `adapter`."""
        group = self._groups[adapter]
        _, request = group.popitem(last=False)
        del self._where[request]
        if not group:
            del self._groups[adapter]
        return request

    def drop(self, adapter: str | None) -> list[Request]:
        """Takes out every request waiting for `adapter`, in arrival order."""
        requests = list(self._groups.pop(adapter).values())
        for r in requests:
            del self._where[r]
        return requests

    def in_order(self) -> list[tuple[str | None, collections.OrderedDict[int, Request]]]:
        """The groups (arrival number -> request), by their first request's arrival."""
        return sorted(self._groups.items(), key=lambda item: next(iter(item[1])))

    def first(self, adapter: str | None) -> int:
        """The arrival number of the first request waiting for `adapter`."""
        return next(iter(self._groups[adapter]))

    def waits_for(self, adapter: str) -> bool:
        return adapter in self._groups

    def adapters(self) -> list[str]:
        """The adapters waited for, by name."""
        return sorted(a for a in self._groups if a is not None)

    def requests(self) -> list[Request]:
        """Every request here, in arrival order."""
        return [r for _, r in sorted(item for group in self._groups.values() for item in group.items())]

    def clear(self) -> None:
        self._groups.clear()
        self._where.clear()

    def __len__(self) -> int:
        return len(self._where)


class Admission:
    """Admits requests into a batcher (`add`) once their adapters are in device slots; see the module docstring.

    Args:
      pool: the device slots.
      registry: the adapters that may be requested.
      tiers: the host tier and the device cache.
      loader: runs disk -> host loads (worker threads).
      wake: called (from a loader thread) when a load finishes.
      max_passes: how many requests may be admitted past one whose adapter is loaded and waits for a slot.
      max_loads: how many loads may be under way or staged at once.
    """

    def __init__(self, pool: AdapterPool, registry: AdapterRegistry, tiers: AdapterTiers,
                 loader: concurrent.futures.Executor, wake: Callable[[], None] = lambda: None, max_passes: int = 32,
                 max_loads: int = 8):
        if max_passes < 0 or max_loads < 1:
            raise ValueError(f"max_passes must be >= 0 and max_loads >= 1, got {max_passes} and {max_loads}")
        self.pool, self.registry, self.tiers, self.loader, self.wake = pool, registry, tiers, loader, wake
        self.max_passes, self.max_loads = max_passes, max_loads
        self.stats = AdapterStats()
        self.pending = _Pending()
        self._loads: dict[int, concurrent.futures.Future] = {}  # generation -> its load (the staged adapter)
        self._staged_at: dict[int, float] = {}  # generation -> when its load ended (time.monotonic())
        self._blocked: Request | None = None  # the first request here whose adapter is loaded and waits for a slot
        self._passes = 0  # requests admitted past it
        self._may_write = True  # whether the current poll may still write a slot

    def submit(self, request: Request, adapter: str | None) -> None:
        """Queues `request` for `adapter` (None: the base model). An adapter not registered ends it at once with
        finish "error" and `status` 404; one whose load failed, with "failed"."""
        if adapter is None:
            return self.pending.append(request, None)
        entry = self.registry.get(adapter)
        if entry is None:
            return request.end("error", f"adapter {adapter!r} is not registered", 404)
        failure = self.registry.failure(entry)
        if failure is not None:
            return request.end("failed", failure)
        if self._resident(entry):
            self.stats.device_hits += 1
        else:
            self.stats.device_misses += 1
        self.pending.append(request, adapter)

    def cancel(self, request: Request) -> bool:
        """Ends a request still waiting here ("cancelled"); False when it is not here."""
        if not self.pending.remove(request):
            return False
        request.end("cancelled")
        return True

    @property
    def waiting_for_loads(self) -> bool:
        """Whether some request waits for a disk -> host load still running."""
        return any(not f.done() for f in self._loads.values())

    def poll(self, add: Callable[[Request], None], write: bool = True) -> None:
        """Installs a finished load into a slot (if `write`), admits every request it may, in order, into `add`,
        and starts the loads that the requests left waiting need.

        The groups of `pending` are visited by their first request's arrival. A group whose adapter is in a slot
        (or written into one here) may be admitted; its requests are taken in arrival order, merged with the other
        such groups' (`ready`), up to the next group's first request: so every request is judged where it arrived,
        and once a request waits for a slot for a loaded adapter (`blocked`), each one taken after it passes it."""
        self._may_write = write
        taken: list[tuple[int, Request]] = []  # admitted: into `add` in arrival order at the end
        ready: list[tuple[int, str, Registration]] = []  # heap: each admissible group's first request's arrival
        blocked: Request | None = None  # the first request here whose adapter is loaded and waits for a slot
        waiting: list[Registration] = []  # the groups' current registrations, in order
        for adapter, group in self.pending.in_order():
            if adapter is None:  # the base model's requests hold no slot and always pass
                taken += [(arrival, request) for arrival, request in group.items() if self._take(request, None)]
                self.pending.drop(None)
                continue
            entry = self._current(adapter)
            if entry is None or self._failed(entry):
                continue
            waiting.append(entry)
            arrival, first = next(iter(group.items()))
            self._take_ready(ready, arrival, blocked is not None, taken)
            if ((blocked is None or self._passes < self.max_passes)
                    and (self._resident(entry) or self._install(entry))):
                heapq.heappush(ready, (arrival, adapter, entry))
            elif self._failed(entry):  # its slot write failed just now
                continue
            elif blocked is None and self._loaded(entry):
                blocked = first
                if blocked is not self._blocked:
                    self._blocked, self._passes = blocked, 0
        self._take_ready(ready, math.inf, blocked is not None, taken)
        if blocked is None:
            self._blocked = None
        for _, request in sorted(taken, key=lambda item: item[0]):
            try:
                add(request)
            except ValueError as err:  # the batcher refuses it: it ends alone (and gives back its adapter)
                request.end("error", str(err), 400)
        for entry in waiting:
            if self.pending.waits_for(entry.name) and self._no_slot(entry):
                self._end(entry.name, "error", f"no slot for adapter {entry.name!r}: all {self.pool.num_slots} slots "
                                               f"hold other adapters and eviction is off (evict='refuse'); unload one",
                          503)
        waiting = [entry for entry in waiting if self.pending.waits_for(entry.name)]
        wanted = {entry.generation for entry in waiting}
        for generation in [g for g, f in self._loads.items() if f.done() and g not in wanted]:
            del self._loads[generation]  # its requests were cancelled meanwhile: the host tier may keep it
            self._staged_at.pop(generation, None)
        for entry in waiting:
            if len(self._loads) >= self.max_loads:
                break
            if entry.generation not in self._loads and not self._resident(entry):
                self._load(entry)

    def _current(self, adapter: str) -> Registration | None:
        """The registration that `adapter`'s requests are served by now (a name registered again serves its new
        adapter); None when there is none, or the registry remembers its load failing: then its requests end here."""
        entry = self.registry.get(adapter)
        failure = None if entry is None else self.registry.failure(entry)
        if entry is not None and failure is None:
            return entry
        if entry is None:
            self._end(adapter, "error", f"adapter {adapter!r} was unregistered", 404)
        else:
            self._end(adapter, "failed", failure)
        return None

    def _failed(self, entry: Registration) -> bool:
        """Whether entry's load (or slot write) has failed: then the requests that waited for it end with its
        error, whether or not the registry still remembers it (`AdapterRegistry.failure`), and the poll's end lets
        go of the load, so that a request after loads it again."""
        error = self._load_error(entry)
        if error is not None:
            self._end(entry.name, "failed", error)
        return error is not None

    def _load_error(self, entry: Registration) -> str | None:
        """The error of entry's load if it failed."""
        future = self._loads.get(entry.generation)
        return None if future is None or not future.done() or future.exception() is None else str(future.exception())

    def _no_slot(self, entry: Registration) -> bool:
        """Whether entry can get no slot until an adapter is unloaded: eviction is off and every slot holds another
        adapter (in "lru" a slot's holder becomes evictable once its requests end)."""
        return (self.pool.evict == "refuse" and self.pool.generation(entry.name) is None
                and len(self.pool.names) >= self.pool.num_slots)

    def _end(self, adapter: str, finish: str, error: str, status: int | None = None) -> None:
        """Ends every request waiting for `adapter` (`Request.end`)."""
        for request in self.pending.drop(adapter):
            request.end(finish, error, status)

    def _take_ready(self, ready: list[tuple[int, str, Registration]], before: float, passing: bool,
                    taken: list[tuple[int, Request]]) -> None:
        """Admits the admissible groups' requests that arrived before `before`, in arrival order; when they pass
        the blocked request (`passing`), only while passes are left."""
        while ready and ready[0][0] < before:
            if passing:
                if self._passes >= self.max_passes:
                    return
                self._passes += 1
            arrival, adapter, entry = heapq.heappop(ready)
            request = self.pending.popleft(adapter)
            if self._take(request, entry):
                taken.append((arrival, request))
            if self.pending.waits_for(adapter):
                heapq.heappush(ready, (self.pending.first(adapter), adapter, entry))

    def _resident(self, entry: Registration) -> bool:
        return self.pool.generation(entry.name) == entry.generation

    def _loaded(self, entry: Registration) -> bool:
        """Whether entry's load is done and staged: its requests wait for a slot only."""
        future = self._loads.get(entry.generation)
        return future is not None and future.done() and future.exception() is None

    def _load(self, entry: Registration) -> None:
        """Starts entry's load: from the device cache, a load done at once (on a loader thread when its slot write
        must be compiled again, for stacks that grew since); else disk -> host unless the host tier has it, then
        host -> device, on a loader thread."""
        tier, found = self.tiers.find(entry.generation)
        self.stats.device_cache_hits += tier == "device"
        self.stats.device_cache_misses += tier != "device"
        self.stats.host_hits += tier == "host"
        self.stats.host_misses += tier == "disk"
        submitted = time.monotonic()
        if tier == "device" and self.pool.write_compiled(found):  # nothing to copy or compile: only the write
            future = concurrent.futures.Future()
            future.set_result(found)
            self._loads[entry.generation] = future
            self._staged_at[entry.generation] = submitted
            self.wake()
            return

        def load() -> PreparedAdapter:
            self.stats.queued.append(time.monotonic() - submitted)
            try:
                staged = self.tiers.staged(self.pool, entry, found,
                                           lambda stage, seconds: getattr(self.stats, stage).append(seconds))
                self._staged_at[entry.generation] = time.monotonic()
                return staged
            except Exception as err:  # AdapterError, or anything else reading it raised
                reason = str(err) if isinstance(err, AdapterError) else f"{type(err).__name__}: {err}"
                logger.warning("adapter %r (%s) cannot be loaded: %s", entry.name, entry.adapter_dir, reason)
                reason = reason.replace(entry.adapter_dir, f"<{entry.name}>")  # requests are told no server path
                raise AdapterError(self._fail(entry, f"cannot be loaded: {reason}")) from err

        future = self.loader.submit(load)
        self._loads[entry.generation] = future
        future.add_done_callback(lambda _: self.wake())

    def _install(self, entry: Registration) -> bool:
        """Writes entry's staged adapter into a slot if its load is done and a slot is free or idle."""
        if not self._may_write:
            return False
        future = self._loads.get(entry.generation)
        if future is None or not future.done():
            return False
        if future.exception() is not None:  # failed since this poll looked: `_failed` ends its requests
            return False
        if self.pool.generation(entry.name) is not None:  # an older registration of the name holds a slot
            if self.pool.in_use(entry.name):
                return False
            self.pool.unload(entry.name)
        start = time.monotonic()
        try:
            self.pool.install(entry.name, future.result(), entry.generation)
        except PoolFullError:  # every slot holds an adapter in use: so for the rest of this poll (nothing is let go)
            self._may_write = False
            return False
        except Exception as err:  # the device out of memory for a part no adapter targeted before, say
            if self.tiers.relieve(err):  # the device cache let go of its adapters: the next poll tries again
                return False
            reason = f"{type(err).__name__}: {err}"
            logger.warning("adapter %r cannot be written into a slot: %s", entry.name, reason)
            failed = concurrent.futures.Future()  # in place of the load: its requests end (`_failed`)
            failed.set_exception(AdapterError(self._fail(entry, f"cannot be written into a slot: {reason}")))
            self._loads[entry.generation] = failed
            self._staged_at.pop(entry.generation, None)
            return False
        self.stats.slot_write.append(time.monotonic() - start)
        self.stats.slot_wait.append(start - self._staged_at.pop(entry.generation, start))
        del self._loads[entry.generation]
        self._may_write = False
        return True

    def _fail(self, entry: Registration, what: str) -> str:
        """Counts a failed load, has the registry remember it (`AdapterRegistry.fail`) and returns its message
        ("adapter 'name' {what} ...")."""
        self.stats.load_failures.append(entry.name)
        message = (f"adapter {entry.name!r} {what} (its requests fail at once for {self.registry.retry_after:g} s, "
                   f"then it is loaded again)")
        self.registry.fail(entry, message)
        return message

    def _take(self, request: Request, entry: Registration | None) -> bool:
        """Admits `request` for the batcher: holds its adapter and takes its slot. False when it ended instead."""
        # What its cached prefix depends on: the base, or the adapter as its slot holds it (`AdapterPool.prefix_id`)
        request.prefix_id = "base" if entry is None else self.pool.prefix_id(entry.name)
        if entry is None:
            return True
        vocab = self.pool.vocab_size(self.pool.slot(entry.name))
        if any(not 0 <= t < vocab for t in request.prompt):
            request.end("error", f"the prompt has token ids outside [0, {vocab}) (adapter {entry.name!r}'s "
                                 f"vocabulary)", 400)
            return False
        self.pool.hold([entry.name])
        request.slot = self.pool.slot(entry.name)
        user_update = request.on_update

        def on_update(r: Request) -> None:
            if r.finish is not None:
                self.pool.release([entry.name])
            if user_update is not None:
                user_update(r)

        request.on_update = on_update
        return True
