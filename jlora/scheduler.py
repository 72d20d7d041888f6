"""Continuous batching over a fixed set of cache rows: `Request` and the `Batcher` that runs them.

A `Batcher` owns `num_rows` cache rows of `max_seq` positions. Each `step()` either prefills waiting
requests into free rows (every admission in one bucketed call) or decodes every running row one token. A
finished or cancelled request frees its row at once, and requests may be added between any two steps, so
the same loop serves `Engine.generate` (all requests up front) and the server (requests arriving over time).

Decode steps are pipelined: step n+1 is dispatched, its input tokens being step n's output still on the
device, before the host reads step n's tokens, so the host's work (dispatch, bookkeeping, the device-to-host
copy) overlaps the device's. A request that ends at step n (a stop token) was already given to step n+1;
that token is dropped and its cache write is never read. Admissions wait for the step in flight, since
they need every row's state.

Rows outside a step (free, or finishing with the step in flight) and a prefill bucket's padding requests
run with slot -1, no cache write and greedy sampling; nothing they compute reaches a request.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
import numpy as np

from jlora.runner import ModelRunner, pack_prompts

__all__ = ["Batcher", "Request"]


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request. `out` grows as tokens arrive; `finish` is set when it ends: "stop" (a stop
    token, not included), "length" (max_new tokens), "cancelled", or, with `error` saying why, "error" (refused
    at intake) or "failed" (the engine failed). `on_update(request)`, when given, is called on the batcher's thread after every new token
    and once more when the request ends."""

    prompt: list[int]
    slot: int  # adapter slot, -1 for the base model
    max_new: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: frozenset[int] = frozenset()
    on_update: Callable[[Request], None] | None = None
    out: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    cancelled: bool = False
    error: str | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None  # time.monotonic() of its first token

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update(self)


