"""Batch invariance: every request generates what it generates alone, whatever else is in the batch (in float32,
where a step's shape moves only the last bits of its numbers: docs/design.md, § What a request's bits depend on).

A seeded generator draws rounds of `generate` calls on one engine: `max_batch` in {1, 2, 3, 4, 8}, 1 to
max_batch + 3 requests (so batches are full, partly filled and refilled), prompt lengths from 1 to what
max_seq_len allows, any mix of adapters (several requests per adapter) and base-model requests, stop tokens,
greedy and sampled requests (with or without top-p, top-k and min-p), adapters unloaded and loaded between
rounds (so they change slots), prompts prefilled in pieces of 16 to 64 tokens or whole, beside rows that
decode, over a contiguous cache or a paged one, sometimes with fewer blocks than the rows could hold. Each
request must equal the same request run alone on the same engine, its prompt prefilled whole into a contiguous
cache, token for token (float32): greedy ones exactly, sampled ones too, since a request's key depends on its
seed and token index only.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine

CFG = testing.tiny_config("llama", vocab_size=83)  # a vocabulary no multiple of 16
MAX_SEQ = 32
ADAPTERS = {"a": (4, ["q_proj", "v_proj"], {}), "b": (16, LINEAR_MODULES, {"embeddings": True, "lm_head": True}),
            "c": (8, ["gate_proj", "down_proj", "o_proj"], {}), "d": (2, ["k_proj", "up_proj"], {})}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    testing.write_model(str(root / "m"), CFG, seed=11)
    for i, (name, (r, targets, kw)) in enumerate(ADAPTERS.items()):
        testing.write_adapter(str(root / name), CFG, r=r, alpha=2 * r, seed=20 + i, target_modules=targets, **kw)
    return root


def run_rounds(root, backend: str, rounds: int, seed: int) -> int:
    """Runs `rounds` random rounds on one engine with 3 slots for 4 adapters; returns the requests checked."""
    rng = np.random.default_rng(seed)
    engine = Engine.from_pretrained(str(root / "m"), max_loras=3, max_lora_rank=16, dtype="float32",
                                    backend=backend, max_seq_len=MAX_SEQ, progress=False)
    for name in ("a", "b", "c"):
        engine.load_adapter(name, str(root / name))
    checked = 0
    for _ in range(rounds):
        if rng.random() < 0.5:  # swap an adapter out: the others keep their slots, the new one takes the free one
            out = str(rng.choice(engine.adapters))
            engine.unload_adapter(out)
            new = str(rng.choice(sorted(set(ADAPTERS) - set(engine.adapters))))
            engine.load_adapter(new, str(root / new))
        max_batch = int(rng.choice([1, 2, 3, 4, 8]))
        n = int(rng.integers(1, max_batch + 4))
        max_new = int(rng.integers(1, 7))
        prompts = [rng.integers(0, CFG["vocab_size"], int(rng.integers(1, MAX_SEQ - max_new + 1))).tolist()
                   for _ in range(n)]
        names = engine.adapters + [None]
        adapters = [names[i] for i in rng.integers(0, len(names), n)]
        stop = rng.integers(0, CFG["vocab_size"], int(rng.integers(0, 4))).tolist()
        sampling = (dict(temperature=0.9, top_p=float(rng.choice([1.0, 0.8])), top_k=int(rng.choice([0, 3])),
                         min_p=float(rng.choice([0.0, 0.05]))) if rng.random() < 0.4 else {})
        if rng.random() < 0.3:
            sampling |= dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=-0.5)
        seeds = rng.integers(0, 2**32, n).tolist()
        chunk = int(rng.choice([16, 32, 64, 512]))
        # A paged cache of 16-position blocks, sometimes so few that requests wait for blocks to free.
        block_size, kv_blocks = (0, None) if rng.random() < 0.3 else (16, [None, 2, 3, 5][int(rng.integers(4))])
        engine.config = dataclasses.replace(engine.config, max_batch=max_batch, prefill_chunk=chunk,
                                            block_size=block_size, kv_blocks=kv_blocks)
        batched = engine.generate(prompts, adapters, max_new_tokens=max_new, stop_token_ids=stop, seed=seeds,
                                  **sampling)
        engine.config = dataclasses.replace(engine.config, prefill_chunk=512, block_size=0, kv_blocks=None)
        for i in range(n):
            (alone,) = engine.generate([prompts[i]], [adapters[i]], max_new_tokens=max_new, stop_token_ids=stop,
                                       seed=[seeds[i]], **sampling)
            context = (f"request {i} of {n} (max_batch {max_batch}, chunk {chunk}, blocks {block_size} x {kv_blocks}, "
                       f"adapter {adapters[i]}, "
                       f"{len(prompts[i])} prompt tokens, {sampling or 'greedy'})")
            assert list(batched[i]) == list(alone), context
            assert batched[i].finish_reason == alone.finish_reason, context
        checked += n
    return checked


BACKEND_ROUNDS = [("reference", 6), ("ragged", 3), ("pallas", 1)] + ([("auto", 10)] if jax.default_backend() == "gpu" else [])


@pytest.mark.slow
@pytest.mark.parametrize("backend,rounds", BACKEND_ROUNDS)
def test_every_request_generates_what_it_generates_alone(root, backend, rounds):
    assert run_rounds(root, backend, rounds, seed={"reference": 0, "ragged": 1, "pallas": 2, "auto": 3}[backend]) >= rounds


def test_an_int_seed_gives_request_i_the_seed_plus_i(root):
    engine = Engine.from_pretrained(str(root / "m"), dtype="float32", max_seq_len=MAX_SEQ, max_batch=2,
                                    progress=False)
    prompts = [[1, 2, 3], [4, 5], [6]]
    kw = dict(max_new_tokens=5, temperature=1.0)
    batched = engine.generate(prompts, [None] * 3, seed=40, **kw)
    for i, p in enumerate(prompts):
        assert list(batched[i]) == list(engine.generate([p], [None], seed=40 + i, **kw)[0])
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        engine.generate(prompts, [None] * 3, seed=[1, 2], **kw)
    with pytest.raises(ValueError, match=r"seeds must be in \[0, 2\*\*32\)"):
        engine.generate(prompts, [None] * 3, seed=[1, 2, -3], **kw)


def test_the_same_call_on_an_engine_in_the_same_state_gives_the_same_bits(root):
    """In bfloat16, where what shares a step moves a request's numbers (docs/design.md): the same call on two
    engines built alike, and again on one of them, gives the same tokens and log-probabilities bit for bit,
    over a paged cache so small that requests are preempted, prompts in pieces beside decoding rows."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, CFG["vocab_size"], int(n)).tolist() for n in (3, 20, 9, 18, 14, 5)]
    adapters = ["a", None, "b", "c", None, "a"]

    def engine(block_size):
        e = Engine.from_pretrained(str(root / "m"), max_loras=3, max_lora_rank=16, dtype="bfloat16",
                                   max_seq_len=MAX_SEQ, max_batch=4, prefill_chunk=16, block_size=block_size,
                                   kv_blocks=4 if block_size else None, progress=False)
        for name in ("a", "b", "c"):
            e.load_adapter(name, str(root / name))
        return e

    def bits(e):
        made, new_batcher = [], e.new_batcher  # the call's batcher, for its preemption count
        e.new_batcher = lambda *args: made.append(new_batcher(*args)) or made[-1]
        out = e.generate(prompts, adapters, max_new_tokens=12, logprobs=2, seed=3, temperature=0.7)
        return [(list(g), [(t.token, t.logprob, t.top) for t in g.logprobs]) for g in out], made[0].preemptions

    paged, preempted = bits(engine(16))
    assert preempted > 0  # the case meant: requests preempted and resumed
    assert bits(engine(16))[0] == paged
    contiguous = engine(0)  # no prefix cache: a second call runs the same steps again
    first = bits(contiguous)[0]
    assert bits(contiguous)[0] == first
