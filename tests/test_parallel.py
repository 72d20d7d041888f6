"""Tensor parallelism on 4 virtual CPU devices: TP logits, generations (greedy, and sampled with penalties,
and through a preemption), scores and log-probabilities equal single-device ones (f32), with mixed adapters, including KV heads replicated across devices and the lm_head
split along the vocabulary or replicated; adapter loads do not recompile, steps copy nothing between devices,
and an adapter evicted from its slot comes back from the device cache. Each case runs in a subprocess, since the device count must be set before JAX starts."""

import os
import subprocess
import sys

import pytest

from jlora.adapters.peft import LINEAR_MODULES
from tests.cpu_devices import ROOT, cpu_devices_env


def compare(kv_heads: int, truth: str, splits: list[tuple[int, str]], vocab: int = 96, tied: bool = False) -> None:
    """Runs in the subprocess: builds a model and adapters, and checks each (tp, backend) of `splits` against one
    device on backend `truth` (the lm_head split along the vocabulary unless tied to the embedding or `vocab` is
    not a multiple of tp). The backends agree far within 1e-4 in f32, so one truth, computed once, serves splits
    on other backends: a split on the Pallas kernels (interpret mode on the CPU, which costs as much again as the
    rest of the check) is checked against the reference backend rather than against Pallas on one device."""
    import tempfile

    import jax
    import numpy as np

    from jlora import testing
    from jlora.engine import Engine
    from jlora.runner import forward, generate_step
    from jlora.scheduler import Batcher, Request
    from tests.batching import drive

    root = tempfile.mkdtemp()
    cfg = testing.tiny_config("qwen2", num_attention_heads=8, num_key_value_heads=kv_heads, hidden_size=128,
                              intermediate_size=128, vocab_size=vocab, tie_word_embeddings=tied)
    testing.write_model(f"{root}/m", cfg, seed=1)
    testing.write_adapter(f"{root}/a", cfg, r=8, alpha=16, seed=2, target_modules=LINEAR_MODULES, embeddings=True, lm_head=True)
    # b: v_proj alone of q|k|v (its copy to the devices carries only v's rows of A), in the second layer alone
    testing.write_adapter(f"{root}/b", cfg, r=4, alpha=4, seed=3, target_modules=["o_proj", "down_proj", "v_proj"],
                          layers_to_transform=[1])
    # 5 requests: the prefill and decode buckets hold 3 padding rows, which must touch no real row.
    prompts, adapters = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14], [15]], ["a", None, "b", "a", "b"]
    results = []
    for size, backend in [(1, truth), *splits]:
        engine = Engine.from_pretrained(f"{root}/m", dtype="float32", tensor_parallel=size, backend=backend,
                                        max_loras=2, max_lora_rank=8, device_cache_memory=1.0, progress=False)
        if size > 1:
            assert engine.runner.tp.vocab_parallel == (vocab % size == 0 and not tied)
        engine.load_adapter("a", f"{root}/a")  # every part: b's load adds none to the step
        for _ in range(2):  # compiled (twice: a first Pallas trace registers more JAX config)
            testing.compile_prefill(engine, prompts)
        compiled = forward._cache_size()
        engine.load_adapter("b", f"{root}/b")
        engine.prefill_logits(prompts, adapters)
        assert forward._cache_size() == compiled, "an adapter load changed the slots' sharding: recompiled"
        compiled = generate_step._cache_size()
        with jax.transfer_guard_device_to_device("disallow"):  # no per-step copies between devices
            generated = [engine.generate(prompts, adapters, max_new_tokens=6),  # greedy; sampled (nucleus), with
                         engine.generate(prompts, adapters, max_new_tokens=6, temperature=0.8, top_p=0.9, seed=5,
                                         repetition_penalty=1.3, presence_penalty=0.4)]  # penalties: the history
        if size > 1:  # a prefill and a decode step per variant (one device also keys host tokens apart, uncompiled)
            assert generate_step._cache_size() - compiled == 4, "a decode step compiled twice"
        scores = engine.score(prompts, [[7, 8, 9]] * len(prompts), adapters)  # log_softmax over split logits
        with_logprobs = engine.generate(prompts, adapters, max_new_tokens=4, logprobs=3)
        # Two requests that outgrow a pool of 4 blocks: one is preempted (its blocks to host memory and back).
        preempted = [Request(list(range(1, 11)), -1, 30, 0.9, seed=1), Request(list(range(5, 15)), -1, 30, seed=2)]
        assert drive(Batcher(engine.runner, 2, 64, block_size=16, num_blocks=4), preempted).preemptions >= 1
        generated.append([r.out for r in preempted])
        # A third adapter evicts one of the two; the logits below write it back from the device cache, placed
        # over the devices as its slot holds it, without another copy.
        engine.register_adapter("c", f"{root}/b")
        engine.prefill_logits([[1, 2]], ["c"])
        copies, copied = [], engine.pool._copied
        engine.pool._copied = lambda prepared: (copies.append(prepared), copied(prepared))[1]
        results.append((engine.prefill_logits(prompts, adapters), generated, scores, with_logprobs))
        assert not copies and engine.pool.evictions >= 2
    (logits_1, gen_1, scores_1, lp_1) = results[0]
    for logits_tp, gen_tp, scores_tp, lp_tp in results[1:]:
        for one, many in zip(logits_1, logits_tp):
            np.testing.assert_allclose(many, one, rtol=1e-4, atol=1e-4)
        for one, many in zip(scores_1, scores_tp):
            np.testing.assert_allclose(many.token_logprobs, one.token_logprobs, atol=1e-4)
        for one, many in zip(lp_1, lp_tp):
            assert list(many) == list(one) and [t.top[0][0] for t in many.logprobs] == [t.top[0][0] for t in one.logprobs]
            np.testing.assert_allclose([t.logprob for t in many.logprobs], [t.logprob for t in one.logprobs], atol=1e-4)
        # Sampling on vocabulary-split logits draws what one device draws (JAX's random bits ignore sharding).
        assert [[list(g) for g in run] for run in gen_1] == [[list(g) for g in run] for run in gen_tp]
    print("ok")


