"""Prefix caching in the batcher: requests that share prompt prefixes under the same adapter registration reuse
the cached blocks and still generate exactly what they generate alone; nothing is shared across adapters,
across registrations of one name, or into a request that scores its prompt."""

import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine
from jlora.scheduler import Batcher, Request
from tests.batching import drive, penalties_of, random_penalties

CFG = testing.tiny_config("llama")
SIZE = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    testing.write_model(str(root / "m"), CFG, seed=2)
    eng = Engine.from_pretrained(str(root / "m"), max_loras=2, max_lora_rank=8, dtype="float32", progress=False)
    for i in range(2):
        testing.write_adapter(str(root / f"a{i}"), CFG, r=8, alpha=16, seed=30 + i, target_modules=LINEAR_MODULES)
        eng.load_adapter(f"a{i}", str(root / f"a{i}"))
    return eng


def run(engine, requests, arrivals=None, cancels=(), caching=True, blocks=None) -> Batcher:
    """`drive`s requests in a 4-row batcher over a paged cache of `blocks` 16-position blocks."""
    batcher = Batcher(engine.runner, 4, 96, prefill_chunk=32, block_size=SIZE, num_blocks=blocks,
                      prefix_caching=caching)
    return drive(batcher, requests, arrivals, cancels)


def alone(engine, r: Request) -> Request:
    """r run alone on a contiguous cache without prefix caching."""
    copy = Request(r.prompt, r.slot, r.max_new, r.temperature, r.top_p, r.seed, r.stop,
                   prompt_logprobs=r.prompt_logprobs, **penalties_of(r))
    batcher = Batcher(engine.runner, 1, 96)
    batcher.add(copy)
    while batcher.busy:
        batcher.step()
    return copy


@pytest.mark.parametrize("seed", range(3))
def test_shared_prefixes_reuse_blocks_and_match_each_request_alone(engine, seed):
    """Requests over three system prompts (17-50 tokens) with their own suffixes, under the base model and two
    adapters (and the same adapter's slot under a second registration), and forks of some (other samples of
    the same prompt), arriving over time, some cancelled, some with penalties (over prompt tokens the cache
    skipped), in a pool small enough to evict: each equals itself alone, and cached tokens were reused."""
    rng = np.random.default_rng(seed)
    slots = {"base": -1, "a0@1": engine.pool.slot("a0"), "a1@2": engine.pool.slot("a1"),
             "a0@3": engine.pool.slot("a1")}  # a0 registered again, with a1's weights: must not hit a0@1's blocks
    systems = [rng.integers(0, CFG["vocab_size"], int(rng.integers(17, 51))).tolist() for _ in range(3)]
    requests = []
    for _ in range(16):
        sources = [r for r in requests if r.fork_of is None]
        if sources and rng.random() < 0.25:  # another sample of an earlier request: shares its prompt's blocks
            source = sources[int(rng.integers(len(sources)))]
            requests.append(Request(source.prompt, source.slot, int(rng.integers(1, 8)), 0.9,
                                    seed=int(rng.integers(2**31)), prefix_id=source.prefix_id, fork_of=source))
            continue
        ident = list(slots)[int(rng.integers(len(slots)))]
        prompt = systems[int(rng.integers(3))] + rng.integers(0, CFG["vocab_size"], int(rng.integers(0, 20))).tolist()
        requests.append(Request(prompt, slots[ident], int(rng.integers(1, 8)), float(rng.choice([0.0, 0.9])),
                                seed=int(rng.integers(2**31)), prefix_id=ident, **random_penalties(rng)))
    arrivals = sorted(int(a) for a in rng.integers(0, 30, len(requests)))
    arrivals = [max(a, arrivals[requests.index(r.fork_of)]) if r.fork_of else a  # a fork after its source
                for r, a in zip(requests, arrivals)]
    cancelled = [(requests[int(i)], int(rng.integers(0, 30))) for i in rng.choice(len(requests), 2, replace=False)]
    batcher = run(engine, requests, arrivals, cancelled, blocks=16)
    assert batcher.blocks.stats.hit_tokens > 0 and batcher.blocks.stats.evicted_blocks >= 0
    for r in requests:
        if r.finish != "cancelled":
            want = alone(engine, r)
            assert (r.out, r.finish) == (want.out, want.finish), r


