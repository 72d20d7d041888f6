"""Log-probabilities, scoring and n samples on a tiny model: three independent paths must agree (the logits of
`prefill_logits`, the decode step's log-probabilities of what it sampled, the prefill step's of prompt tokens),
in mixed batches of adapters, through chunked prompts and rows that refill. HF+PEFT's own numbers are checked
in tests/models/test_peft_fixtures.py."""

import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine
from jlora.sampling import sample_seeds
from jlora.scheduler import Batcher, Request
from tests.batching import drive

CFG = testing.tiny_config("llama")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    testing.write_model(str(root / "m"), CFG, seed=3)
    eng = Engine.from_pretrained(str(root / "m"), max_loras=2, max_lora_rank=16, dtype="float32", max_batch=4,
                                 max_seq_len=96, prefill_chunk=16, progress=False)
    for i, (r, targets) in enumerate([(8, ["q_proj", "v_proj"]), (16, LINEAR_MODULES)]):
        testing.write_adapter(str(root / f"a{i}"), CFG, r=r, alpha=2 * r, seed=i, target_modules=targets)
        eng.register_adapter(f"a{i}", str(root / f"a{i}"))
    return eng


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def cases(seed: int, n: int, vocab: int):
    """n random (prompt, continuation, adapter): lengths 1-40 (past the 16-token prefill chunk), any adapter."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 41))).tolist()
        cont = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        out.append((prompt, cont, [None, "a0", "a1"][int(rng.integers(0, 3))]))
    return out


def test_scores_are_the_log_softmax_of_the_logits(engine):
    """Scores of a mixed batch (4 rows for 10 requests, chunked prompts) against `prefill_logits` of each
    request alone: another compiled path, one request per call."""
    batch = cases(0, 10, CFG["vocab_size"])
    scores = engine.score([p for p, _, _ in batch], [c for _, c, _ in batch], [a for _, _, a in batch])
    for (prompt, cont, adapter), score in zip(batch, scores):
        lp = log_softmax(engine.prefill_logits([prompt + cont], [adapter])[0])
        want = [lp[len(prompt) - 1 + j, t] for j, t in enumerate(cont)]
        np.testing.assert_allclose(score.token_logprobs, want, atol=2e-5)
        assert score.logprob == pytest.approx(sum(want), abs=1e-4)
        greedy = all(lp[len(prompt) - 1 + j].argmax() == t for j, t in enumerate(cont))
        assert score.is_greedy == greedy


def test_generated_logprobs_are_what_scoring_the_output_gives(engine):
    """The decode step's log-probabilities of what it sampled (temperature 1, so not the argmax) equal the
    prefill step's of the same tokens scored after the prompt; the top-k are the k largest, in order."""
    batch = cases(1, 6, CFG["vocab_size"])
    prompts, adapters = [p for p, _, _ in batch], [a for _, _, a in batch]
    out = engine.generate(prompts, adapters, max_new_tokens=8, temperature=1.0, seed=11, logprobs=5)
    scores = engine.score(prompts, [list(o) for o in out], adapters)
    for (prompt, _, adapter), gen, score in zip(batch, out, scores):
        assert [t.token for t in gen.logprobs] == list(gen)
        np.testing.assert_allclose([t.logprob for t in gen.logprobs], score.token_logprobs, atol=2e-5)
        lp = log_softmax(engine.prefill_logits([prompt + list(gen)], [adapter])[0])
        for j, t in enumerate(gen.logprobs):
            row = lp[len(prompt) - 1 + j]
            assert [i for i, _ in t.top] == list(np.argsort(-row, kind="stable")[:5])
            np.testing.assert_allclose([v for _, v in t.top], np.sort(row)[::-1][:5], atol=2e-5)
    assert not all(s.is_greedy for s in scores)  # sampled, so some token is not the argmax


def test_asking_for_logprobs_changes_no_token(engine):
    """A request's tokens are the same with or without log-probabilities, beside requests that ask or not."""
    batch = cases(2, 6, CFG["vocab_size"])
    prompts, adapters = [p for p, _, _ in batch], [a for _, _, a in batch]
    plain = engine.generate(prompts, adapters, max_new_tokens=6, temperature=0.8, seed=3)
    asked = engine.generate(prompts, adapters, max_new_tokens=6, temperature=0.8, seed=3, logprobs=0)
    assert [list(o) for o in plain] == [list(o) for o in asked]
    assert all(g.logprobs is None for g in plain) and all(len(g.logprobs) == len(g) for g in asked)
    first = list(asked[0]).index(asked[0][2])  # the first of the stop token
    stopped = engine.generate(prompts[:1], adapters[:1], max_new_tokens=6, temperature=0.8, seed=3, logprobs=0,
                              stop_token_ids=[asked[0][2]])[0]
    assert stopped.finish_reason == "stop" and list(stopped) == list(asked[0][:first])
    want = asked[0].logprobs[:first + 1]  # the stop token's last
    assert [t.token for t in stopped.logprobs] == [t.token for t in want]
    np.testing.assert_allclose([t.logprob for t in stopped.logprobs], [t.logprob for t in want], atol=2e-5)
    assert all(t.top == () for g in asked for t in g.logprobs)