@pytest.mark.slow  # each case compiles an engine per split and one for the truth, in a subprocess
@pytest.mark.parametrize("kv_heads, truth, splits, vocab, tied", [
    # KV heads split evenly (1 and 2 a device); the lm_head replicated as it is tied to the embedding
    pytest.param(4, "reference", [(4, "reference"), (2, "ragged")], 96, True, id="kv4-tied-tp4-reference-tp2-ragged"),
    # KV heads replicated at TP 4; the lm_head split along the vocabulary; the Pallas kernels
    pytest.param(2, "reference", [(4, "reference"), (2, "pallas")], 96, False, id="kv2-tp4-reference-tp2-pallas"),
    # one KV head on every device; the lm_head replicated as 95 is no multiple of 4
    pytest.param(1, "gather", [(4, "gather")], 95, False, id="kv1-vocab95-tp4-gather"),
])
def test_tensor_parallel_matches_single_device(kv_heads, truth, splits, vocab, tied):
    code = f"from tests.test_parallel import compare; compare({kv_heads}, {truth!r}, {splits!r}, {vocab}, {tied})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env=cpu_devices_env(4))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def peft_features(base: str, tp: int, backend: str, max_batch: int) -> None:
    """Runs in the subprocess: every adapter of the PEFT fixtures (LoRA bias, DoRA, row overrides, added tokens,
    LongLoRA) under TP=tp against PEFT's own logits and greedy tokens, all in one mixed batch (max_batch 1: the
    weights [out, in], split along their rows or columns as they are stored, generating one row at a time; on the
    Pallas kernels its one-token steps add the residual in the norms' kernel, under shard_map). DoRA's norms are
    over the whole weight; a LoRA bias of a row-parallel layer is added once."""
    from unittest import mock

    from jlora.engine import Engine
    from jlora.models import llama
    from tests.models.test_peft_fixtures import FIXTURES, expected
    from tests.oracle import rel_err

    cases, arrays = expected(base)
    engine = Engine.from_pretrained(f"{FIXTURES}/{base}/model", dtype="float32", tensor_parallel=tp, backend=backend,
                                    max_loras=len(cases), max_lora_rank=16, max_seq_len=64, max_extra_vocab=8,
                                    max_batch=max_batch, progress=False)
    assert engine.model_config.weights_out_in == (max_batch == 1)
    assert not engine.runner.tp.vocab_parallel  # vocab 83 is odd and qwen2_tied is tied: row overrides allowed
    names = [n for n in cases if n != "base"]
    for name in names:
        engine.load_adapter(name, f"{FIXTURES}/{base}/{name}")
    requests = [(p, None if n == "base" else n, n, i) for n in cases for i, p in enumerate(cases[n]["prompts"])]
    got = engine.prefill_logits([r[0] for r in requests], [r[1] for r in requests])
    for (_, _, name, i), logits in zip(requests, got):
        assert rel_err(logits, arrays[f"{name}/{i}"]) < 1e-4, (name, i)
    added, add_rms_norm = [], llama.add_rms_norm
    with mock.patch.object(llama, "add_rms_norm", lambda *args: added.append(1) or add_rms_norm(*args)):
        out = engine.generate([r[0] for r in requests], [r[1] for r in requests], max_new_tokens=6)
    assert [list(t) for t in out] == [cases[n]["greedy"][i] for _, _, n, i in requests]
    assert bool(added) == (backend == "pallas" and max_batch == 1)
    print("ok")


