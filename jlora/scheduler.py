"""Continuous batching over a fixed set of rows: `Request` and the `Batcher` that runs them.

A `Batcher` owns `num_rows` rows of up to `max_seq` positions over a KV cache of blocks. Every `step()`
decodes each running row one token and, in the same model call, prefills prompts of waiting requests into
free rows: a prompt never stalls the rows that decode, which read the weights once with it. A step takes at
most `prefill_chunk` prompt tokens (padded), so a long prompt is prefilled in pieces over several steps
(chunked prefill) and a step costs little more than a decode step. A finished or cancelled request frees its
row and blocks at once, and requests may be added between any two steps, so the same loop serves
`Engine.generate` (all requests up front) and the server (requests arriving over time).

Steps are pipelined: step n+1 is dispatched, its input tokens being step n's output still on the device,
before the host reads step n's tokens, so the host's work (dispatch, bookkeeping, the device-to-host copy)
overlaps the device's. A request that ends at step n (a stop token) was already given to step n+1; that
token is dropped and its cache write is never read. A row freed so is only refilled by a later step, whose
prompt overwrites it; tokens are recorded only for the request that was in the row when its step went out.

Rows that do not decode in a step (free, being prefilled, or finishing with the step in flight) and a
prefill bucket's padding run with slot -1, no cache write and greedy sampling; nothing they compute reaches a
request.

A request holds the cache blocks its positions so far need and takes one more as it crosses into a new one.
When a decoding row needs a block and none is free, the request admitted last is preempted: the host reads
the step in flight, copies the request's blocks to host memory and frees them, and the request goes back to
the head of the queue; it resumes, before any new request is admitted, by copying them into new blocks. The
same bytes come back, so it generates exactly what it would have (a request preempted while its prompt goes
in starts its prompt again: prefill does not depend on how a prompt is cut into pieces).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np

from jlora.logprobs import StepLogprobs, TokenLogprob, to_host, top_width
from jlora.models.llama import Group
from jlora.paging import BlockPool, block_keys
from jlora.runner import HISTORY_DTYPE, ModelRunner, bucket, pack_prompts
from jlora.sampling import Penalties, Sampling
from jlora.step import Step

__all__ = ["Batcher", "Request"]


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request. `out` grows as tokens arrive; `finish` is set when it ends: "stop" (a stop
    token, not included), "length" (max_new tokens), "cancelled", or, with `error` saying why, "error" (refused
    at intake; `status` 404 for an adapter not registered, 400 for bad input) or "failed" (the engine, or the
    load of its adapter, failed). `on_update(request)`, when given, is called on the batcher's thread after
    every new token and once more when the request ends.

    With `logprobs` = k (not None), `out_logprobs` holds each token of `out` with its log-probability and the
    k most likely tokens, and last the stop token's when one ended the request. With `prompt_logprobs` = k,
    `prompt_out_logprobs` holds the same for each prompt token (None for the first, which nothing predicts),
    complete by the first token; then `max_new` may be 0 (scoring: the request ends once its prompt is in), and
    so for a fork of such a request.

    A request `fork_of` another with the same prompt (another sample of it) shares its prefill: once that
    request's prompt is in the cache, and while it still holds its row, this one takes a free row as a copy of
    that row and prefills only its last prompt token, whose logits give it its own first token. If the other
    has ended by then, it prefills its prompt itself."""

    prompt: list[int]
    slot: int  # adapter slot, -1 for the base model
    max_new: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: frozenset[int] = frozenset()
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off (`jlora.sampling.apply_penalties`)
    frequency_penalty: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    on_update: Callable[[Request], None] | None = None
    out: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    cancelled: bool = False
    error: str | None = None
    status: int | None = None
    first_token_time: float | None = None  # time.monotonic() of its first token
    fork_of: Request | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prefix_id: str | None = None  # what its keys and values depend on beside its tokens (`Admission` sets it)
    cache_salt: str | None = None  # shares cached prompt blocks only with requests of the same salt (`block_keys`)
    out_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_out_logprobs: list[TokenLogprob | None] = dataclasses.field(default_factory=list)

    @property
    def penalized(self) -> bool:
        """Whether it asks for a repetition, frequency or presence penalty."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update(self)

    def end(self, finish: str, error: str | None = None, status: int | None = None) -> None:
        """Ends the request before it reached a row (or with every row's state dropped): sets `finish`,
        `error` and `status` (an HTTP code, None: the server's own) and tells `on_update`."""
        self.error, self.status, self.finish = error, status, finish
        self._notify()


class _Waiting:
    """The waiting requests in order (arrival; preempted ones back at the head). What each step asks of them,
    whether a request waits and which forks of a request wait (in queue order), is answered in O(1), so that a
    step's host work does not grow with the queue's length."""

    def __init__(self):
        self._order: collections.deque[Request] = collections.deque()
        self._members: set[Request] = set()
        self._forks: dict[Request, list[Request]] = {}  # a source's waiting forks

    def append(self, r: Request, at_head: bool = False) -> None:
        self._members.add(r)
        if at_head:
            self._order.appendleft(r)
        else:
            self._order.append(r)
        if r.fork_of is not None:
            forks = self._forks.setdefault(r.fork_of, [])
            forks.insert(0 if at_head else len(forks), r)

    def remove(self, r: Request) -> None:
        self._order.remove(r)  # at or near the head, where requests leave
        self._members.remove(r)
        if r.fork_of is not None:
            forks = self._forks[r.fork_of]
            forks.remove(r)
            if not forks:
                del self._forks[r.fork_of]

    def forks_of(self, source: Request) -> list[Request]:
        return list(self._forks.get(source, ()))

    @property
    def head(self) -> Request:
        return self._order[0]

    def __contains__(self, r: Request) -> bool:
        return r in self._members

    def __iter__(self) -> Iterator[Request]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class Batcher:
    """Runs requests on `runner` in `num_rows` rows of up to `max_seq` positions each (a request's prompt plus
    max_new must fit), prefilling at most `prefill_chunk` prompt tokens per step (a power of two >= 16). Not
    thread-safe: one thread adds, cancels and steps.

    The KV cache is `num_blocks` blocks of `block_size` positions (default: `max_seq`, one block per row, a
    contiguous cache; `num_blocks` default: enough for every row at `max_seq`). A request is admitted (first
    come, first served) when a row is free and the free blocks cover its prompt and first token while leaving
    one block for each running request that may grow; it takes further blocks as it grows, and gives its row
    and blocks back when it ends. Rows may so outnumber what the blocks hold at `max_seq`; when the blocks run
    out, the request admitted last is preempted (see the module docstring; `preemptions` counts them).

    With `prefix_caching`, a request with a `prefix_id` (and no `prompt_logprobs`: those need every prompt
    token computed) starts from the longest run of full blocks of its prompt that an earlier request with the
    same `prefix_id` left in the cache (`BlockPool`), and prefills only the rest."""

    def __init__(self, runner: ModelRunner, num_rows: int, max_seq: int, progress: Callable[[int], None] | None = None,
                 prefill_chunk: int = 512, block_size: int | None = None, num_blocks: int | None = None,
                 prefix_caching: bool = False):
        self.runner = runner
        self.num_rows, self.max_seq = num_rows, max_seq
        self.prefill_chunk = prefill_chunk
        self.progress = progress
        size = block_size or max_seq
        per_row = -(-max_seq // size)
        self.blocks = BlockPool(num_blocks or num_rows * per_row, size, prefix_caching)
        self.tables = np.zeros((num_rows, per_row), np.int32)  # each row's blocks in position order
        self._held: list[list[int]] = [[] for _ in range(num_rows)]
        self._keys: list[list[bytes]] = [[] for _ in range(num_rows)]  # the prefix keys of each row's prompt
        self.cache = runner.new_cache(self.blocks.num_blocks, size)
        self.waiting = _Waiting()
        self.running: list[Request | None] = [None] * num_rows  # a row's request, from its first prompt piece
        self._admitted = np.zeros(num_rows, np.int64)  # when each row's request took it (preemption's order)
        self._admissions = 0
        self._swapped: dict[Request, _Swapped] = {}  # preempted requests' blocks in host memory
        self._resumed: list[int] = []  # rows resumed for the next step: their last token comes from the host
        self.preemptions = 0
        # Each row's next cache index: while its prompt goes in, the prompt tokens in the cache so far.
        self.position = np.zeros(num_rows, np.int32)
        self.last_token = np.zeros(num_rows, np.int32)
        # The penalties' token history [num_rows, max_seq] on the device, made by the first step with penalties
        # and kept up to date by the steps with penalties (each writes its decode tokens); and the rows placed
        # since, whose tokens the next step with penalties first writes there from the host (`_penalties`).
        self.history: jax.Array | None = None
        self._rows_to_write: set[int] = set()
        self.in_flight: _InFlight | None = None  # the step dispatched last, not yet read

    def add(self, request: Request) -> None:
        if not request.prompt:
            raise ValueError("the prompt is empty")
        scoring = request.prompt_logprobs is not None or request.fork_of is not None  # a fork: its source scores
        if request.max_new < (0 if scoring else 1):
            raise ValueError(f"max_new must be >= 1 (>= 0 when scoring the prompt), got {request.max_new}")
        fork = request.fork_of
        if fork is not None and (fork.prompt != request.prompt or request.prompt_logprobs is not None):
            raise ValueError("a fork has its source's prompt and no prompt_logprobs of its own")
        if len(request.prompt) + request.max_new > self.max_seq:
            raise ValueError(f"{len(request.prompt)} prompt tokens + max_new {request.max_new} exceed the "
                             f"batcher's {self.max_seq} positions")
        if self._blocks_for(request) > self.blocks.num_blocks:
            raise ValueError(f"{len(request.prompt)} prompt tokens + max_new {request.max_new} need "
                             f"{self._blocks_for(request)} cache blocks, more than the cache's "
                             f"{self.blocks.num_blocks}")
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
            self._swapped.pop(request, None)
            self._end(request, "cancelled")
        for row, r in enumerate(self.running):
            if r is request:
                self._free(row)
                self._end(request, "cancelled")

    def _blocks_for(self, r: Request) -> int:
        return self.blocks.blocks_for(len(r.prompt) + r.max_new)

    def _take(self, row: int, r: Request) -> bool:
        """Gives `r` row `row` and the cache blocks of its prompt and first token, the cached ones of its prompt's
        prefix first, and sets its position after them; False (nothing changes) when the free blocks, less one
        for each running request that may grow (the blocks they take next), are too few."""
        size, pool = self.blocks.block_size, self.blocks
        shares = pool.prefix_caching and r.prefix_id is not None and r.prompt_logprobs is None
        keys = block_keys(r.prefix_id, r.prompt, size, r.cache_salt) if shares else []
        cached = pool.match(keys, (len(r.prompt) - 1) // size) if keys else []  # one prompt token left to run
        need = pool.blocks_for(len(r.prompt) + min(r.max_new, 1)) - len(cached)
        rest = pool.allocate(need) if self._room_for(need) else None
        if rest is None:
            pool.release(cached)
            return False
        self._place(row, r, cached + rest)
        self._keys[row], self.position[row] = keys, len(cached) * size
        return True

    def _room_for(self, need: int) -> bool:
        """Whether `need` blocks may go to a request taking a row: the free blocks cover them and leave one for each
        running request that holds fewer blocks than it may come to need (the blocks those take next)."""
        growing = sum(r is not None and len(held) < self._blocks_for(r) for r, held in zip(self.running, self._held))
        return self.blocks.num_available - need >= growing

    def _place(self, row: int, r: Request, blocks: list[int], admitted: int | None = None) -> None:
        """Puts `r` in row `row` over `blocks`, admitted now (or at `admitted`: a resumed request keeps its turn)."""
        self._held[row] = blocks
        self.tables[row, : len(blocks)] = blocks
        self.running[row] = r
        self._rows_to_write.add(row)
        if admitted is None:
            self._admissions += 1
        self._admitted[row] = self._admissions if admitted is None else admitted

    def _grow(self, decode: list[int]) -> bool:
        """Gives each row of `decode` the block its next position needs; False when the blocks ran out."""
        for row in decode:
            held = self._held[row]
            need = self.blocks.blocks_for(int(self.position[row]) + 1) - len(held)
            if need > 0:
                blocks = self.blocks.allocate(need)
                if blocks is None:
                    return False
                self.tables[row, len(held): len(held) + need] = blocks
                held.extend(blocks)
        return True

    def _preempt(self) -> None:
        """Preempts the request admitted last (with no step in flight): a request past its prompt leaves its
        blocks' keys and values in host memory, one whose prompt is going in starts it again; either goes back
        to the head of the queue."""
        row = max((row for row, r in enumerate(self.running) if r is not None), key=lambda row: self._admitted[row])
        r = self.running[row]
        if self.position[row] >= len(r.prompt):
            held = self._held[row][: self.blocks.blocks_for(int(self.position[row]))]
            self._swapped[r] = _Swapped(self.runner.read_blocks(self.cache, held), int(self.position[row]),
                                        int(self._admitted[row]))
        else:
            r.prompt_out_logprobs.clear()
        self._free(row)
        self.waiting.append(r, at_head=True)
        self.preemptions += 1

    def _resume(self) -> None:
        """Preempted requests at the head of the queue take free rows and blocks and their keys and values back,
        while both last (leaving, as admission does, a block for each running request)."""
        free = [row for row, r in enumerate(self.running) if r is None]
        while self.waiting and self.waiting.head in self._swapped and free:
            r = self.waiting.head
            saved = self._swapped[r]
            need = self.blocks.blocks_for(saved.position + 1)
            if not self._room_for(need):
                return
            blocks = self.blocks.allocate(need)
            row = free.pop(0)
            self.cache = self.runner.write_blocks(self.cache, blocks[: len(saved.blocks.k[0])], saved.blocks)
            self._place(row, r, blocks, saved.admitted)
            self.position[row], self.last_token[row] = saved.position, r.out[-1]
            self._resumed.append(row)
            del self._swapped[r]
            self.waiting.remove(r)

    def _free(self, row: int) -> None:
        """Ends row's hold on its request and blocks (a step in flight may still write them: a later step that
        reuses them writes each position before reading it)."""
        self.running[row] = None
        self.blocks.release(self._held[row])
        self._held[row], self._keys[row] = [], []

    def _end(self, r: Request, reason: str) -> None:
        r.finish = reason
        r._notify()

    def _record(self, row: int, token: int, logprobs: StepLogprobs | None) -> None:
        """Records `token` as the next of row's request, ending it at a stop token or its length."""
        r = self.running[row]
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        if token in r.stop:
            if r.logprobs is not None:  # the stop token's too (not in `out`): what the model gave it is asked for
                r.out_logprobs.append(TokenLogprob.at(logprobs.sampled, row, token, r.logprobs))
            self._free(row)
            self._end(r, "stop")
            return
        if r.logprobs is not None:  # first: a reader on another thread that sees a token finds its entry
            r.out_logprobs.append(TokenLogprob.at(logprobs.sampled, row, token, r.logprobs))
        r.out.append(token)
        if len(r.out) >= r.max_new:
            self._free(row)
            self._end(r, "length")
        else:
            self.last_token[row] = token
            r._notify()

    def settle(self) -> None:
        """Waits until the device has run every step and adapter slot write dispatched, and drops the step in flight
        unread: for a caller that steps no more (a process exiting with a step still running on the device can
        crash in its exit)."""
        try:
            jax.block_until_ready((self.cache, self.history, self.in_flight and self.in_flight.tokens,
                                   self.runner.pool.weights))
        except Exception:  # a step that failed has ended too; its requests hear of it no more
            pass
        self.in_flight = None

    def _collect(self) -> None:
        """Reads the step in flight and records its tokens (and log-probabilities) for the requests still in
        their rows; a scoring request (max_new 0) whose prompt is in ends."""
        step, self.in_flight = self.in_flight, None
        tokens, logprobs = np.asarray(step.tokens)[:, 0], to_host(step.logprobs)
        for i, (row, r, start, length) in enumerate(step.pieces):
            if self.running[row] is not r:  # ended since
                continue
            if r.prompt_logprobs is not None:
                if start == 0:
                    r.prompt_out_logprobs.append(None)  # nothing predicts the first token
                for pos in range(start, min(start + length, len(r.prompt) - 1)):
                    at = i * step.piece_width + pos - start
                    r.prompt_out_logprobs.append(TokenLogprob.at(logprobs.prompt, at, r.prompt[pos + 1],
                                                                 r.prompt_logprobs))
            if start + length == len(r.prompt) and r.max_new == 0:
                self._free(row)
                self._end(r, "length")
        live = [row for row, r in step.sampling if self.running[row] is r]  # not ended since
        for row in live:
            self._record(row, int(tokens[row]), logprobs)
        if self.progress:
            self.progress(len(live))

    def _source_row(self, r: Request) -> int | None:
        """The row of the request `r` forks from, when that request still holds it; None otherwise."""
        source = r.fork_of
        return next((row for row, s in enumerate(self.running) if s is source), None) if source is not None else None

    def _start_forks(self) -> None:
        """Waiting forks whose source's prompt is in its row take free rows and blocks, their prompt's blocks
        (past those they share from the prefix cache) copies of the source's, with their last prompt token left
        to prefill (the step after the source's last piece went out, at the earliest)."""
        free = [row for row, r in enumerate(self.running) if r is None]
        sources = [(row, r) for row, r in enumerate(self.running)
                   if r is not None and self.position[row] >= len(r.prompt)]
        for source, s in sources:
            for r in self.waiting.forks_of(s):
                if not free:
                    return
                if r in self._swapped or not self._take(free[0], r):  # swapped: resumes as it is
                    continue
                row = free.pop(0)
                shared = int(self.position[row]) // self.blocks.block_size  # from the prefix cache: never written
                n = self.blocks.blocks_for(len(r.prompt))
                self.cache = self.runner.copy_blocks(self.cache, self.tables[source, shared:n],
                                                     self.tables[row, shared:n])
                self.waiting.remove(r)
                self.position[row] = len(r.prompt) - 1

    def _waits(self, r: Request) -> bool:
        """Whether a waiting fork waits for its source's prompt (the source waits, or its prompt is going in)."""
        if r.fork_of is None:
            return False
        source = self._source_row(r)
        return r.fork_of in self.waiting or (source is not None and self.position[source] < len(r.prompt))

    def _pieces(self) -> list[tuple[int, Request, int, int]]:
        """The prompt pieces of the next step, (row, request, start, length): first the prompts already under
        way, then waiting requests (but forks that wait for their source), each taking a free row, while the
        pieces padded to [bucket(n), bucket(longest)] hold at most `prefill_chunk` tokens; a prompt that does not
        fit whole is cut to what does."""
        self._start_forks()
        free = [row for row, r in enumerate(self.running) if r is None]
        under_way = [(row, r) for row, r in enumerate(self.running)
                     if r is not None and self.position[row] < len(r.prompt)]
        pieces, longest = [], 0
        admissible = [] if self._swapped else list(itertools.islice((r for r in self.waiting if not self._waits(r)),
                                                                   len(free)))  # no more can take a row
        for row, r in under_way + list(zip(free, admissible)):
            width = self.prefill_chunk // bucket(len(pieces) + 1)  # the longest piece n + 1 pieces may have
            if width < 16 or longest > width:
                break
            if self.running[row] is not r:  # admitted: takes its row and blocks before the step (so that a step
                if not self._take(row, r):  # that raises leaves it findable), or waits: first come, first served
                    break
                self.waiting.remove(r)
            start = int(self.position[row])
            length = min(len(r.prompt) - start, width)
            pieces.append((row, r, start, length))
            longest = max(longest, length)
        return pieces

    def step(self, while_in_flight: Callable[[], None] | None = None) -> None:
        """One step: decodes the running rows and prefills the next prompt pieces, in one model call.

        `while_in_flight`, if given, runs once the step is dispatched and before the step before it is read: host
        work there overlaps the device's two steps, where after `step` returns it overlaps one."""
        self._resume()
        decode, sampled = self._decode_rows()
        while not self._grow(decode):  # settle the step in flight (it may free blocks), else preempt; again
            if self.in_flight is not None:
                self._collect()
            else:
                self._preempt()
            decode, sampled = self._decode_rows()
        pieces = self._pieces()
        if not decode and not pieces:  # every running request completes with the step in flight
            if self.in_flight is not None:
                self._collect()
            return
        firsts = [(row, r) for row, r, start, length in pieces if start + length == len(r.prompt) and r.max_new > 0]
        sampling = [(row, self.running[row]) for row in decode] + firsts  # the requests this step samples for
        step = self._build(decode, sampled, pieces, sampling)
        tokens, self.cache, step_logprobs, history = self.runner.step(
            step, self.cache, None if step.penalties is None else self.history)
        if history is not None:
            self.history = history
        for row, _, start, length in pieces:  # the full blocks of prompt this step writes: reusable (later steps
            full = (start + length) // self.blocks.block_size  # that read them run after it)
            self.blocks.commit(self._held[row][:full], self._keys[row][:full])
        self.position[decode] += 1
        for row, _, start, length in pieces:
            self.position[row] = start + length
        if while_in_flight is not None:
            while_in_flight()
        if self.in_flight is not None:
            self._collect()  # while the step just dispatched runs
        width = 0 if step.prefill is None else step.prefill.tokens.shape[1]
        self.in_flight = _InFlight(tokens, sampling, pieces, width, step_logprobs)

    def _decode_rows(self) -> tuple[list[int], set[int]]:
        """(the rows that decode in the next step: their prompt is in and they need more tokens, those of them
        with a token in the step in flight)."""
        sampled = (set() if self.in_flight is None
                   else {row for row, r in self.in_flight.sampling if self.running[row] is r})
        decode = [row for row, r in enumerate(self.running)
                  if r is not None and self.position[row] >= len(r.prompt) and len(r.out) + (row in sampled) < r.max_new]
        return decode, sampled

    def _build(self, decode: list[int], sampled: set[int], pieces: list[tuple[int, Request, int, int]],
               sampling: list[tuple[int, Request]]) -> Step:
        """The `Step` that decodes rows `decode` (those in `sampled` have a token in flight), prefills `pieces`
        and samples for `sampling`, computing log-probabilities of the width its requests ask for."""
        n = self.num_rows
        slots, seeds = np.full(n, -1, np.int32), np.zeros(n, np.uint32)
        temps, top_ps = np.zeros(n, np.float32), np.ones(n, np.float32)
        top_ks, min_ps = np.zeros(n, np.int32), np.zeros(n, np.float32)
        token_index = np.zeros(n, np.int32)
        active = np.zeros(n, bool)
        for row in decode:
            active[row] = True
            slots[row] = self.running[row].slot
            token_index[row] = len(self.running[row].out) + (row in sampled)
        for row, r in sampling:
            seeds[row], temps[row], top_ps[row], top_ks[row], min_ps[row] = (r.seed, r.temperature, r.top_p,
                                                                            r.top_k, r.min_p)
        asked = ([r.logprobs for _, r in sampling if r.logprobs is not None]
                 + [r.prompt_logprobs for _, r, _, _ in pieces if r.prompt_logprobs is not None])
        width = top_width(max(asked)) if asked else 0
        # [R, 1]: the step in flight's tokens on the device (but resumed rows': from the host), else the host's,
        # placed as those would be.
        if self.in_flight is None:
            last = self.runner.like_step_outputs(self.last_token[:, None])
        elif self._resumed:
            last = self.runner.merge_tokens(self.in_flight.tokens, self.last_token[:, None],
                                            np.isin(np.arange(n), self._resumed))
        else:
            last = self.in_flight.tokens
        self._resumed = []
        decode_group = Group(last, np.where(active, self.position, 0)[:, None], active[:, None],
                             tables=self.tables.copy())
        prefill = prefill_last = prefill_next = None
        if pieces:
            prefill, prefill_slots, prefill_last, prefill_next = self._pack(pieces)
            slots = np.concatenate([slots, prefill_slots.reshape(-1)])
        settings = Sampling(seeds, token_index, temps, top_ps, top_ks, min_ps)
        return Step(decode_group, prefill, slots, self.runner.pool.ranks.copy(), settings, prefill_last,
                    prefill_next if width else None, self._penalties(sampling), filtered=settings.filtered(),
                    logprobs=width)

    def _penalties(self, sampling: list[tuple[int, Request]]) -> Penalties | None:
        """The step's `Penalties` when one of the requests it samples for asks for a penalty, else None. Then
        the device's history first takes the tokens of the rows placed since it was last written (a resumed
        request's generated ones too): every later token of a request with penalties is the decode token of a
        step with penalties, which writes it there (`apply_penalties`); the rows of other requests go
        unread."""
        penalized = [(row, r) for row, r in sampling if r.penalized]
        if not penalized:
            return None
        placed = sorted(row for row in self._rows_to_write if self.running[row] is not None)
        if placed or self.history is None:
            values = np.full((len(placed), self.max_seq), -1, HISTORY_DTYPE)
            for i, row in enumerate(placed):
                tokens = self.running[row].prompt + self.running[row].out
                values[i, : len(tokens)] = tokens
            self.history = self.runner.write_history(self.history, (self.num_rows, self.max_seq), placed, values)
            self._rows_to_write.clear()
        n = self.num_rows
        prompt_len, rep = np.zeros(n, np.int32), np.ones(n, np.float32)
        freq, pres = np.zeros(n, np.float32), np.zeros(n, np.float32)
        for row, r in penalized:
            prompt_len[row], rep[row] = len(r.prompt), r.repetition_penalty
            freq[row], pres[row] = r.frequency_penalty, r.presence_penalty
        return Penalties(prompt_len, rep, freq, pres)

    def _pack(self, pieces: list[tuple[int, Request, int, int]]) -> tuple[Group, np.ndarray, np.ndarray, np.ndarray]:
        """The prompt pieces as a padded group [Bp, Sp] (padding requests: slot -1, no valid token, so no cache
        write; row 0) with the first blocks of their rows' tables, as many as the longest piece's end needs (in
        a power-of-two bucket: the attention reads only those), their slots [Bp, Sp], each piece's
        `prefill_last` [Bp] and the prompt token each piece token predicts [Bp, Sp] (-1: none)."""
        tokens, positions, slots, valid = pack_prompts(
            [r.prompt[start: start + length] for _, r, start, length in pieces], [r.slot for _, r, _, _ in pieces],
            [start for _, _, start, _ in pieces])
        rows, last = np.zeros(len(tokens), np.int32), np.full(len(tokens), -1, np.int32)
        following = np.full(tokens.shape, -1, np.int32)
        for i, (row, r, start, length) in enumerate(pieces):
            rows[i] = row
            last[i] = length - 1 if start + length == len(r.prompt) and r.max_new > 0 else -1
            after = r.prompt[start + 1: start + length + 1]
            following[i, : len(after)] = after
        blocks = bucket(max(self.blocks.blocks_for(start + length) for _, _, start, length in pieces))
        return Group(tokens, positions, valid, rows, self.tables[rows, :blocks]), slots, last, following


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched step, read by `Batcher._collect`: its tokens [R, 1] on the device, the (row, request) pairs it
    samples for, its prompt pieces (row, request, start, length), packed `piece_width` tokens apart, and its
    log-probabilities (None: not asked for)."""

    tokens: object
    sampling: list[tuple[int, Request]]
    pieces: list[tuple[int, Request, int, int]]
    piece_width: int
    logprobs: StepLogprobs | None


@dataclasses.dataclass(frozen=True)
class _Swapped:
    """A preempted request's blocks (a `KVCache` of host arrays, [n, KV, P, D] per layer), its position and when
    it was admitted."""

    blocks: object
    position: int
    admitted: int
