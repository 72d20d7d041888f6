"""jlora against PEFT's own numbers on PEFT's own files (tests/fixtures/peft, made by make_peft_fixtures.py
with PEFT 0.21): embedding layers as PEFT saves them, added vocabulary, modules_to_save copies, trainable
tokens, LoRA bias, DoRA and LongLoRA, on an untied Llama (vocab 83) and a tied Qwen2 with q|k|v biases (vocab
300). Every adapter's requests run in one mixed batch with the base model's, on every backend; float32 logits
within 1e-4 of PEFT's and greedy tokens equal."""

import dataclasses
import json
import os

import numpy as np
import pytest

from jlora.engine import Engine
from tests.oracle import rel_err

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "peft")
BASES = ["llama", "qwen2_tied"]


def expected(base: str):
    with open(os.path.join(FIXTURES, base, "expected.json")) as f:
        cases = json.load(f)
    arrays = np.load(os.path.join(FIXTURES, base, "expected.npz"))
    return cases, arrays


@pytest.fixture(scope="module", params=BASES)
def loaded(request):
    cases, arrays = expected(request.param)
    engine = Engine.from_pretrained(os.path.join(FIXTURES, request.param, "model"), dtype="float32",
                                    max_loras=len(cases), max_lora_rank=16, max_batch=8, max_seq_len=64,
                                    max_extra_vocab=8, progress=False)
    for name in cases:
        if name != "base":
            engine.load_adapter(name, os.path.join(FIXTURES, request.param, name))
    requests = [(p, None if name == "base" else name, name, i)
                for name, case in cases.items() for i, p in enumerate(case["prompts"])]
    order = np.random.default_rng(0).permutation(len(requests))  # adapters and the base model interleaved
    return engine, [requests[j] for j in order], cases, arrays


@pytest.mark.parametrize("backend", ["reference", "ragged", "gather", "pallas"])
def test_logits_match_peft(loaded, backend):
    engine, requests, _, arrays = loaded
    engine.runner.backend = backend
    try:
        got = engine.prefill_logits([r[0] for r in requests], [r[1] for r in requests])
    finally:
        engine.runner.backend = "auto"
    for (_, _, name, i), logits in zip(requests, got):
        want = arrays[f"{name}/{i}"]
        assert logits.shape == want.shape, (name, i)
        assert rel_err(logits, want) < 1e-4, (name, i, rel_err(logits, want))


def test_greedy_generation_of_a_mixed_batch_matches_peft(loaded):
    """With the default backend (on a GPU: gather for decode, the Pallas kernels for prefill)."""
    engine, requests, cases, _ = loaded
    out = engine.generate([r[0] for r in requests], [r[1] for r in requests], max_new_tokens=6)
    for (_, _, name, i), tokens in zip(requests, out):
        assert list(tokens) == cases[name]["greedy"][i], (name, i)


def test_every_feature_is_in_the_fixtures():
    """The fixtures hold what they claim: PEFT's keys for each feature (a regenerated set that lost one fails)."""
    from safetensors import safe_open

    def keys(base, name):
        with safe_open(os.path.join(FIXTURES, base, name, "adapter_model.safetensors"), "np") as f:
            return " ".join(f.keys())

    assert "embed_tokens.base_layer.weight" in keys("llama", "emb") and "lm_head.base_layer" in keys("llama", "emb")
    assert "trainable_tokens_delta" in keys("llama", "tokens") and "trainable_tokens_delta" in keys("qwen2_tied", "tokens")
    assert "lora_B.bias" in keys("llama", "bias") and "lora_magnitude_vector" in keys("qwen2_tied", "dora")
    assert "model.embed_tokens.weight" in keys("llama", "saved") and "lm_head.weight" in keys("llama", "saved")
    cases, _ = expected("llama")
    assert cases["added"]["added"] == 3 and any(t >= 83 for p in cases["added"]["prompts"] for t in p)
    with open(os.path.join(FIXTURES, "llama", "long", "adapter_config.json")) as f:
        assert json.load(f)["context_length"] == 64