@pytest.mark.slow
@pytest.mark.parametrize("base, tp, backend, max_batch", [("llama", 2, "pallas", 1), ("qwen2_tied", 4, "gather", 8)])
def test_tensor_parallel_peft_features(base, tp, backend, max_batch):
    env = cpu_devices_env(4)
    code = (f"from tests.test_parallel import peft_features; "
            f"peft_features({base!r}, {tp}, {backend!r}, {max_batch})")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def load_peak(root: str) -> None:
    """Runs in the subprocess (GPU): loads a checkpoint split over 2 GPUs; the first GPU's peak memory must stay
    below the whole model's bytes, as the checkpoint is converted in host memory. It holds half of every layer
    and of the lm_head, the replicated embedding, and one q|k|v or gate|up tensor while its columns are permuted
    (0.81x of the model on an H200 pair while the lm_head was replicated), against 2.43x when the model was
    loaded onto the first GPU."""
    import jax

    from jlora import testing
    from jlora.engine import Engine

    cfg = testing.tiny_config("llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                              num_attention_heads=16, num_key_value_heads=8)
    testing.write_model(root, cfg)
    engine = Engine.from_pretrained(root, dtype="bfloat16", tensor_parallel=2, max_loras=1, max_lora_rank=8,
                                    progress=False)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.runner.params))  # global sizes, bf16
    peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    assert peak < model_bytes, (peak, model_bytes)
    assert len(engine.generate([[1, 2, 3]], [None], max_new_tokens=4)[0]) == 4
    print("ok")


@pytest.mark.gpu
def test_tensor_parallel_load_never_holds_the_whole_model_on_one_gpu(tmp_path):
    import jax

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    code = f"from tests.test_parallel import load_peak; load_peak({str(tmp_path / 'm')!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_tensor_parallel_errors():
    from jlora import testing
    from jlora.models.config import ModelConfig
    from jlora.parallel import TensorParallel

    cfg = ModelConfig.from_hf_config(testing.tiny_config("llama", num_attention_heads=4, num_key_value_heads=4))
    with pytest.raises(ValueError, match="needs 3 devices"):
        TensorParallel.create(cfg, 3)
    with pytest.raises(ValueError, match="must divide num_heads=4"):
        TensorParallel.create(cfg, 3, devices=[object()] * 3)