def test_a_new_registration_never_reuses_the_old_ones_blocks(engine):
    """The same prompt under one slot but two prefix ids (an adapter reloaded under its name): the second
    prefills every token; under the same id it reuses the first's full blocks."""
    prompt = list(range(1, 49))  # 3 full blocks, 2 of them reusable (the last prompt token is always computed)
    slot = engine.pool.slot("a0")
    first = [Request(prompt, slot, 4, prefix_id="a0@1")]
    batcher = run(engine, first)
    hits = batcher.blocks.stats.hit_tokens
    for ident, reused in (("a0@2", 0), ("a0@1", 2 * SIZE)):
        r = Request(prompt, slot, 4, prefix_id=ident)
        batcher.add(r)
        while batcher.busy:
            batcher.step()
        assert batcher.blocks.stats.hit_tokens - hits == reused
        hits = batcher.blocks.stats.hit_tokens
        assert r.out == first[0].out


def test_a_cache_salt_shares_blocks_only_within_its_salt(engine):
    """vLLM's cache_salt: the same prompt under one adapter, salted "t1" first; another salt, or none, prefills
    every token; "t1" again reuses the first's full blocks. Each generates what the first did."""
    prompt = list(range(1, 49))  # 3 full blocks, 2 of them reusable (the last prompt token is always computed)
    first = [Request(prompt, -1, 4, prefix_id="base", cache_salt="t1")]
    batcher = run(engine, first)
    hits = batcher.blocks.stats.hit_tokens
    for salt, reused in (("t2", 0), (None, 0), ("t1\0", 0), ("t1", 2 * SIZE), (None, 2 * SIZE)):
        r = Request(prompt, -1, 4, prefix_id="base", cache_salt=salt)
        batcher.add(r)
        while batcher.busy:
            batcher.step()
        assert batcher.blocks.stats.hit_tokens - hits == reused, salt
        hits = batcher.blocks.stats.hit_tokens
        assert r.out == first[0].out


def test_scoring_requests_compute_every_prompt_token(engine):
    prompt = list(range(3, 60))
    batcher = run(engine, [Request(prompt, -1, 3, prefix_id="base")])
    score = Request(prompt, -1, 0, prompt_logprobs=1, prefix_id="base")
    batcher.add(score)
    while batcher.busy:
        batcher.step()
    want = alone(engine, Request(prompt, -1, 0, prompt_logprobs=1))
    assert len(score.prompt_out_logprobs) == len(prompt)
    np.testing.assert_allclose([t.logprob for t in score.prompt_out_logprobs[1:]],
                               [t.logprob for t in want.prompt_out_logprobs[1:]], atol=2e-5)


def test_admission_keys_requests_by_registration(engine, tmp_path):
    """`Admission` names each request's prefix by its adapter's registration: the same name loaded again gets
    a new one."""
    from jlora.admission import Admission

    def admitted(adapter):
        admission = Admission(engine.pool, engine.registry, engine.tiers, engine.loader, wake=lambda: None)
        request, seen = Request([1, 2, 3], -1, 1), []
        admission.submit(request, adapter)
        admission.poll(seen.append)
        assert seen == [request]
        request.finish = "length"
        request._notify()  # releases its adapter hold
        return request.prefix_id

    before, base = admitted("a0"), admitted(None)
    testing.write_adapter(str(tmp_path / "x"), CFG, r=8, alpha=16, seed=99, target_modules=["q_proj"])
    engine.unload_adapter("a0")
    engine.load_adapter("a0", str(tmp_path / "x"))
    after = admitted("a0")
    assert base == "base" and before.startswith("adapter-") and after.startswith("adapter-") and before != after
