"""Preemption in the paged batcher: requests grow into blocks as they decode, and when the blocks run out the
request admitted last is preempted (its blocks copied to host memory, or its prompt started again) and later
resumed; every request still generates exactly what it generates alone, and no block leaks."""

import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine
from jlora.runner import bucket
from jlora.scheduler import Batcher, Request
from tests.batching import drive, penalties_of, random_penalties

CFG = testing.tiny_config("llama")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    testing.write_model(str(root / "m"), CFG, seed=4)
    eng = Engine.from_pretrained(str(root / "m"), max_loras=2, max_lora_rank=8, dtype="float32", progress=False)
    testing.write_adapter(str(root / "a"), CFG, r=8, alpha=16, seed=40, target_modules=LINEAR_MODULES)
    eng.load_adapter("a", str(root / "a"))
    return eng


def alone(engine, r: Request) -> Request:
    """r run alone on a contiguous cache."""
    copy = Request(r.prompt, r.slot, r.max_new, r.temperature, r.top_p, r.seed, r.stop, logprobs=r.logprobs,
                   prompt_logprobs=r.prompt_logprobs, **penalties_of(r))
    drive(Batcher(engine.runner, 1, bucket(len(r.prompt) + r.max_new, 16)), [copy])
    return copy


def check_alone(engine, requests: list[Request]) -> None:
    for r in requests:
        if r.finish == "cancelled":
            continue
        want = alone(engine, r)
        assert (r.out, r.finish) == (want.out, want.finish), r
        np.testing.assert_allclose([t.logprob for t in r.out_logprobs], [t.logprob for t in want.out_logprobs],
                                   atol=2e-5)
        got = [t.logprob for t in r.prompt_out_logprobs if t]
        np.testing.assert_allclose(got, [t.logprob for t in want.prompt_out_logprobs if t], atol=2e-5)


def check_no_leak(batcher: Batcher) -> None:
    assert not batcher.busy and not batcher._swapped
    assert batcher.blocks.num_available == batcher.blocks.num_blocks
    assert not any(batcher.blocks.refs)


def test_a_request_that_runs_out_of_blocks_preempts_the_last_admitted_and_both_match_alone(engine):
    """Two requests of 10 prompt tokens and 30 new grow to 3 blocks each in a pool of 4: the second is
    preempted (past its prompt: its blocks go to host memory) and resumes after the first ends."""
    slot = engine.pool.slot("a")
    requests = [Request(list(range(1, 11)), slot, 30, 0.9, seed=1), Request(list(range(5, 15)), -1, 30, seed=2)]
    batcher, preempted = Batcher(engine.runner, 2, 64, block_size=16, num_blocks=4), []
    append = batcher.waiting.append  # a preempted request goes back to the head of the queue
    batcher.waiting.append = lambda r, at_head=False: (at_head and preempted.append(r)) or append(r, at_head)
    drive(batcher, requests)
    assert batcher.preemptions >= 1 and preempted == [requests[1]] * batcher.preemptions
    check_alone(engine, requests)
    check_no_leak(batcher)


def test_steps_with_penalties_keep_the_history_on_the_device(engine, monkeypatch):
    """The first test's requests with penalties: the token history they count goes from the host to the device
    once per row a request takes (the resumed request's generated tokens with its prompt), not with every step;
    each step writes its decode tokens there itself, and both requests still match alone."""
    slot, penalties = engine.pool.slot("a"), dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=-0.3)
    requests = [Request(list(range(1, 11)), slot, 30, 0.9, seed=1, **penalties),
                Request(list(range(5, 15)), -1, 30, seed=2, **penalties)]
    written, steps = [], []
    write, step = engine.runner.write_history, engine.runner.step
    monkeypatch.setattr(engine.runner, "write_history", lambda *args: written.extend(args[2]) or write(*args))
    monkeypatch.setattr(engine.runner, "step", lambda *args: steps.append(args[0].penalties) or step(*args))
    batcher = drive(Batcher(engine.runner, 2, 64, block_size=16, num_blocks=4), requests)
    assert batcher.preemptions >= 1 and len(written) == len(requests) + batcher.preemptions
    assert all(p is not None for p in steps) and len(steps) > 30
    check_alone(engine, requests)
    check_no_leak(batcher)


def test_a_row_taken_in_turn_by_requests_with_and_without_penalties_counts_only_its_own_tokens(engine):
    """One row of one batcher, taken in turn by a request without penalties (the device history is not made
    yet), then by requests with them, a long one before a short one: each counts only its own tokens, as
    alone."""
    penalties = dict(repetition_penalty=1.8, frequency_penalty=1.0, presence_penalty=0.7)
    batcher = Batcher(engine.runner, 1, 64, block_size=16)
    for r in [Request(list(range(1, 30)), -1, 20), Request([5, 6, 7], -1, 10, **penalties),
              Request(list(range(40, 70)), -1, 30, **penalties), Request([9, 9], -1, 12, **penalties)]:
        drive(batcher, [r])
        check_alone(engine, [r])
    check_no_leak(batcher)


