"""Generation: greedy agreement with the logits, continuous batching, stops, sampling, compilations."""

import concurrent.futures
import dataclasses
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine
from jlora.models.loading import GenerationDefaults, generation_defaults, load_model
from jlora.runner import generate_step
from tests.batching import drive

CFG = testing.tiny_config("llama")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    testing.write_model(str(root / "m"), CFG, seed=7)
    eng = Engine.from_pretrained(str(root / "m"), max_loras=3, max_lora_rank=16, dtype="float32", max_batch=2,
                                 max_seq_len=64, progress=False)
    for i, (r, targets) in enumerate([(4, ["q_proj", "v_proj"]), (16, LINEAR_MODULES), (8, ["gate_proj", "down_proj"])]):
        testing.write_adapter(str(root / f"a{i}"), CFG, r=r, alpha=2 * r, seed=i, target_modules=targets)
        eng.load_adapter(f"a{i}", str(root / f"a{i}"))
    eng.root = root
    return eng


PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [18]]
ADAPTERS = ["a0", None, "a1", "a2", "a1"]


def test_greedy_generation_matches_logits_with_continuous_batching(engine):
    # max_batch=2 rows for 5 requests of different lengths: finished requests free rows for waiting ones.
    out = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=6)
    assert [len(o) for o in out] == [6] * 5 and all(o.finish_reason == "length" for o in out)
    for prompt, adapter, gen in zip(PROMPTS, ADAPTERS, out):
        logits = engine.prefill_logits([prompt + list(gen)], [adapter])[0]
        assert list(logits[len(prompt) - 1 : -1].argmax(-1)) == list(gen)
    # The adapters change the output: the same prompt without adapter generates differently.
    base = engine.generate(PROMPTS, [None] * 5, max_new_tokens=6)
    assert sum(list(a) != list(b) for a, b in zip(out, base)) >= 3
    # A batch of base requests only skips the LoRA ops; request 1 (no adapter) decoded among adapter requests
    # generates the same.
    assert list(base[1]) == list(out[1])


PENALTIES = [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6), dict(frequency_penalty=1.5),
             dict(presence_penalty=-1.0), dict(repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.9)]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_greedy_generation_with_penalties_takes_the_penalized_argmax(engine, penalties):
    """Each token is the argmax of the model's logits at its position (one prefill of prompt + generation) with
    the penalties applied by the float64 reference over the tokens before it (prompt and generated), through
    continuous batching (5 requests over 2 rows, pipelined steps, rows refilled); the penalties change the
    output."""
    from tests.test_sampling import penalized_reference
    from jlora.sampling import Penalties

    out = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=8, ignore_eos=True, **penalties)
    settings = [np.float32([penalties.get(k, d)]) for k, d in
                (("repetition_penalty", 1), ("frequency_penalty", 0), ("presence_penalty", 0))]
    for prompt, adapter, gen in zip(PROMPTS, ADAPTERS, out):
        logits = engine.prefill_logits([prompt + list(gen)], [adapter])[0]
        for t, token in enumerate(gen):
            seq = prompt + list(gen[:t])
            history = np.full((1, 64), -1, np.int32)
            history[0, :len(seq)] = seq
            p = Penalties(np.int32([len(prompt)]), *settings)
            ref = penalized_reference(logits[len(seq) - 1][None], p, history, np.int32([0]), np.int32([0]),
                                      np.bool_([0]))[0]
            assert ref[token] >= ref.max() - 1e-4, (prompt, t)  # the argmax, but for a near tie
    plain = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=8, ignore_eos=True)
    assert sum(list(a) != list(b) for a, b in zip(out, plain)) >= 2


def test_copies_of_one_request_generate_what_it_generates_alone(engine):
    # The issue's report: with 3 rows in use of a 4-row bucket, request 0's cache row was overwritten by the
    # padding requests. Every count up to 3 x max_batch (so partly filled and refilled batches).
    p = [5, 17, 42, 9, 3]
    for adapter in (None, "a1"):
        alone = list(engine.generate([p], [adapter], max_new_tokens=6)[0])
        for n in range(1, 3 * engine.config.max_batch + 1):
            assert [list(o) for o in engine.generate([p] * n, [adapter] * n, max_new_tokens=6)] == [alone] * n, n


