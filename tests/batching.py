"""Driving a `Batcher` through a scenario of arrivals and cancellations, for the tests that compare its requests
with each request run alone."""

from jlora.scheduler import Batcher, Request


def drive(batcher: Batcher, requests: list[Request], arrivals: list[int] | None = None,
          cancels: tuple[tuple[Request, int], ...] = ()) -> Batcher:
    """Steps `batcher` until it is idle, adding request i before step arrivals[i] (default: all before the first)
    and cancelling each (request, step) of `cancels` before that step when it has not ended."""
    arrivals = arrivals or [0] * len(requests)
    step = 0
    while step <= max(arrivals) or batcher.busy:
        for r, at in zip(requests, arrivals):
            if at == step:
                batcher.add(r)
        for r, at in cancels:
            if at == step and r.finish is None:
                batcher.cancel(r)
        if batcher.busy:
            batcher.step()
        step += 1
    return batcher


def penalties_of(r: Request) -> dict:
    """r's penalties, as `Request` keywords (for a copy of it)."""
    return dict(repetition_penalty=r.repetition_penalty, frequency_penalty=r.frequency_penalty,
                presence_penalty=r.presence_penalty)


def random_penalties(rng) -> dict:
    """No penalty (half the time), or random repetition, frequency and presence penalties, as `Request` keywords."""
    if rng.random() < 0.5:
        return {}
    return dict(repetition_penalty=float(rng.uniform(0.5, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                presence_penalty=float(rng.uniform(-2, 2)))