class Batcher:
    """Runs requests on `runner` in `num_rows` cache rows of `max_seq` positions (each request's prompt plus
    max_new must fit). Not thread-safe: one thread adds, cancels and steps.

    `admit_delay` (seconds) batches admissions: while rows decode and fewer than a quarter of them are free,
    waiting requests are prefilled only once the oldest has waited that long, so that one prefill (which
    stalls every decoding row) takes in several requests. 0: admit at once.
    """

    def __init__(self, runner: ModelRunner, num_rows: int, max_seq: int, progress: Callable[[int], None] | None = None,
                 admit_delay: float = 0.0):
        self.runner = runner
        self.num_rows, self.max_seq = num_rows, max_seq
        self.admit_delay = admit_delay
        self.progress = progress
        self.cache = runner.new_cache(num_rows, max_seq)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request | None] = [None] * num_rows
        self.position = np.zeros(num_rows, np.int32)  # next cache index of each row
        self.last_token = np.zeros(num_rows, np.int32)
        self.in_flight = None  # a decode step not yet read: (tokens [B, 1] on the device, its rows)

    def add(self, request: Request) -> None:
        if len(request.prompt) + request.max_new > self.max_seq:
            raise ValueError(f"{len(request.prompt)} prompt tokens + max_new {request.max_new} exceed the "
                             f"batcher's {self.max_seq} positions")
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        """Whether a step has work: waiting or running requests, or a step in flight."""
        return bool(self.waiting) or any(self.running) or self.in_flight is not None

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.running)

    def cancel(self, request: Request) -> None:
        """Ends `request` ("cancelled"): a waiting one leaves the queue, a running one frees its row."""
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
            self._end(request, "cancelled")
        for row, r in enumerate(self.running):
            if r is request:
                self.running[row] = None
                self._end(request, "cancelled")

    def _end(self, r: Request, reason: str) -> None:
        r.finish = reason
        r._notify()

    def _record(self, row: int, token: int) -> None:
        """Records `token` as the next of row's request, ending it at a stop token or its length."""
        r = self.running[row]
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        if token in r.stop:
            self.running[row] = None
            self._end(r, "stop")
            return
        r.out.append(token)
        if len(r.out) >= r.max_new:
            self.running[row] = None
            self._end(r, "length")
        else:
            self.last_token[row] = token
            r._notify()

    def _hold_admission(self, free: int) -> bool:
        """Whether to decode once more before admitting (see `admit_delay`)."""
        return (self.admit_delay > 0 and free < self.num_rows // 4 and free < len(self.waiting)
                and self.num_running > 0 and time.monotonic() - self.waiting[0].arrival < self.admit_delay)

    def _collect(self) -> None:
        """Reads the step in flight and records its tokens."""
        tokens, rows = np.asarray(self.in_flight[0])[:, 0], self.in_flight[1]
        self.in_flight = None
        live = [row for row in rows if self.running[row] is not None]  # not ended by the step before
        for row in live:
            self._record(row, int(tokens[row]))
        if self.progress:
            self.progress(len(live))

    def step(self) -> None:
        """One step: admit waiting requests into free rows (a prefill), else decode the running rows."""
        free = [row for row in range(self.num_rows) if self.running[row] is None]
        if self.waiting and free and not self._hold_admission(len(free)):
            if self.in_flight is not None:
                self._collect()
                return
            admitted = [(row, self.waiting.popleft()) for row in free[: len(self.waiting)]]
            self._prefill(admitted)
            if self.progress:
                self.progress(len(admitted))
            return
        pending = set() if self.in_flight is None else set(self.in_flight[1].tolist())
        rows = np.array([row for row, r in enumerate(self.running)
                         if r is not None and len(r.out) + (row in pending) < r.max_new], np.int64)
        if rows.size == 0:  # every running request completes with the step in flight
            if self.in_flight is not None:
                self._collect()
            return
        n = self.num_rows
        slots, seeds = np.full(n, -1, np.int32), np.zeros(n, np.uint32)
        temps, top_ps = np.zeros(n, np.float32), np.ones(n, np.float32)
        token_index = np.zeros(n, np.int32)
        active = np.zeros(n, bool)
        for row in rows:
            r = self.running[row]
            active[row] = True
            slots[row], seeds[row], temps[row], top_ps[row] = r.slot, r.seed, r.temperature, r.top_p
            token_index[row] = len(r.out) + (row in pending)
        # [B, 1]: the step in flight's tokens on the device, else the host's, placed as those would be.
        last = (self.runner.like_step_outputs(self.last_token[:, None]) if self.in_flight is None
                else self.in_flight[0])
        tokens, self.cache = self.runner.step(
            last, np.where(active, self.position, 0)[:, None], active[:, None], None, np.zeros(n, np.int32),
            self.cache, slots, seeds, token_index, temps, top_ps, _nucleus(temps, top_ps))
        self.position[rows] += 1
        if self.in_flight is not None:
            self._collect()  # while the step just dispatched runs
        self.in_flight = (tokens, rows)

    def _prefill(self, admitted: list[tuple[int, Request]]) -> None:
        """Prefills admitted requests into their cache rows and records each one's first token."""
        tokens, positions, slots, valid = pack_prompts([r.prompt for _, r in admitted], [r.slot for _, r in admitted])
        n = tokens.shape[0]
        # Padding requests: slot -1 and no valid token (pack_prompts), so no cache write; row 0, greedy.
        rows, last, seeds = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.uint32)
        temps, top_ps = np.zeros(n, np.float32), np.ones(n, np.float32)
        for i, (row, r) in enumerate(admitted):
            rows[i], last[i], seeds[i], temps[i], top_ps[i] = row, len(r.prompt) - 1, r.seed, r.temperature, r.top_p
            self.running[row] = r  # before the step: a step that raises leaves its requests findable
            self.position[row] = len(r.prompt)
        next_tokens, self.cache = self.runner.step(tokens, positions, valid, rows, last, self.cache,
                                                    slots.reshape(-1), seeds, np.zeros(n, np.int32), temps, top_ps,
                                                    _nucleus(temps, top_ps))
        next_tokens = np.asarray(next_tokens)[:, 0]
        for i, (row, _) in enumerate(admitted):
            self._record(row, int(next_tokens[i]))


def _nucleus(temps: np.ndarray, top_ps: np.ndarray) -> bool:
    """Whether a step needs the top-p sort: some row samples with top_p < 1."""
    return bool(((temps > 0) & (top_ps < 1)).any())