def test_added_tokens_belong_to_their_adapter(loaded):
    """Token ids past the base vocabulary are valid only for the adapter that adds them: in prompts, and in
    what requests can sample (the other requests' logits there are -inf)."""
    engine, _, cases, _ = loaded
    if "added" not in cases:
        pytest.skip("no adapter adds tokens here")
    v, added = engine.model_config.vocab_size, cases["added"]["added"]
    assert engine.vocab_size(None) == v and engine.vocab_size("added") == v + added
    with pytest.raises(ValueError, match=rf"outside \[0, {v}\)"):
        engine.generate([[1, v]], [None], max_new_tokens=1)
    with pytest.raises(ValueError, match=rf"outside \[0, {v + added}\)"):
        engine.generate([[1, v + added]], ["added"], max_new_tokens=1)
    logits = engine.prefill_logits([[1, v], [1, 2]], ["added", "plain"])
    assert logits[0].shape[1] == v + added and logits[1].shape[1] == v


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_scores_and_logprobs_of_a_mixed_batch_match_peft(loaded):
    """Log-probabilities against log_softmax of PEFT's float32 logits, within 1e-4: of every prompt token
    (`Engine.score` of each prompt cut after its first token, every adapter in one batch), and of the greedy
    continuations, scored after their prompts and as generated (with the top 5 of each position)."""
    engine, requests, cases, arrays = loaded
    long = [r for r in requests if len(r[0]) > 1]
    scores = engine.score([r[0][:1] for r in long], [r[0][1:] for r in long], [r[1] for r in long])
    for (prompt, _, name, i), score in zip(long, scores):
        lp = log_softmax(arrays[f"{name}/{i}"])
        want = [lp[j - 1, t] for j, t in enumerate(prompt) if j]
        np.testing.assert_allclose(score.token_logprobs, want, atol=1e-4, err_msg=f"{name}/{i}")
        assert score.is_greedy == all(lp[j - 1].argmax() == t for j, t in enumerate(prompt) if j)
    greedy = [cases[name]["greedy"][i] for _, _, name, i in requests]
    scores = engine.score([r[0] for r in requests], greedy, [r[1] for r in requests])
    out = engine.generate([r[0] for r in requests], [r[1] for r in requests], max_new_tokens=6, logprobs=5)
    for (_, _, name, i), tokens, score, gen in zip(requests, greedy, scores, out):
        lp = log_softmax(arrays[f"{name}/{i}/greedy"])  # the rows that chose each greedy token
        want = lp[np.arange(len(tokens)), tokens]
        assert score.is_greedy and list(gen) == tokens, (name, i)
        np.testing.assert_allclose(score.token_logprobs, want, atol=1e-4, err_msg=f"{name}/{i}")
        np.testing.assert_allclose([t.logprob for t in gen.logprobs], want, atol=1e-4, err_msg=f"{name}/{i}")
        for row, t in zip(lp, gen.logprobs):
            np.testing.assert_allclose([v for _, v in t.top], np.sort(row)[::-1][:5], atol=1e-4)


@pytest.mark.parametrize("base", BASES)
def test_a_batch_one_engine_stores_out_in_and_matches_peft(base):
    """An engine of max_batch 1 stores its projections' weights [out, in] and runs a one-token step's products as
    row reductions (`EngineConfig.weights_out_in`): its prompt logits and its greedy tokens and their
    log-probabilities, each generated in steps of one row (DoRA's norms read from the [out, in] weights, the tied
    lm_head over the embedding), match PEFT's within 1e-4."""
    cases, arrays = expected(base)
    engine = Engine.from_pretrained(os.path.join(FIXTURES, base, "model"), dtype="float32", max_loras=len(cases),
                                    max_lora_rank=16, max_batch=1, max_seq_len=64, max_extra_vocab=8, progress=False)
    config = engine.model_config
    assert config.weights_out_in and engine.runner.linear(0, "o")[0].shape == (config.q_size, config.hidden_size)
    for name in cases:
        if name != "base":
            engine.load_adapter(name, os.path.join(FIXTURES, base, name))
    requests = [(p, None if name == "base" else name, name, i)
                for name, case in cases.items() for i, p in enumerate(case["prompts"])]
    got = engine.prefill_logits([r[0] for r in requests], [r[1] for r in requests])
    out = engine.generate([r[0] for r in requests], [r[1] for r in requests], max_new_tokens=6, logprobs=1)
    for (_, _, name, i), logits, gen in zip(requests, got, out):
        assert rel_err(logits, arrays[f"{name}/{i}"]) < 1e-4, (name, i)
        tokens = cases[name]["greedy"][i]
        assert list(gen) == tokens, (name, i)
        lp = log_softmax(arrays[f"{name}/{i}/greedy"])
        np.testing.assert_allclose([t.logprob for t in gen.logprobs], lp[np.arange(len(tokens)), tokens], atol=1e-4,
                                   err_msg=f"{name}/{i}")
    with pytest.raises(ValueError, match="built with max_batch 1 and stores its weights for one-row steps"):
        engine.config = dataclasses.replace(engine.config, max_batch=2)


@pytest.mark.parametrize("names", [("plain", "long", "tokens"), ("bias", "dora_qv")])
def test_greedy_decode_on_the_pallas_kernels_matches_peft(names):
    """Decode steps on the Pallas kernels (interpret mode on a CPU: the segmented shrink and expand, whose q|k|v
    delta XLA adds before it rotates, and the decode attention) give PEFT's greedy tokens, for plain LoRA,
    LongLoRA's rotation and trainable tokens, and under LoRA bias and DoRA, with the base model's requests in the
    same batches."""
    cases, _ = expected("llama")
    engine = Engine.from_pretrained(os.path.join(FIXTURES, "llama", "model"), dtype="float32", backend="pallas",
                                    max_loras=len(names), max_lora_rank=16, max_batch=4, max_seq_len=64,
                                    max_extra_vocab=8, progress=False)
    for name in names:
        engine.load_adapter(name, os.path.join(FIXTURES, "llama", name))
    requests = [(p, None if name == "base" else name, name, i)
                for name in ("base", *names) for i, p in enumerate(cases[name]["prompts"])]
    requests = [requests[j] for j in np.random.default_rng(1).permutation(len(requests))]
    out = engine.generate([r[0] for r in requests], [r[1] for r in requests], max_new_tokens=6)
    for (_, _, name, i), tokens in zip(requests, out):
        assert list(tokens) == cases[name]["greedy"][i], (name, i)