def test_a_request_cancelled_while_preempted_frees_its_host_copy(engine):
    """The preempted request of the first test is cancelled while its blocks are in host memory (a client that
    disconnects then): it never resumes, its host copy is dropped, and the other still matches alone."""
    slot = engine.pool.slot("a")
    requests = [Request(list(range(1, 11)), slot, 30, 0.9, seed=1), Request(list(range(5, 15)), -1, 30, seed=2)]
    batcher = Batcher(engine.runner, 2, 64, block_size=16, num_blocks=4)
    for r in requests:
        batcher.add(r)
    while not batcher._swapped:
        batcher.step()
    swapped = next(iter(batcher._swapped))
    out = list(swapped.out)
    batcher.cancel(swapped)
    while batcher.busy:
        batcher.step()
    assert swapped.finish == "cancelled" and swapped.out == out
    check_alone(engine, [r for r in requests if r is not swapped])
    check_no_leak(batcher)


def test_a_request_preempted_while_its_prompt_goes_in_starts_it_again(engine):
    """Three rows decode while a 480-token prompt is scored 16 tokens a step; the blocks the three take as they
    grow run out before it is in, so it is preempted (the last admitted), starts again once they end, and
    scores each prompt token once, as alone."""
    requests = [Request(list(range(i, i + 17)), -1, 60) for i in range(3)]
    requests.append(Request([i % 90 for i in range(480)], -1, 0, prompt_logprobs=1))
    batcher = drive(Batcher(engine.runner, 4, 512, prefill_chunk=16, block_size=16, num_blocks=39), requests,
                    [0, 0, 0, 3])
    assert batcher.preemptions == 1 and len(requests[3].prompt_out_logprobs) == 480
    check_alone(engine, requests)
    check_no_leak(batcher)


@pytest.mark.parametrize("seed", range(3))
def test_random_mixes_in_a_tiny_pool_match_each_request_alone(engine, seed):
    """Generation (greedy and sampled, with log-probabilities, some with penalties), scoring, forks and requests
    sharing prompt prefixes (with prefix caching), under the base model and an adapter, arriving over time into 4
    rows over 6 blocks of 16 positions (less than two requests at their longest), some cancelled: every request
    preempts or is preempted, and each that was not cancelled gets its own tokens and log-probabilities alone."""
    rng = np.random.default_rng(seed)
    slots, system = [-1, engine.pool.slot("a")], rng.integers(0, CFG["vocab_size"], 20).tolist()
    requests = []
    for _ in range(12):
        kind = rng.choice(["gen", "logprobs", "score", "fork", "shared"])
        sources = [r for r in requests if r.max_new > 0 and r.fork_of is None]
        if kind == "fork" and sources:
            source = sources[int(rng.integers(len(sources)))]
            requests.append(Request(source.prompt, source.slot, int(rng.integers(1, 40)), 0.9,
                                    seed=int(rng.integers(2**31)), prefix_id=source.prefix_id, fork_of=source,
                                    **random_penalties(rng)))
            continue
        slot = int(rng.choice(slots))
        prompt = rng.integers(0, CFG["vocab_size"], int(rng.integers(1, 40))).tolist()
        if kind == "shared":
            prompt = system + prompt[:10]
        if kind == "score":
            requests.append(Request(prompt, slot, 0, prompt_logprobs=2))
            continue
        requests.append(Request(prompt, slot, int(rng.integers(8, 50)), float(rng.choice([0.0, 0.9])),
                                seed=int(rng.integers(2**31)), logprobs=2 if kind == "logprobs" else None,
                                prefix_id=str(slot), **random_penalties(rng)))
    arrivals = sorted(int(a) for a in rng.integers(0, 40, len(requests)))
    arrivals = [max(a, arrivals[requests.index(r.fork_of)]) if r.fork_of else a for r, a in zip(requests, arrivals)]
    cancels = tuple((requests[int(i)], int(rng.integers(0, 80))) for i in rng.choice(len(requests), 2, replace=False))
    batcher = Batcher(engine.runner, 4, 96, prefill_chunk=16, block_size=16, num_blocks=6, prefix_caching=True)
    drive(batcher, requests, arrivals, cancels)
    assert batcher.preemptions > 0
    check_alone(engine, requests)
    check_no_leak(batcher)