def test_garbage_in_a_free_slot_changes_nothing(engine):
    # NaN and inf in every weight of a slot that no request uses (and past the ranks of the used ones) reach no
    # request: the backends select rather than multiply by zero (the Pallas kernels: tests/test_ops.py's poison).
    import jax
    import jax.numpy as jnp

    ref = [list(o) for o in engine.generate(PROMPTS, ["a0", None, "a0", None, "a0"], max_new_tokens=4)]
    clean, slot = engine.pool.weights, engine.pool.slot("a1")
    engine.pool.weights = jax.tree.map(
        lambda w: w.at[slot].set(jnp.where(jnp.arange(w.shape[1]) % 2 == 0, jnp.nan, jnp.inf)[:, *([None] * (w.ndim - 2))]),
        clean)
    try:
        for backend in ("reference", "ragged", "gather"):
            engine.runner.backend = backend
            out = engine.generate(PROMPTS, ["a0", None, "a0", None, "a0"], max_new_tokens=4)
            assert [list(o) for o in out] == ref, backend
    finally:
        engine.pool.weights, engine.runner.backend = clean, "auto"


def test_pallas_backend_generates_the_same(engine):
    # Under "pallas" the decode steps also run the decode-attention kernel, over the rows the continuous
    # batching hands out (interpret mode on CPU).
    ref = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=4)
    backend, engine.runner.backend = engine.runner.backend, "pallas"
    try:
        out = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=4)
    finally:
        engine.runner.backend = backend
    assert [list(o) for o in out] == [list(r) for r in ref]


@pytest.mark.slow
def test_split_attention_generates_the_same_and_each_request_what_it_does_alone(engine):
    """Decode attention split over chunks of 256 positions (interpret mode on CPU): long prompts decode past a
    chunk's end, beside short ones, on a paged cache and on a contiguous one; as unsplit, and each request
    as alone (the split is the engine's, whatever the batch)."""
    rng = np.random.default_rng(0)
    model = engine.runner.model_def.merge(engine.runner.params)
    config = dataclasses.replace(engine.config, backend="pallas", max_seq_len=640, max_batch=3, split_attention="on")
    split = Engine(model, config)
    unsplit = Engine(model, dataclasses.replace(config, split_attention="off"))
    assert split.runner.attention_chunk == 256 and unsplit.runner.attention_chunk is None
    prompts = [rng.integers(0, CFG["vocab_size"], n).tolist() for n in (250, 3, 520, 40)]
    for block_size in (16, 0):
        for eng in (split, unsplit):
            eng.config = dataclasses.replace(eng.config, block_size=block_size)
        out = [list(o) for o in split.generate(prompts, [None] * 4, max_new_tokens=12)]
        assert out == [list(o) for o in unsplit.generate(prompts, [None] * 4, max_new_tokens=12)]
        assert out == [list(split.generate([p], [None], max_new_tokens=12)[0]) for p in prompts]


def test_stop_tokens_with_continuous_batching(engine):
    # 5 requests on 2 rows; two of them stop early, so rows free up while a decode step is in flight (the
    # engine pipelines steps): the token decoded past a stop must be dropped and the next request admitted.
    full = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=6)
    stops = {full[0][2], full[1][1]}
    out = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=6, stop_token_ids=sorted(stops))
    for o, f in zip(out, full):
        cut = next((i for i, t in enumerate(f) if t in stops), None)
        assert list(o) == list(f[:cut]) and o.finish_reason == ("length" if cut is None else "stop")
    assert out[0].finish_reason == out[1].finish_reason == "stop"


