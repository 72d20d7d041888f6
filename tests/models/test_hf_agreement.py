"""The base model against Hugging Face transformers on the same checkpoint, in float32 with the default backend
(runs where torch and transformers are installed, e.g. the GPU machine; skipped in CI)."""

import numpy as np
import pytest

from jlora import testing
from jlora.engine import Engine
from tests.oracle import rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama3_rope": testing.tiny_config("llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "mistral_head_dim_window": testing.tiny_config("mistral", head_dim=32, sliding_window=6),
    "qwen2_bias_tied": testing.tiny_config("qwen2", tie_word_embeddings=True),
    # Qwen2's window only where use_sliding_window is set, from layer max_window_layers on (or as layer_types say)
    "qwen2_window_layer_1": testing.tiny_config("qwen2", sliding_window=6, use_sliding_window=True, max_window_layers=1),
    "qwen2_layer_types": testing.tiny_config("qwen2", sliding_window=6, use_sliding_window=True,
                                             layer_types=["sliding_attention", "full_attention"]),
    "qwen2_window_unused": testing.tiny_config("qwen2", sliding_window=6),
    "llama_window_ignored": testing.tiny_config("llama", sliding_window=6),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    testing.write_model(str(tmp_path), CONFIGS[name], seed=4)
    prompt = [5, 17, 3, 88, 42, 7, 1, 64, 30, 2, 11, 90]
    ours = Engine.from_pretrained(str(tmp_path), dtype="float32", progress=False).prefill_logits([prompt], [None])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    assert rel_err(ours, ref) < 1e-4
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)


def test_greedy_generation_stops_where_hf_generate_stops(tmp_path):
    """generation_config.json's eos ids end generation in both (HF's `generate` reads them by default)."""
    testing.write_model(str(tmp_path), CONFIGS["llama3_rope"], seed=4)
    prompt = [5, 17, 3, 88, 42, 7]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    greedy = dict(do_sample=False, max_new_tokens=8, pad_token_id=0)
    with torch.no_grad():
        free = hf.generate(torch.tensor([prompt]), **greedy, eos_token_id=None)[0, len(prompt):].tolist()
    eos = [free[3], 10**6 % CONFIGS["llama3_rope"]["vocab_size"]]
    (tmp_path / "generation_config.json").write_text(f'{{"eos_token_id": {eos}}}')
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), **greedy)[0, len(prompt):].tolist()
    assert want[-1] in eos and len(want) < 8  # HF keeps the eos token; jlora's output leaves it out
    engine = Engine.from_pretrained(str(tmp_path), dtype="float32", progress=False)
    out = engine.generate([prompt], [None], max_new_tokens=8)[0]
    assert list(out) == want[:-1] and out.finish_reason == "stop"
    assert list(engine.generate([prompt], [None], max_new_tokens=8, ignore_eos=True)[0]) == free


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_generation_with_a_repetition_penalty_is_hf_generates(tmp_path, penalty):
    """HF's `generate(repetition_penalty=...)` (its RepetitionPenaltyLogitsProcessor over prompt and output)."""
    testing.write_model(str(tmp_path), CONFIGS["qwen2_bias_tied"], seed=4)
    prompt = [5, 17, 3, 88, 42, 7, 5, 17]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None,
                           repetition_penalty=penalty)[0, len(prompt):].tolist()
    engine = Engine.from_pretrained(str(tmp_path), dtype="float32", progress=False)
    out = engine.generate([prompt], [None], max_new_tokens=12, repetition_penalty=penalty, ignore_eos=True)[0]
    assert list(out) == want
    if penalty > 1:  # it changes what this model generates (0.7 leaves its repetition as it is)
        assert list(engine.generate([prompt], [None], max_new_tokens=12, ignore_eos=True)[0]) != want