def test_n_samples_are_their_seeds_run_alone(engine, monkeypatch):
    """Samples 1 and 2 of each prompt copy sample 0's cache blocks (a prompt of 40 tokens goes in over 3 steps
    first); each equals the request run alone with its seed."""
    copies = []
    copy_blocks = engine.runner.copy_blocks
    monkeypatch.setattr(engine.runner, "copy_blocks", lambda cache, sources, targets: copies.append(targets)
                        or copy_blocks(cache, sources, targets))
    prompts, adapters = [[3, 1, 4, 1, 5], list(range(2, 42))], ["a1", None]
    out = engine.generate(prompts, adapters, max_new_tokens=6, temperature=1.0, seed=[7, 8], n=3)
    assert len(out) == 6 and len(copies) == 4
    monkeypatch.undo()
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        for j, s in enumerate(sample_seeds(7 + i, 3)):
            alone = engine.generate([prompt], [adapter], max_new_tokens=6, temperature=1.0, seed=s)[0]
            assert list(out[3 * i + j]) == list(alone), (i, j)
        assert len({tuple(o) for o in out[3 * i: 3 * i + 3]}) > 1  # the samples differ
    first = engine.generate(prompts, adapters, max_new_tokens=6, temperature=1.0, seed=[7, 8])
    assert [list(o) for o in first] == [list(out[0]), list(out[3])]  # n=1 is sample 0


def test_a_fork_whose_source_has_ended_prefills_itself(engine):
    """One row: the fork waits for it; by then its source has ended and the row may hold anything."""
    prompt = [4, 8, 15, 16, 23, 42]
    alone = list(engine.generate([prompt], ["a0"], max_new_tokens=4, temperature=1.0, seed=99)[0])
    engine.pool.hold(["a0"])  # written into a slot by the call above
    try:
        slot = engine.pool.slot("a0")
        batcher = Batcher(engine.runner, 1, 32)
        source = Request(prompt, slot, 2, 1.0, seed=5)
        fork = Request(prompt, slot, 4, 1.0, seed=99, fork_of=source)
        batcher.add(source)
        batcher.add(fork)
        while batcher.busy:
            batcher.step()
    finally:
        engine.pool.release(["a0"])
    assert len(source.out) == 2 and fork.out == alone
    with pytest.raises(ValueError, match="a fork has its source's prompt"):
        batcher.add(Request(prompt[:-1], -1, 1, fork_of=source))


def test_scoring_requests_beside_generation_in_one_batcher(engine):
    """A scoring request (max_new 0) and generating ones share steps; it ends once its prompt is in, with a
    log-probability for every prompt token but the first, and no token; the others are unaffected."""
    prompt = list(range(1, 40))
    want = engine.score([prompt[:1]], [prompt[1:]], [None])[0].token_logprobs
    alone = list(engine.generate([[5, 6, 7]], [None], max_new_tokens=10)[0])
    batcher = Batcher(engine.runner, 4, 64, prefill_chunk=16)
    gen = Request([5, 6, 7], -1, 10)
    score = Request(prompt, -1, 0, prompt_logprobs=2)
    batcher.add(gen)
    batcher.add(score)
    while batcher.busy:
        batcher.step()
    assert score.finish == "length" and score.out == [] and score.prompt_out_logprobs[0] is None
    assert [t.token for t in score.prompt_out_logprobs[1:]] == prompt[1:]
    np.testing.assert_allclose([t.logprob for t in score.prompt_out_logprobs[1:]], want, atol=2e-5)
    assert all(len(t.top) == 2 for t in score.prompt_out_logprobs[1:])
    assert gen.out == alone


@pytest.mark.parametrize("call, match", [
    (lambda e: e.generate([[1]], [None], 2, logprobs=21), "logprobs must be None or an integer in"),
    (lambda e: e.generate([[1]], [None], 2, logprobs=-1), "logprobs must be None or an integer in"),
    (lambda e: e.generate([[1]], [None], 2, n=0), "n must be an integer >= 1"),
    (lambda e: e.score([[1]], [[]], [None]), r"continuation\(s\) \[0\] are empty"),
    (lambda e: e.score([[]], [[1]], [None]), r"prompt\(s\) \[0\] are empty: a continuation's first token"),
    (lambda e: e.score([[1]], [[2.5]], [None]), r"continuation 0 holds token ids that are not integers: \[2.5\]"),
    (lambda e: e.score([[1]], [[2], [3]], [None]), "1 prompts but 2 continuations"),
    (lambda e: e.score([[1] * 90], [[2] * 10], [None]),
     r"^prompt \+ continuation 0 has 100 tokens; it exceeds max_seq_len="),
    (lambda e: e.score([[1], [1]], [[2], [10**6]], [None, "a0"]),
     r"^prompt \+ continuation 1 has token ids outside \[0, \d+\) \(its adapter's vocabulary\): \[1000000\]"),
    (lambda e: e.generate([[1] * 90], [None], 20), r"^prompt 0 has 90 tokens; with max_new_tokens=20 it exceeds"),
])
def test_bad_calls_name_the_problem(engine, call, match):
    with pytest.raises((ValueError, KeyError), match=match):
        call(engine)