def test_generation_stops_at_the_models_eos_ids_as_hf_generate_does(engine, tmp_path):
    """A model directory's generation_config.json eos_token_id (a list, as Llama-3 Instruct's) ends generation,
    with the stop ids beside it; ignore_eos generates past it; config.json's is read when the other is absent."""
    full = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=6)
    eos, stop = full[0][2], full[3][1]
    model = tmp_path / "m"
    testing.write_model(str(model), CFG, seed=7)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 10**6], "temperature": 0.7}))
    with_eos = Engine.from_pretrained(str(model), max_loras=3, max_lora_rank=16, dtype="float32", max_batch=2,
                                      max_seq_len=64, progress=False)
    assert with_eos.eos_token_ids == {eos, 10**6}
    assert with_eos.generation_defaults == GenerationDefaults(temperature=0.7)  # for the server; generate greedy
    for i in range(3):
        with_eos.load_adapter(f"a{i}", str(engine.root / f"a{i}"))
    out = with_eos.generate(PROMPTS, ADAPTERS, max_new_tokens=6, stop_token_ids=[stop])
    for o, f in zip(out, full):
        cut = next((i for i, t in enumerate(f) if t in (eos, stop)), None)
        assert list(o) == list(f[:cut]) and o.finish_reason == ("length" if cut is None else "stop")
    assert out[0].finish_reason == out[3].finish_reason == "stop"
    past = with_eos.generate(PROMPTS, ADAPTERS, max_new_tokens=6, ignore_eos=True)
    assert [list(o) for o in past] == [list(f) for f in full]
    with pytest.raises(ValueError, match="ignore_eos must be a bool"):
        with_eos.generate(PROMPTS, ADAPTERS, max_new_tokens=6, ignore_eos="yes")
    (model / "generation_config.json").unlink()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 3}))
    assert Engine.from_pretrained(str(model), dtype="float32", progress=False).eos_token_ids == {3}
    assert engine.eos_token_ids == frozenset()  # the fixture's model names none


# generation_config.json files as models ship them (Llama-3.1-8B-Instruct's, Qwen2.5-7B-Instruct's, a greedy one)
GENERATION_CONFIGS = [
    {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6,
     "top_p": 0.9, "transformers_version": "4.42.3"},
    {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
     "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
    {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "max_new_tokens": 256,
     "repetition_penalty": 1.0},
]


@pytest.mark.parametrize("given", GENERATION_CONFIGS)
def test_generation_defaults_are_the_sampling_settings_the_file_sets(given, tmp_path):
    """As vLLM reads generation_config.json for its server: the sampling settings transformers 5's
    `GenerationConfig.to_diff_dict` keeps (every one set), `do_sample` not read; where transformers is installed,
    against it."""
    (tmp_path / "generation_config.json").write_text(json.dumps(given))
    got = generation_defaults(str(tmp_path)).set()
    keys = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "max_new_tokens": "max_tokens", "repetition_penalty": "repetition_penalty"}
    assert got == {keys[k]: v for k, v in given.items() if k in keys and v is not None}
    assert generation_defaults(str(tmp_path / "none")) == GenerationDefaults()  # no file: no defaults
    try:
        from transformers import GenerationConfig
    except ImportError:
        return
    if GenerationConfig().top_k is not None:  # transformers 4 left out the values equal to its defaults
        return
    diff = GenerationConfig.from_pretrained(str(tmp_path)).to_diff_dict()
    assert got == {keys[k]: v for k, v in diff.items() if k in keys and v is not None}


def test_a_request_cancelled_while_its_prompt_goes_in_pieces_frees_its_row(engine):
    from jlora.scheduler import Batcher, Request

    batcher = Batcher(engine.runner, 2, 64, prefill_chunk=16)  # 16 prompt tokens per step: one piece at a time
    long = Request(list(range(1, 40)), engine.pool.slot("a1"), 4)
    others = [Request(PROMPTS[0], engine.pool.slot("a0"), 4), Request(PROMPTS[3], -1, 4)]
    for r in [long, *others]:
        batcher.add(r)
    batcher.step()
    batcher.step()
    assert batcher.running[0] is long and batcher.position[0] == 32 and not long.out
    batcher.cancel(long)
    assert long.finish == "cancelled" and batcher.running[0] is None
    while batcher.busy:
        batcher.step()
    alone = engine.generate([PROMPTS[0], PROMPTS[3]], ["a0", None], max_new_tokens=4)
    assert [r.out for r in others] == [list(a) for a in alone] and not long.out


def test_a_requests_first_token_time_stays_its_first_tokens(engine):
    """`Request.first_token_time` (the server's time to first token) is set by the first token, not the later ones."""
    from jlora.scheduler import Batcher, Request

    r, batcher = Request(PROMPTS[0], -1, 4), Batcher(engine.runner, 2, 64)
    batcher.add(r)
    while not r.out:
        batcher.step()
    first = r.first_token_time
    while batcher.busy:
        batcher.step()
    assert first is not None and r.first_token_time == first and len(r.out) == 4


