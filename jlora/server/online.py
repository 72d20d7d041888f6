"""`OnlineEngine`: one thread owns the device and runs the engine's continuous batching over time.

Other threads talk to it through one FIFO inbox: submit a request, cancel one, or call a function between
steps (adapter unloads), so the device and the adapter pool are only ever touched by the loop. Requests pass
through `Admission` on their way to the batcher: a request whose adapter is not in a device slot waits
there, without holding up anyone else, while loader threads read the adapter and the loop writes it into a
slot between two steps. An admitted request holds its adapter until it ends, so unloading or evicting an
adapter in use fails instead of changing a running request's weights.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from jlora.admission import Admission
from jlora.engine import Engine
from jlora.runner import bucket
from jlora.scheduler import Request
from jlora.server.metrics import Metrics

__all__ = ["EngineStopped", "OnlineEngine", "QueueFull"]

logger = logging.getLogger("jlora.server")


class QueueFull(RuntimeError):
    """More requests are waiting than the engine accepts (`max_waiting`)."""


class EngineStopped(Exception):
    """The engine loop stopped for good: it failed, and starting over on a fresh cache failed too, or the server
    ended its requests to shut down (`OnlineEngine.end_all`)."""


class OnlineEngine:
    """`engine` served online: requests join between steps, in `bucket(max_batch)` rows of up to `max_seq_len`
    positions over the cache the engine's config sets (`Engine.new_batcher`). `start()` runs the loop thread;
    `stop()` ends it."""

    def __init__(self, engine: Engine, *, max_waiting: int = 256, metrics: Metrics | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics or Metrics()
        self.metrics.watch(engine)
        self.batcher = engine.new_batcher(bucket(engine.config.max_batch), bucket(engine.config.max_seq_len, 16))
        self._inbox: queue.Queue = queue.Queue()
        self.admission = Admission(engine.pool, engine.registry, engine.tiers, engine.loader,
                                   wake=lambda: self._inbox.put(("wake",)), max_loads=engine.max_loads)
        self._queued = 0  # submitted, not yet taken in by the loop
        self._preemptions_seen = 0  # the batcher's count already added to the metric
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.stopped_by: str | None = None  # why the loop stopped for good (`EngineStopped`)
        self._thread = threading.Thread(target=self._loop, name="jlora-engine", daemon=True)
        self._set_gauges()  # a scrape before the first request sees the cache's blocks and the adapters in slots

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread.is_alive():  # not started: a server whose start failed
            self._thread.join(timeout=10)

    @property
    def down(self) -> str | None:
        """Why the loop takes no requests (it stopped for good, or it is not running), or None while it does."""
        if self.stopped_by is not None:
            return self.stopped_by
        return None if self._thread.is_alive() else "the engine loop is not running"

    @property
    def num_waiting(self) -> int:
        return self._queued + len(self.admission.pending) + len(self.batcher.waiting)

    def submit(self, requests: Request | Sequence[Request], adapter: str | None) -> None:
        """Queues one request or several (all or none) for `adapter` (None: the base model). `on_update` is
        called on the loop thread; a request whose adapter is not registered by its intake ends at once with
        finish "error" and `.error`, one whose adapter cannot be loaded with "failed".

        Raises:
          QueueFull: they would make more than `max_waiting` requests wait.
          EngineStopped: the loop stopped for good.
        """
        requests = [requests] if isinstance(requests, Request) else list(requests)
        with self._lock:  # held while queueing, so that nothing arrives after `_stop_for_good` emptied the inbox
            if self.stopped_by is not None:
                raise EngineStopped(self.stopped_by)
            if self.num_waiting + len(requests) > self.max_waiting:
                raise QueueFull(f"{self.num_waiting} requests are waiting (max {self.max_waiting})")
            self._queued += len(requests)
            for request in requests:
                self._inbox.put(("submit", request, adapter))

    def cancel(self, request: Request) -> None:
        """Ends `request` ("cancelled") if it is still waiting or running; its row frees at once."""
        with self._lock:
            if self.stopped_by is None:
                self._inbox.put(("cancel", request))

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Runs `fn()` on the loop thread between two steps; the future holds its result or exception. Raises
        EngineStopped once the loop stopped for good."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.stopped_by is not None:
                raise EngineStopped(self.stopped_by)
            self._inbox.put(("call", fn, future))
        return future

    def end_all(self, message: str) -> None:
        """Ends every request queued, waiting or running (finish "failed", `message`, HTTP 503) between two steps,
        and takes no more (`EngineStopped`): a server that shuts down now rather than after its requests."""
        try:
            self.call(lambda: self._stop_for_good(message, status=503))
        except EngineStopped:  # stopped already: nothing runs
            pass

    def unload_adapter(self, name: str) -> concurrent.futures.Future:
        """Unloads an adapter on the loop thread (`Engine.unload_adapter`); the future raises KeyError when it is
        not registered and RuntimeError while requests taken in hold it or wait for it."""
        def unload() -> None:
            if self.admission.pending.waits_for(name):
                raise RuntimeError(f"adapter {name!r} is used by running requests (waiting for it)")
            self.engine.unload_adapter(name)

        return self.call(unload)

    def _take(self, item) -> None:
        kind = item[0]
        if kind == "submit":
            _, request, adapter = item
            with self._lock:
                self._queued -= 1
            try:
                self._intake(request, adapter)
            except Exception as err:  # only this request is touched: it alone fails
                logger.exception("taking a request in failed")
                request.end("failed", f"taking the request in failed: {type(err).__name__}: {err}")
        elif kind == "cancel":
            if item[1].finish is None and not self.admission.cancel(item[1]):
                self.batcher.cancel(item[1])
        elif kind == "call":
            _, fn, future = item
            try:
                future.set_result(fn())
            except Exception as err:  # handed to the caller, which answers its client
                future.set_exception(err)

    def _intake(self, request: Request, adapter: str | None) -> None:
        if request.cancelled:
            return request.end("cancelled")
        user_update = request.on_update
        arrival = time.monotonic()

        def on_update(r: Request) -> None:
            if r.finish is not None:
                self.metrics.finished(r, adapter, arrival)
                self._set_gauges()  # before its client hears of the end, so the metrics it reads agree
            if user_update is not None:
                user_update(r)

        request.on_update = on_update
        self.metrics.prompt_tokens.inc(len(request.prompt))
        self.admission.submit(request, adapter)

    def _fail_all(self, what: str, err: Exception) -> None:
        """Ends every waiting and running request with finish "failed" ("{what}: {err}") and starts over on a fresh
        cache. When `err` ran the device out of memory, the device cache lets go of its adapters first, so that
        the fresh cache and the steps after have that memory (`AdapterTiers.relieve`). When no fresh cache can
        be made, the loop stops for good (`_stop_for_good`)."""
        message = f"{what}: {type(err).__name__}: {err}"
        if self.engine.tiers.relieve(err):
            logger.warning("the device ran out of memory: the device cache let go of its adapters")
        old = self.batcher
        old.cache = None  # its memory freed first: a cache sized to most of the device does not fit twice
        try:
            self.batcher = self.engine.new_batcher(old.num_rows, old.max_seq)
        except Exception as again:  # no fresh cache either: end what waits, refuse what comes
            logger.exception("the engine cannot start over; it takes no more requests")
            return self._stop_for_good(f"{message}; starting over on a fresh cache failed too "
                                       f"({type(again).__name__}: {again}): the engine takes no more requests")
        self._preemptions_seen = 0
        taken = self._taken_in(old)
        self.admission.pending.clear()
        for r in taken:
            r.end("failed", message)

    def _taken_in(self, batcher) -> list[Request]:
        """The requests taken in: waiting in admission, then waiting and running in `batcher`."""
        return [*self.admission.pending.requests(), *batcher.waiting,
                *(r for r in batcher.running if r is not None)]

    def _loop(self) -> None:
        last_start = None  # the last step's start while requests have run since
        while not self._stop.is_set() and self.stopped_by is None:
            try:
                last_start = self._turn(last_start)
            except Exception as err:  # the loop must outlive any failure: every later request would hang
                logger.exception("the engine loop failed")
                self._fail_all("the engine loop failed", err)
                last_start = None
        self.batcher.settle()  # the device idle once the loop ends: a process may exit next

    def _stop_for_good(self, message: str, status: int | None = None) -> None:
        """Ends every request taken in or queued ("failed", `message`, HTTP `status`; None: 500) and every queued
        call (`EngineStopped`); later submits and calls raise EngineStopped, and `down` says why."""
        with self._lock:
            self.stopped_by = message
            items = []
            while not self._inbox.empty():
                items.append(self._inbox.get_nowait())
            self._queued = 0
        for r in [*self._taken_in(self.batcher), *(item[1] for item in items if item[0] == "submit")]:
            if r.finish is None:
                r.end("failed", message, status)
        for item in items:
            if item[0] == "call":
                item[2].set_exception(EngineStopped(message))

    def _turn(self, last_start: float | None) -> float | None:
        """One turn of the loop: admits, takes in what arrived, runs a step if any request runs. Returns the
        step's start (None when idle)."""
        # Admit first: the last step may have freed the slots that waiting requests need, and an idle loop
        # then blocks until something arrives. While steps run, slots are written during a step (`poll`'s
        # host time then overlaps the device's) and requests for resident adapters admitted before one.
        self.admission.poll(self.batcher.add, write=not self.batcher.busy)
        if not self.batcher.busy:
            last_start = None  # idle: the wait for work is no interval between steps
        try:  # block for work when idle; between steps take whatever has arrived
            self._take(self._inbox.get(block=not self.batcher.busy))
            while True:
                self._take(self._inbox.get_nowait())
        except queue.Empty:
            pass
        if self.stopped_by is not None:  # a call ended every request (`end_all`): no step for them
            return None
        self.admission.poll(self.batcher.add, write=not self.batcher.busy)  # what just arrived
        if self.batcher.busy:
            start = time.monotonic()
            if last_start is not None:
                self.metrics.step_interval_seconds.observe(start - last_start)
            last_start = start
            try:
                self.batcher.step(lambda: self.admission.poll(self.batcher.add))
            except Exception as err:  # a failed step must not hang its requests, nor stop the server
                logger.exception("the engine step failed")
                self._fail_all("the engine step failed", err)
            self.metrics.step_seconds.observe(time.monotonic() - start)
        self._set_gauges()
        return last_start

    def _set_gauges(self) -> None:
        self.metrics.running.set(self.batcher.num_running)
        self.metrics.waiting.set(self.num_waiting)
        blocks = self.batcher.blocks
        self.metrics.kv_blocks.set(blocks.num_blocks)
        self.metrics.kv_blocks_used.set(blocks.num_blocks - blocks.num_available)
        self.metrics.kv_blocks_cached.set(blocks.num_cached)
        self.metrics.prefix_hit_rate.set(blocks.stats.hit_rate)
        self.metrics.preemptions.inc(self.batcher.preemptions - self._preemptions_seen)
        self._preemptions_seen = self.batcher.preemptions
        self.metrics.adapters(self.admission.stats, self.engine)