def test_a_scoring_request_needs_prompt_logprobs(engine):
    batcher = Batcher(engine.runner, 2, 32)
    with pytest.raises(ValueError, match="max_new must be >= 1"):
        batcher.add(Request([1, 2], -1, 0))


KS = (0, 1, 3, 7, 20)  # alternatives asked: every `top_width` bucket, and its edges


def clone(r: Request) -> Request:
    """A fresh copy of a request's settings, no fork: what it is run alone."""
    return Request(r.prompt, r.slot, r.max_new, r.temperature, r.top_p, r.seed, r.stop, logprobs=r.logprobs,
                   prompt_logprobs=r.prompt_logprobs)


def run_batcher(engine, requests, arrivals=None, cancels=(), blocks=(None, None)) -> None:
    """`drive`s requests in a 4-row batcher; blocks: (block size, number of blocks) of its cache (default:
    contiguous)."""
    drive(Batcher(engine.runner, 4, 96, prefill_chunk=16, block_size=blocks[0], num_blocks=blocks[1]), requests,
          arrivals, cancels)


@pytest.mark.parametrize("seed", range(3))
def test_a_random_mix_matches_each_request_alone(engine, seed):
    """Generation with and without log-probabilities, scoring requests and forks of other requests, over the
    base model and two adapters, arriving over time into 4 rows, some cancelled: each request that was not
    cancelled gets the tokens it gets alone, and log-probabilities (and the k alternatives it asks for, the k
    of one step's requests falling in different `top_width`s) within 2e-5 of its own run alone, over a
    contiguous cache, a paged one, and a paged one too small for all four rows."""
    rng = np.random.default_rng(seed)
    names = ["a0", "a1"]
    engine._make_resident(names)
    engine.pool.hold(names)
    try:
        slots = [-1] + [engine.pool.slot(a) for a in names]
        requests = []
        for _ in range(14):
            kind = rng.choice(["gen", "logprobs", "score", "fork"])
            sources = [r for r in requests if r.max_new > 0 and r.fork_of is None]
            if kind == "fork" and sources:
                source = sources[int(rng.integers(len(sources)))]
                requests.append(Request(source.prompt, source.slot, int(rng.integers(1, 8)), 0.9,
                                        seed=int(rng.integers(2**31)), logprobs=int(rng.choice(KS)),
                                        fork_of=source))
                continue
            prompt = rng.integers(0, CFG["vocab_size"], int(rng.integers(1, 41))).tolist()
            slot = int(rng.choice(slots))
            if kind == "score":
                requests.append(Request(prompt, slot, 0, prompt_logprobs=int(rng.choice(KS[1:]))))
            else:
                requests.append(Request(prompt, slot, int(rng.integers(1, 9)), float(rng.choice([0.0, 0.9])),
                                        seed=int(rng.integers(2**31)),
                                        logprobs=int(rng.choice(KS)) if kind == "logprobs" else None))
        arrivals = sorted(int(a) for a in rng.integers(0, 12, len(requests)))
        arrivals = [max(a, arrivals[requests.index(r.fork_of)]) if r.fork_of else a  # a fork after its source
                    for r, a in zip(requests, arrivals)]
        cancelled = [requests[int(i)] for i in rng.choice(len(requests), 2, replace=False)]
        blocks = [(None, None), (16, None), (16, 9)][seed]  # contiguous; paged; paged, requests wait for blocks
        run_batcher(engine, requests, arrivals, [(r, int(rng.integers(0, 15))) for r in cancelled], blocks)
        for r in requests:
            if r.finish == "cancelled":
                continue
            assert all(len(t.top) == r.logprobs for t in r.out_logprobs)
            assert all(len(t.top) == r.prompt_logprobs for t in r.prompt_out_logprobs if t)
            alone = clone(r)
            run_batcher(engine, [alone])
            assert r.out == alone.out and r.finish == alone.finish, r
            for got, want in ((r.out_logprobs, alone.out_logprobs), (r.prompt_out_logprobs, alone.prompt_out_logprobs)):
                assert [None if t is None else t.token for t in got] == [None if t is None else t.token for t in want]
                np.testing.assert_allclose([t.logprob for t in got if t], [t.logprob for t in want if t], atol=2e-5)
                assert [[i for i, _ in t.top] for t in got if t] == [[i for i, _ in t.top] for t in want if t]
                np.testing.assert_allclose([v for t in got if t for _, v in t.top],
                                           [v for t in want if t for _, v in t.top], atol=2e-5)
    finally:
        engine.pool.release(names)