@pytest.mark.parametrize("seed", range(2))
def test_a_step_prefills_at_most_prefill_chunk_tokens_padded(engine, monkeypatch, seed):
    """Prompts of 1-60 tokens arriving over the steps, 4 rows, 32 prompt tokens a step: every step's pieces,
    padded to [bucket(pieces), bucket(longest)], hold at most 32 tokens (the step shapes the engine compiles),
    and each request still generates what it generates alone."""
    from jlora.scheduler import Batcher, Request

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 90, int(rng.integers(1, 61))).tolist() for _ in range(10)]
    requests = [Request(p, -1, 3) for p in prompts]
    shapes, step = [], engine.runner.step
    monkeypatch.setattr(engine.runner, "step",
                        lambda s, *rest: shapes.append(s.prefill and s.prefill.tokens.shape) or step(s, *rest))
    drive(Batcher(engine.runner, 4, 96, prefill_chunk=32), requests, arrivals=sorted(rng.integers(0, 12, 10)))
    pieces = [a * b for a, b in filter(None, shapes)]
    assert pieces and max(pieces) <= 32 and sum(pieces) >= sum(map(len, prompts))
    assert [r.out for r in requests] == [list(g) for g in engine.generate(prompts, [None] * 10, max_new_tokens=3)]


def test_a_generate_interrupted_mid_step_leaves_nothing_running_on_the_device(engine, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while a step runs and the one before is unread: `generate` raises it only once
    the device has run both, as the process may exit next (XLA running at exit crashed a server by SIGSEGV)."""
    from jlora.scheduler import Batcher

    step, batchers = Batcher.step, []

    def step_interrupted_at_the_third(self, while_in_flight=None):
        def interrupt():
            raise KeyboardInterrupt

        batchers.append(self)
        step(self, interrupt if len(batchers) == 3 else while_in_flight)

    monkeypatch.setattr(Batcher, "step", step_interrupted_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([PROMPTS[0], PROMPTS[3]], ["a0", None], max_new_tokens=8)
    batcher, = set(batchers)
    assert len(batchers) == 3 and batcher.in_flight is None
    assert all(leaf.is_ready() for leaf in jax.tree.leaves(batcher.cache))
    monkeypatch.undo()
    alone = engine.generate([PROMPTS[0]], ["a0"], max_new_tokens=8)  # and the engine generates on
    assert alone == engine.generate([PROMPTS[0], PROMPTS[3]], ["a0", None], max_new_tokens=8)[:1]


def test_sampling_is_seeded(engine):
    kw = dict(max_new_tokens=8, temperature=1.5, top_p=0.95)
    a = engine.generate(PROMPTS, ADAPTERS, seed=1, **kw)
    assert [list(x) for x in a] == [list(x) for x in engine.generate(PROMPTS, ADAPTERS, seed=1, **kw)]
    assert [list(x) for x in a] != [list(x) for x in engine.generate(PROMPTS, ADAPTERS, seed=2, **kw)]
    greedy = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=8)
    for one in (dict(top_p=1e-6), dict(top_k=1), dict(min_p=1.0)):  # each filter keeping the top token alone
        sampled = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=8, temperature=1.0, **one)
        assert [list(x) for x in greedy] == [list(x) for x in sampled], one
    # Sampled at a high temperature with top_k=2, every token is one of the two most likely at its position.
    out = engine.generate(PROMPTS, ADAPTERS, max_new_tokens=8, temperature=5.0, top_k=2, seed=3)
    ranks = []
    for prompt, adapter, gen in zip(PROMPTS, ADAPTERS, out):
        logits = engine.prefill_logits([prompt + list(gen)], [adapter])[0][len(prompt) - 1: -1]
        ranks += [int((row > row[t]).sum()) for row, t in zip(logits, gen)]
    assert set(ranks) == {0, 1}


def test_compilations_bounded_over_1000_decode_steps_with_loads(engine):
    rng = np.random.default_rng(0)
    # Compile the buckets used below, with and without the LoRA ops (steps of base-model requests only).
    engine.generate(PROMPTS, ADAPTERS, max_new_tokens=50)
    engine.generate(PROMPTS, [None] * len(PROMPTS), max_new_tokens=50)
    compiled = generate_step._cache_size()
    steps = 0
    while steps < 1000:
        names = engine.adapters + [None]
        adapters = [names[i] for i in rng.integers(0, len(names), len(PROMPTS))]
        out = engine.generate(PROMPTS, adapters, max_new_tokens=50)
        steps += max(len(o) for o in out) * 3  # decode steps: 5 requests over 2 rows
        victim = engine.adapters[int(rng.integers(len(engine.adapters)))]
        engine.unload_adapter(victim)
        engine.load_adapter(victim, str(engine.root / victim))
    assert generate_step._cache_size() == compiled


def _while_loops(jaxpr) -> int:
    """XLA while loops (`while` and `scan`) in `jaxpr` and the jaxprs it calls; a Pallas kernel's own loops,
    which run inside the kernel, are not counted."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "pallas_call":
            count += eqn.primitive.name in ("while", "scan")
            subs = jax.extend.core.jaxprs_in_params(eqn.params)
            count += sum(_while_loops(getattr(sub, "jaxpr", sub)) for sub in subs)
    return count


def test_the_engine_steps_run_no_while_loop(engine, monkeypatch):
    """The engine's steps (decode and prompt pieces with adapters, so two `LoRABatchInfo`s; sampling filtered,
    penalties, log-probabilities) trace no XLA while loop: on the GPU one stands between two CUDA graphs, the host
    launching each iteration (docs/performance.md, *The LoRA metadata without a while loop*)."""
    import jlora.runner as runner_module

    calls = []
    monkeypatch.setattr(runner_module, "generate_step", lambda *args: calls.append(args) or generate_step(*args))
    engine.generate(PROMPTS, ADAPTERS, max_new_tokens=4, temperature=0.7, top_p=0.9, repetition_penalty=1.2,
                    logprobs=2)
    assert {call[2].prefill is not None for call in calls} == {True, False}
    for call in calls:
        assert _while_loops(generate_step.with_options({}).trace(*call).jaxpr.jaxpr) == 0
    assert _while_loops(jax.make_jaxpr(jnp.searchsorted)(np.arange(4), np.arange(3)).jaxpr) == 1  # it counts them


def test_base_only_calls_run_without_the_lora_ops(engine, monkeypatch):
    import jlora.runner as runner_module

    seen = []

    def recording(step):  # records the LoRA weights each call is given (model_def, params, inputs, cache, lora, ...)
        return lambda *args: seen.append(args[4]) or step(*args)

    monkeypatch.setattr(runner_module, "forward", recording(runner_module.forward))
    monkeypatch.setattr(runner_module, "generate_step", recording(runner_module.generate_step))
    engine.prefill_logits([[1, 2]], [None])
    engine.generate([[1, 2]], [None], max_new_tokens=3)
    assert seen and all(w is None for w in seen)
    seen.clear()
    engine.prefill_logits([[1, 2], [3]], [None, "a1"])
    engine.generate([[1, 2], [3]], [None, "a1"], max_new_tokens=3)
    assert seen and all(w is not None and w is engine.pool.step_weights for w in seen)


def _one_slot_engine(tmp_path) -> Engine:
    """A float32 engine of one adapter slot and two rows, adapters read on the calling thread."""
    testing.write_model(str(tmp_path / "m"), CFG, seed=7)
    return Engine.from_pretrained(str(tmp_path / "m"), max_loras=1, max_lora_rank=8, dtype="float32", max_batch=2,
                                  max_seq_len=64, progress=False, adapter_readers=0)


def test_calls_from_several_threads_run_one_after_another(tmp_path):
    """Threads calling generate, score and prefill_logits at once, each with its own adapter, over one slot, and
    one loading and unloading another adapter: each gets what it gets alone (a call once failed with
    PoolFullError, every slot held by another call's adapter; a slot write from another thread deleted the
    weights a step in flight read; prefill_logits' adapter could be evicted between its slot write and its
    step)."""
    eng = _one_slot_engine(tmp_path)
    for i in range(4):
        testing.write_adapter(str(tmp_path / f"a{i}"), CFG, r=4, alpha=8, seed=i)
        eng.register_adapter(f"a{i}", str(tmp_path / f"a{i}"))
    calls = [lambda i=i: [list(g) for g in eng.generate([[1, 2, 3 + i]] * 3, [f"a{i}"] * 3, max_new_tokens=12)]
             for i in range(2)]
    calls.append(lambda: eng.score([[1, 2]] * 2, [[3, 4, 5]] * 2, ["a2", "a2"]))
    calls.append(lambda: eng.prefill_logits([[5, 6, 7]], ["a3"]))
    calls.append(lambda: (eng.load_adapter("b", str(tmp_path / "a0")), eng.unload_adapter("b")))
    alone = [call() for call in calls]
    for _ in range(6):
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as threads:
            together = [f.result() for f in [threads.submit(call) for call in calls]]
        for got, want in zip(together, alone):
            jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_progress_callback_may_call_the_engine_again(tmp_path):
    """The calls' lock is re-entrant: a `progress` callback that generates and reads logits on the base model while
    the outer call runs its adapter in the engine's one slot gets what those calls get alone, and so does the
    outer call."""
    eng = _one_slot_engine(tmp_path)
    testing.write_adapter(str(tmp_path / "a"), CFG, r=4, alpha=8, seed=1)
    eng.register_adapter("a", str(tmp_path / "a"))
    outer = lambda progress=None: [list(g) for g in eng.generate([[1, 2, 3], [4]], ["a", "a"], max_new_tokens=6,
                                                                 progress=progress)]
    inner = lambda: ([list(g) for g in eng.generate([[5, 6]], [None], max_new_tokens=4)],
                     eng.prefill_logits([[7, 8]], [None]))
    outer_alone, inner_alone = outer(), inner()
    nested, got = [], []
    # in a daemon thread, so that a lock that is not re-entrant fails the test instead of hanging the suite
    thread = threading.Thread(target=lambda: got.append(outer(lambda n: len(nested) < 2 and nested.append(inner()))),
                              daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert got == [outer_alone] and len(nested) == 2, "the nested calls deadlocked or failed"
    for result in nested:
        jax.tree.map(np.testing.assert_array_equal, result, inner_alone)


def test_generation_errors(engine):
    with pytest.raises(KeyError, match="unknown adapter"):
        engine.generate([[1]], ["nope"], max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        engine.generate([[1] * 60], [None], max_new_tokens=8)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        engine.generate(["hello"], [None], max_new_tokens=2)
    with pytest.raises(ValueError, match="2 prompts but 1 adapters"):
        engine.generate([[1], [2]], [None], max_new_tokens=2)
    for adapters in ("a", None, 3):  # a bare name is not read as one-letter names
        with pytest.raises(ValueError, match="adapters must be a list of names"):
            engine.generate([[1]], adapters, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"adapters\[1\] is 3: each must be a name or None"):
        engine.score([[1], [2]], [[3], [4]], [None, 3])
    for prompt in ([1.0, 2], [True], [np.float32(3)]):  # never truncated or read as 1
        with pytest.raises(ValueError, match="prompt 0 holds token ids that are not integers"):
            engine.generate([prompt], [None], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0 is neither text nor a sequence of token ids: int"):
        engine.generate([5], [None], max_new_tokens=2)
    with pytest.raises(ValueError, match="progress must be None or a callable"):
        engine.generate([[1]], [None], max_new_tokens=2, progress=5)
    with pytest.raises(ValueError, match="progress must be None or a callable"):
        engine.score([[1]], [[2]], [None], progress=True)
    for prompt in (b"hello", bytearray(b"hi")):  # not read as the ids of its bytes
        with pytest.raises(ValueError, match=f"prompt 0 is neither text nor .*: {type(prompt).__name__}; decode it"):
            engine.generate([prompt], [None], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts must be a list, got one str; for one prompt give \[prompt\]"):
        engine.generate("hello", [None] * 5, max_new_tokens=2)  # not five one-character prompts
    with pytest.raises(ValueError, match="continuations must be a list, got one str"):
        engine.score([[1], [2]], "ab", [None, None])
    for temperature in (float("nan"), float("inf"), -0.5):
        with pytest.raises(ValueError, match="need a finite temperature >= 0"):
            engine.generate([[1]], [None], max_new_tokens=2, temperature=temperature)
    bad_options = [(dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
                   (dict(temperature="0.5"), "need a finite temperature"), (dict(top_p=None), "need a finite"),
                   (dict(n=True), "n must be an integer >= 1, got True"),
                   (dict(logprobs=True), "logprobs must be None or an integer"),
                   (dict(seed=1.5), "seed must be an integer or a sequence of integers"),
                   (dict(seed="7"), "seed must be an integer or a sequence of integers"),
                   (dict(stop_token_ids=5), "stop_token_ids must be a collection of integer token ids"),
                   (dict(stop_token_ids=[1.0]), "stop_token_ids must be a collection of integer token ids"),
                   (dict(top_k=-1), "top_k must be an integer >= 0"), (dict(top_k=2.0), "top_k must be"),
                   (dict(min_p=1.5), r"min_p must be a number in \[0, 1\]"), (dict(min_p=None), "min_p must be"),
                   (dict(stop_token_ids=[-1]), r"stop_token_ids \[-1\] are outside \[0, "),
                   (dict(stop_token_ids=[3, 10**6]), r"stop_token_ids \[1000000\] are outside \[0, \d+\), the requests' vocabulary")]
    for options, message in bad_options:
        with pytest.raises(ValueError, match=message):
            engine.generate([[1]], [None], **{"max_new_tokens": 2, **options})
    # numpy integers are integers: ids, seeds and stop tokens (a stop token that the request generates)
    full = list(engine.generate([[1, 2]], [None], max_new_tokens=4)[0])
    out = engine.generate([np.array([1, 2], np.int64)], [None], max_new_tokens=np.int32(4), seed=np.array([3]),
                          stop_token_ids=np.array([full[1], 0]))[0]
    assert list(out) == full[: next(i for i, t in enumerate(full) if t in (full[1], 0))] and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="prefill_chunk must be a power of two >= 16, got 8"):
        Engine.from_pretrained(str(engine.root / "m"), prefill_chunk=8, progress=False)


def test_text_in_and_out_with_a_tokenizer(tmp_path):
    testing.write_model(str(tmp_path), CFG, seed=8)
    testing.write_tokenizer(str(tmp_path), CFG["vocab_size"])
    eng = Engine.from_pretrained(str(tmp_path), dtype="float32", progress=False)
    (out,) = eng.generate(["the quick brown fox"], [None], max_new_tokens=4)
    assert isinstance(out.text, str) and len(out) == 4
    prompt = eng.tokenizer.encode("the quick brown fox").ids  # the text is what the output adds to the prompt's
    assert out.text.startswith(" ") and "the quick brown fox" + out.text == eng.tokenizer.decode(prompt + list(out))


def test_a_paged_cache_runs_more_rows_than_its_memory_holds_at_max_seq_len(engine, monkeypatch):
    """8 rows over 8 blocks of 16 positions (what 2 rows hold at max_seq_len 64): short requests (1 block each)
    run 8 at a time, longer ones wait for blocks; every request equals itself alone on a contiguous cache."""
    import dataclasses

    from jlora.scheduler import Batcher

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG["vocab_size"], int(n)).tolist() for n in rng.integers(1, 12, 12)]
    prompts += [rng.integers(0, CFG["vocab_size"], 40).tolist()]  # 3 blocks with its 6 new tokens
    adapters = [["a0", None, "a1", "a2"][i % 4] for i in range(len(prompts))]
    alone = [engine.generate([p], [a], max_new_tokens=6)[0] for p, a in zip(prompts, adapters)]
    peak = []
    step = Batcher.step
    monkeypatch.setattr(Batcher, "step", lambda self, *a: peak.append(self.num_running) or step(self, *a))
    old = engine.config
    engine.config = dataclasses.replace(old, max_batch=8, block_size=16, kv_blocks=8)
    try:
        out = engine.generate(prompts, adapters, max_new_tokens=6)
        with pytest.raises(ValueError, match="need 4 cache blocks, more than the cache.s 3"):
            engine.config = dataclasses.replace(engine.config, kv_blocks=3)
            engine.generate([[1] * 60], [None], max_new_tokens=4)
    finally:
        engine.config = old
    assert [list(o) for o in out] == [list(a) for a in alone]
    assert max(peak) == 8  # rows beyond the 2 that the blocks hold at max_seq_len


def test_kv_cache_memory_sets_the_number_of_blocks(engine):
    """A block of 16 positions of the tiny float32 model is 2 layers x K and V x 2 KV heads x 16 x 16 x 4 bytes
    = 8 KiB: 100 KiB holds 12 of them, capped at what the rows hold at max_seq; less than a block is refused."""
    import dataclasses

    old = engine.config
    try:
        engine.config = dataclasses.replace(old, block_size=16, kv_cache_memory=100 / 2**20)
        assert engine.new_batcher(4, 64).blocks.num_blocks == 12
        assert engine.new_batcher(2, 64).blocks.num_blocks == 8
        engine.config = dataclasses.replace(old, block_size=16, kv_cache_memory=4 / 2**20)
        with pytest.raises(ValueError, match="kv_cache_memory .* holds no block of 16 positions"):
            engine.new_batcher(4, 64)
    finally:
        engine.config = old


def test_a_kv_cache_larger_than_the_free_device_memory_is_refused_before_it_is_made(engine, monkeypatch):
    import jlora.engine

    _free_bytes = jlora.engine._free_bytes

    config = dataclasses.replace(engine.config, block_size=16)
    monkeypatch.setattr(engine, "config", config)
    block = 2 * CFG["num_hidden_layers"] * 2 * 16 * 16 * 4  # k and v, layers, 2 KV heads, head_dim 16, f32
    monkeypatch.setattr(jlora.engine, "_free_bytes", lambda devices: 8 * block - 1)
    with pytest.raises(ValueError, match=r"a KV cache of 8 blocks of 16 positions takes 0.0 GiB on each device \(and "
                                         r"the penalties' token history 0.0 GiB\), more than the 0.0 GiB free there: "
                                         r"lower kv_blocks"):
        engine.new_batcher(2, 64)  # the default: every row at max_seq
    assert engine.new_batcher(2, 48).blocks.num_blocks == 6
    monkeypatch.setattr(jlora.engine, "_free_bytes", lambda devices: 6 * block + 2 * 48 * 4 - 1)
    with pytest.raises(ValueError, match="a KV cache of 6 blocks"):  # the blocks fit, the history beside them not
        engine.new_batcher(2, 48)
    monkeypatch.setattr(jlora.engine, "_free_bytes", lambda devices: 8 * block - 1)
    monkeypatch.setattr(engine, "config", dataclasses.replace(config, kv_blocks=9))
    with pytest.raises(ValueError, match="a KV cache of 9 blocks"):
        engine.new_batcher(1, 16)
    monkeypatch.setattr(engine, "config", dataclasses.replace(config, kv_cache_memory=1.0))  # capped at the rows'
    assert engine.new_batcher(2, 48).blocks.num_blocks == 6
    monkeypatch.setattr(jlora.engine, "_free_bytes", _free_bytes)  # the host's memory, as a CPU engine counts it
    monkeypatch.setattr(engine, "config", dataclasses.replace(config, kv_blocks=2**40 // block))  # 1 TiB
    with pytest.raises(ValueError, match=r"a KV cache of \d+ blocks of 16 positions takes 1024.0 GiB on each device "
                                         r".* more than the [\d.]+ GiB free there"):
        engine.new_batcher(1, 16)


def test_an_engine_stores_the_weights_as_its_max_batch_wants_them(engine):
    """A model given in the other layout is stored as the engine wants it: [out, in] at max_batch 1, [in, out]
    above (`EngineConfig.weights_out_in`); both engines' logits and greedy tokens equal the loaded engine's."""
    prompts, want = [[1, 2, 3], [4]], engine.prefill_logits([[1, 2, 3], [4]], [None, None])
    greedy = [list(g) for g in engine.generate(prompts, [None, None], max_new_tokens=5)]
    for loaded_out_in, max_batch in ((False, 1), (True, 4)):
        model = load_model(str(engine.root / "m"), np.float32, progress=False, out_in=loaded_out_in)
        other = Engine(model, max_batch=max_batch, dtype="float32", max_seq_len=64)
        c = other.model_config
        assert c.weights_out_in == (max_batch == 1) != loaded_out_in
        qkv = other.runner.model_def.merge(other.runner.params).layers[0].attn.qkv.weight[...]
        in_out = (c.hidden_size, c.q_size + 2 * c.kv_size)
        assert qkv.shape == (in_out[::-1] if max_batch == 1 else in_out)
        for got, logits in zip(other.prefill_logits(prompts, [None, None]), want):
            np.testing.assert_allclose(got, logits, rtol=1e-5, atol=1e-5)
        assert [list(g) for g in other.generate(prompts, [None, None], max_new_tokens=5)] == greedy
