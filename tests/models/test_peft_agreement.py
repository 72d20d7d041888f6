"""jlora against Hugging Face transformers + PEFT on the same files, in float32: logits of every request and
greedy generation of mixed batches of 1..9 requests (adapters and the base model together, several requests
per adapter), with the default backend (on a GPU: the gather and Pallas kernels). Runs where torch,
transformers and peft are installed (the GPU machine); skipped elsewhere.

HF runs on the CPU in float32, so its numbers are exact float32; ours must agree to a relative 1e-4."""

import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine
from tests.oracle import rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CASES = {  # a vocabulary no multiple of 16 in both: the lm_head's LoRA takes the kernels' overlapping last block
    "llama_embedding_lm_head": (testing.tiny_config("llama", vocab_size=83), {
        "a": dict(r=8, alpha=16, target_modules=LINEAR_MODULES, embeddings=True, lm_head=True),
        "b": dict(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True)}),
    "qwen2_tied": (testing.tiny_config("qwen2", vocab_size=300, tie_word_embeddings=True), {
        "a": dict(r=16, alpha=8, target_modules=LINEAR_MODULES),
        "b": dict(r=2, alpha=4, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])}),
}


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    cfg, adapters = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    testing.write_model(str(root / "m"), cfg, seed=4)
    for i, (name, kw) in enumerate(adapters.items()):
        testing.write_adapter(str(root / name), cfg, seed=30 + i, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root / "m"), torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(root / "a"), adapter_name="a")
    hf.load_adapter(str(root / "b"), adapter_name="b")
    hf.eval()
    ours = Engine.from_pretrained(str(root / "m"), dtype="float32", max_loras=2, max_lora_rank=16, max_batch=4,
                                  max_seq_len=48, progress=False)
    for name in adapters:
        ours.load_adapter(name, str(root / name))
    return cfg, hf, ours


def hf_logits(hf, tokens: list[int], adapter: str | None) -> np.ndarray:
    with torch.no_grad():
        if adapter is None:
            with hf.disable_adapter():
                return hf(torch.tensor([tokens])).logits[0].numpy()
        hf.set_adapter(adapter)
        return hf(torch.tensor([tokens])).logits[0].numpy()


def hf_greedy(hf, prompt: list[int], adapter: str | None, steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(hf_logits(hf, tokens, adapter)[-1].argmax()))
    return tokens[len(prompt):]


def test_logits_match_peft(models):
    cfg, hf, ours = models
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg["vocab_size"], n).tolist() for n in (12, 5, 1, 30, 7)]
    adapters = ["a", None, "b", "a", "b"]
    for prompt, adapter, got in zip(prompts, adapters, ours.prefill_logits(prompts, adapters)):
        assert rel_err(got, hf_logits(hf, prompt, adapter)) < 1e-4, adapter


def test_greedy_generation_of_mixed_batches_matches_peft(models):
    cfg, hf, ours = models
    rng = np.random.default_rng(1)
    for n in range(1, 10):
        prompts = [rng.integers(0, cfg["vocab_size"], int(rng.integers(1, 20))).tolist() for _ in range(n)]
        adapters = [[None, "a", "b"][i] for i in rng.integers(0, 3, n)]
        for prompt, adapter, got in zip(prompts, adapters, ours.generate(prompts, adapters, max_new_tokens=6)):
            assert list(got) == hf_greedy(hf, prompt, adapter, 6), (n, adapter)
