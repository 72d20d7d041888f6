"""The model against merged weights, checkpoint loading, and the KV cache."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES
from jlora.engine import Engine
from jlora.runner import forward, pack_prompts
from jlora.step import Call, StepOptions
from jlora.batch_info import LoRABatchInfo
from jlora.models.config import ModelConfig
from jlora.models.llama import Batch, CallOptions, Group, KVCache, LoRAInput
from jlora.pallas.decode_attention import NewToken
from jlora.pallas.rms_norm import add_rms_norm
from tests import oracle

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33]]

MODELS = {
    "llama": testing.tiny_config("llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "mistral": testing.tiny_config("mistral", head_dim=32),  # head_dim != hidden / heads
    "qwen2": testing.tiny_config("qwen2", num_key_value_heads=1),  # q/k/v bias, one KV head
    "tied": testing.tiny_config("qwen2", tie_word_embeddings=True),
}
# A sliding window of 3 positions in layer 1 only (Qwen2's max_window_layers): shorter than the prompts.
QWEN2_WINDOW = testing.tiny_config("qwen2", sliding_window=3, use_sliding_window=True, max_window_layers=1)
# A hidden size the Pallas RMSNorm cannot tile (not a power of two) beside a head_dim the decode attention can.
ODD_HIDDEN = testing.tiny_config("llama", hidden_size=96, num_attention_heads=6, head_dim=16)
ADAPTERS = {  # name: (write_adapter kwargs); embed/lm_head LoRA only on untied models
    "small": dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    "all_rslora": dict(r=16, alpha=16, target_modules=LINEAR_MODULES, use_rslora=True),
    "patterns": dict(r=8, alpha=16, target_modules=LINEAR_MODULES, rank_pattern={"down_proj": 2, r"layers\.1\.self_attn\.o_proj": 12},
                     alpha_pattern={"q_proj": 4}, layers_to_transform=[1]),
    "regex_mlp": dict(r=8, alpha=32, target_modules=r".*\.mlp\.(gate|up)_proj"),
    "emb_head": dict(r=8, alpha=8, target_modules=["k_proj"], embeddings=True, lm_head=True),
}


def _model(tmp_path, kind):
    path = str(tmp_path / kind)
    testing.write_model(path, MODELS[kind], seed=1)
    return path


@pytest.mark.parametrize("kind, backend", [(k, "auto") for k in MODELS] + [("llama", "pallas"), ("qwen2", "ragged")])
def test_lora_logits_equal_merged_weights(tmp_path, kind, backend):
    model_dir = _model(tmp_path, kind)
    engine = Engine.from_pretrained(model_dir, max_loras=4, max_lora_rank=16, dtype="float32", backend=backend,
                                    progress=False)
    names = [n for n in ADAPTERS if not (kind == "tied" and n == "emb_head")][:4]
    for i, name in enumerate(names):
        testing.write_adapter(str(tmp_path / name), MODELS[kind], seed=10 + i, **ADAPTERS[name])
        engine.load_adapter(name, str(tmp_path / name))
    requests = names + [None]  # several adapters and a base-only request in one batch
    logits = engine.prefill_logits(PROMPTS, requests)
    base = engine.prefill_logits(PROMPTS, [None] * len(PROMPTS))  # runs without the LoRA ops: another program
    # The base-only request beside other adapters: the same program as `logits`, so bit for bit.
    beside_other = engine.prefill_logits(PROMPTS, [names[0]] + [None] * (len(PROMPTS) - 1))
    for prompt, name, out, out_base in zip(PROMPTS, requests, logits, base):
        if name is None:
            np.testing.assert_array_equal(out, beside_other[-1])
            np.testing.assert_allclose(out, out_base, rtol=1e-5, atol=1e-5)
            continue
        merged_dir = str(tmp_path / f"merged_{name}")
        testing.merge_adapter(model_dir, str(tmp_path / name), merged_dir)
        merged = Engine.from_pretrained(merged_dir, max_loras=1, max_lora_rank=16, dtype="float32", progress=False)
        (ref,) = merged.prefill_logits([prompt], [None])
        assert np.abs(out - out_base).max() > 1e-2, f"adapter {name} changed nothing"
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_sharded_checkpoint_round_trip(tmp_path):
    cfg = MODELS["llama"]
    testing.write_model(str(tmp_path / "one"), cfg, seed=3)
    testing.write_model(str(tmp_path / "sharded"), cfg, seed=3, shards=3)
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    one = Engine.from_pretrained(str(tmp_path / "one"), dtype="float32", progress=False)
    sharded = Engine.from_pretrained(str(tmp_path / "sharded"), dtype="float32", progress=False)
    np.testing.assert_array_equal(one.prefill_logits(PROMPTS[:2], [None, None])[0],
                                  sharded.prefill_logits(PROMPTS[:2], [None, None])[0])


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine.from_pretrained(str(tmp_path / "nope"), progress=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text(json.dumps(MODELS["llama"]))
    (bin_dir / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="PyTorch pickle"):
        Engine.from_pretrained(str(bin_dir), progress=False)
    model_dir = _model(tmp_path, "llama")
    cfg = dict(MODELS["llama"], hidden_size=32)
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match the config"):
        Engine.from_pretrained(model_dir, progress=False)
    (tmp_path / "llama" / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        Engine.from_pretrained(model_dir, progress=False)


def _config_edit(**changes):
    def edit(model_dir):
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump({k: v for k, v in {**cfg, **changes}.items() if v is not _DROP}, f)
    return edit


def _write(name, data):
    def edit(model_dir):
        content = data(model_dir) if callable(data) else data  # read before the file is opened for writing
        with open(os.path.join(model_dir, name), "wb") as f:
            f.write(content)
    return edit


def _truncated(model_dir, name="model.safetensors"):
    with open(os.path.join(model_dir, name), "rb") as f:
        return f.read()[:-100]  # the header reads; the data it promises is not all there


def _retyped(model_dir, name, dtype):
    """The checkpoint's bytes with tensor `name` stored as `dtype`."""
    from safetensors.flax import load_file, save
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    tensors[name] = tensors[name].astype(jnp.dtype(dtype))
    return save(tensors)


_DROP = object()
# A broken checkpoint, each a ValueError naming the file or the field (the CLI prints it as one line).
BROKEN = {
    "config not JSON": (_write("config.json", b"{oops"), "config.json is not valid JSON"),
    "config a list": (_write("config.json", b"[1]"), "config.json must hold a JSON object"),
    "no vocab_size": (_config_edit(vocab_size=_DROP), "config.json has no 'vocab_size'"),
    "a string hidden_size": (_config_edit(hidden_size="64"), "'hidden_size' must be a positive integer, got '64'"),
    "zero layers": (_config_edit(num_hidden_layers=0), "'num_hidden_layers' must be a positive integer"),
    "KV heads not dividing heads": (_config_edit(num_key_value_heads=3),
                                    "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    "hidden not a multiple of heads": (_config_edit(num_attention_heads=5, num_key_value_heads=5),
                                       "hidden_size=64 is not a multiple of num_attention_heads=5"),
    "llama3 rope scaling without its factor": (
        _config_edit(rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
        "llama3 rope scaling needs finite positive numbers factor, "),
    "a quantized checkpoint": (_config_edit(quantization_config={"quant_method": "fp8"}),
                               r"a quantized checkpoint \(fp8\) is not supported"),
    "an fp8 weight": (_write("model.safetensors", lambda d: _retyped(d, "model.layers.0.mlp.up_proj.weight",
                                                                    "float8_e4m3fn")),
                      "tensor 'model.layers.0.mlp.up_proj.weight' is F8_E4M3"),
    "an int8 weight": (_write("model.safetensors", lambda d: _retyped(d, "model.norm.weight", "int8")),
                       "tensor 'model.norm.weight' is I8: jlora loads BF16, F16 or F32 weights"),
    "a gelu activation": (_config_edit(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    "llama attention biases": (_config_edit(attention_bias=True), "attention_bias true is not supported for llama"),
    "llama MLP biases": (_config_edit(mlp_bias=True), "mlp_bias true is not supported for llama"),
    "a string sliding window": (_config_edit(model_type="mistral", sliding_window="8"),
                                "'sliding_window' must be a positive integer or null"),
    "a truncated safetensors": (_write("model.safetensors", _truncated), "model.safetensors: cannot read safetensors"),
    "garbage safetensors": (_write("model.safetensors", b"\xff" * 64), "model.safetensors: cannot read safetensors"),
    "a broken tokenizer.json": (_write("tokenizer.json", b'{"model": '), "tokenizer.json: cannot read the tokenizer"),
}


@pytest.mark.parametrize("hf, window, layers", [
    (testing.tiny_config("llama", sliding_window=8), None, ()),  # HF's Llama has no window
    (testing.tiny_config("mistral", sliding_window=8), 8, (0, 1)),
    (testing.tiny_config("mistral", sliding_window=None), None, ()),
    (testing.tiny_config("qwen2", sliding_window=8), None, ()),  # use_sliding_window defaults to false
    (testing.tiny_config("qwen2", sliding_window=8, use_sliding_window=True), None, ()),  # max_window_layers 28
    (testing.tiny_config("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1), 8, (1,)),
    (testing.tiny_config("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=0), 8, (0, 1)),
    (testing.tiny_config("qwen2", sliding_window=8, use_sliding_window=True,
                         layer_types=["sliding_attention", "full_attention"]), 8, (0,)),
])
def test_sliding_windows_are_read_as_hf_reads_them(hf, window, layers):
    config = ModelConfig.from_hf_config(hf)
    assert [config.window(i) for i in range(2)] == [window if i in layers else None for i in range(2)]


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_checkpoint_is_an_error_naming_what_is_wrong(tmp_path, case):
    edit, message = BROKEN[case]
    model_dir = _model(tmp_path, "llama")
    edit(model_dir)
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(model_dir, progress=False)


def test_a_broken_sharded_checkpoint_is_an_error_naming_the_file(tmp_path):
    model_dir = str(tmp_path / "sharded")
    testing.write_model(model_dir, MODELS["llama"], seed=3, shards=2)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    with open(index) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[0]
    os.rename(os.path.join(model_dir, shard), os.path.join(model_dir, "moved"))
    with pytest.raises(ValueError, match=f"{shard}: cannot read safetensors \\(FileNotFoundError"):
        Engine.from_pretrained(model_dir, progress=False)
    for text, message in ((b'{"metadata": {}}', "must hold a 'weight_map' object"),
                          (b'{"weight_map": {"x": 5}}', "must hold a 'weight_map' object"),
                          (b"[1]", "index.json must hold a JSON object"), (b"{", "index.json is not valid JSON")):
        with open(index, "wb") as f:
            f.write(text)
        with pytest.raises(ValueError, match=message):
            Engine.from_pretrained(model_dir, progress=False)


@pytest.mark.parametrize("kind, backend", [  # pallas: decode steps in the decode-attention kernel, norms in theirs
    ("mistral", "auto"), ("mistral", "pallas"), ("odd_hidden", "pallas"), ("qwen2_window", "auto"),
    ("qwen2_window", "pallas")])
def test_prefill_then_decode_matches_full_forward(tmp_path, kind, backend):
    config = {"odd_hidden": ODD_HIDDEN, "qwen2_window": QWEN2_WINDOW}.get(kind) or MODELS[kind]
    model_dir = str(tmp_path / kind)
    testing.write_model(model_dir, config, seed=1)
    testing.write_adapter(str(tmp_path / "a"), config, seed=5, r=8, alpha=16, target_modules=LINEAR_MODULES)
    engine = Engine.from_pretrained(model_dir, max_loras=2, max_lora_rank=8, dtype="float32", progress=False,
                                    backend=backend)
    engine.load_adapter("a", str(tmp_path / "a"))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]
    full = engine.prefill_logits(prompts, ["a", None])
    # Prefill the first 4 tokens, then feed tokens 4..7 one by one through the cache.
    max_seq, split = 16, 4
    slot = np.array([engine.pool.slot("a"), -1], np.int32)
    cache = KVCache.zeros(engine.model_config, 2, max_seq, engine.runner.dtype)
    tokens = np.array([p[:split] for p in prompts], np.int32)
    positions = np.broadcast_to(np.arange(split, dtype=np.int32), (2, split))
    logits, cache = engine.runner.run(tokens, positions, np.repeat(slot, split), cache)
    steps = [np.asarray(logits)]
    for pos in range(split, 8):
        tok = np.array([[p[pos]] for p in prompts], np.int32)
        logits, cache = engine.runner.run(tok, np.full((2, 1), pos, np.int32), slot, cache)
        steps.append(np.asarray(logits))
    decoded = np.concatenate(steps, axis=1)
    for i in range(2):
        np.testing.assert_allclose(decoded[i], full[i], rtol=1e-4, atol=1e-4)


def test_one_token_steps_over_out_in_weights_add_in_the_norms_kernel(tmp_path):
    """An engine of max_batch 1 on the Pallas kernels (its weights [out, in]): each one-token step runs every
    residual add in the norm kernel after it (`residual_add_in_norm`; 2 a layer, the last one's second in the final
    norm's), and decodes
    the logits a full forward computes, with an adapter and without; a prompt's call keeps its adds apart."""
    from unittest import mock

    from jlora.models import llama

    model_dir = _model(tmp_path, "llama")
    testing.write_adapter(str(tmp_path / "a"), MODELS["llama"], seed=5, r=8, alpha=16, target_modules=LINEAR_MODULES)
    engine = Engine.from_pretrained(model_dir, max_batch=1, max_loras=1, max_lora_rank=8, dtype="float32",
                                    backend="pallas", progress=False)
    engine.load_adapter("a", str(tmp_path / "a"))
    assert engine.model_config.weights_out_in
    calls = []
    spy = lambda x, h, w, eps: calls.append(x.shape[0]) or add_rms_norm(x, h, w, eps)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for adapter in ("a", None):
        full = engine.prefill_logits([prompt], [adapter])[0]
        slot = np.array([engine.pool.slot(adapter) if adapter else -1], np.int32)
        cache = KVCache.zeros(engine.model_config, 1, 16, engine.runner.dtype)
        with mock.patch.object(llama, "add_rms_norm", spy):  # traced here: the engine's steps compile in these calls
            logits, cache = engine.runner.run(np.array([prompt[:4]], np.int32), np.arange(4, dtype=np.int32)[None],
                                              np.repeat(slot, 4), cache)
            steps = [np.asarray(logits)]
            for pos in range(4, 8):
                logits, cache = engine.runner.run(np.array([[prompt[pos]]], np.int32), np.full((1, 1), pos, np.int32),
                                                  slot, cache)
                steps.append(np.asarray(logits))
        np.testing.assert_allclose(np.concatenate(steps, axis=1)[0], full, rtol=1e-4, atol=1e-4)
    layers = MODELS["llama"]["num_hidden_layers"]
    # one trace of the decode step each, base and adapter: the adds after attention and the MLP, but the last
    # layer's MLP output is added in the final norm's kernel
    assert calls == [1] * (2 * layers) * 2, (len(calls), layers)


def test_projections_without_lora_run_in_the_pallas_kernels(tmp_path, monkeypatch):
    """In bfloat16 on the Pallas kernels, a call of 16-64 tokens runs each q|k|v, o and down projection that has no
    LoRA in it in a kernel of ours, o's and down's with the residual add after them (`projections_in_kernel`),
    prefills, decode and mixed steps alike (a mixed step's tokens need not be a power of two), and computes the
    logits XLA's GEMMs and adds do, within bfloat16's rounding;
    a projection some loaded adapter targets keeps XLA's form in a call with adapters (its delta is added before
    the residual, as PEFT adds it), and a call of other sizes uses none. On every device kind: the H100's range
    (`KERNEL_TOKENS` left empty; an H200 runs them at 36-64 tokens, the test below)."""
    from unittest import mock

    from jlora.models import llama

    monkeypatch.setattr(llama, "KERNEL_TOKENS", {})

    cfg = testing.tiny_config("llama", hidden_size=256, intermediate_size=512, vocab_size=100)  # sizes they tile
    testing.write_model(str(tmp_path / "m"), cfg, seed=3)
    testing.write_adapter(str(tmp_path / "qv"), cfg, r=4, alpha=8, seed=1, target_modules=["q_proj", "v_proj"])
    testing.write_adapter(str(tmp_path / "od"), cfg, r=4, alpha=8, seed=2, target_modules=["o_proj", "down_proj"])
    engine = Engine.from_pretrained(str(tmp_path / "m"), dtype="bfloat16", backend="pallas", max_loras=2,
                                    max_lora_rank=4, max_seq_len=64, max_batch=32, progress=False)
    engine.load_adapter("qv", str(tmp_path / "qv"))
    calls, kernels = [], (llama.matmul, llama.matmul_add)
    spies = [mock.patch.object(llama, f.__name__, lambda *args, f=f: calls.append((args[0].shape[0], f.__name__,
                                                                                   args[1].shape)) or f(*args))
             for f in kernels]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 100, 40).tolist()

    def traced(run):
        calls.clear()
        with spies[0], spies[1]:  # the engine's steps trace inside, where they compile
            return run()

    logits = lambda adapter, tokens=prompt: traced(lambda: engine.prefill_logits([tokens], [adapter])[0])
    qkv, o, down = ("matmul", (256, 256 + 2 * 128)), ("matmul_add", (256, 256)), ("matmul_add", (512, 256))
    layer = lambda t, *projections: [(t, *p) for p in projections] * cfg["num_hidden_layers"]
    for adapter, projections in ((None, (qkv, o, down)), ("qv", (o, down))):
        fused = logits(adapter)
        assert calls == layer(64, *projections), adapter  # 40 tokens in a bucket of 64
        with mock.patch.object(llama, "projections_in_kernel", lambda tokens: False):
            apart = logits(adapter)
        assert oracle.rel_err(fused, apart) < 1e-2, adapter
    traced(lambda: (engine.generate([[t] for t in prompt[:32]], ["qv"] * 32, max_new_tokens=3),  # 32 rows
                    engine.generate([[t] for t in prompt[:2]], ["qv"] * 2, max_new_tokens=3)))  # 2 rows
    assert (32, *o) in calls and (32, *down) in calls and min(t for t, *_ in calls) >= 16  # 2 rows: XLA's
    assert any(t & (t - 1) for t, *_ in calls)  # a mixed step's rows and prompt tokens: rows masked in the tile
    engine.load_adapter("od", str(tmp_path / "od"))
    compiled = forward._cache_size()
    logits("qv")
    assert forward._cache_size() == compiled + 1 and calls == []  # traced again: every kernel's projection has LoRA
    logits(None, prompt[:20])  # a call of 32 tokens without adapters: the kernels
    assert calls == layer(32, qkv, o, down)


def test_the_projections_kernels_run_at_the_call_sizes_measured_faster_on_the_device():
    """`projections_in_kernel` by the device kind: an H200 at 36-64 tokens (XLA's split-K pair was the faster at
    16-32 there), an H100 and any other kind (a GH200, whose name holds "H200" but not as a word; the CPU here) at
    16-64."""
    from types import SimpleNamespace
    from unittest import mock

    import jax

    from jlora.models import llama

    sizes = (1, 8, 15, 16, 32, 35, 36, 48, 63, 64, 65, 128)
    for kind, runs in (("NVIDIA H200", (36, 48, 63, 64)), ("NVIDIA H200 NVL", (36, 48, 63, 64)),
                       ("NVIDIA H100 80GB HBM3", (16, 32, 35, 36, 48, 63, 64)),
                       ("NVIDIA GH200 480GB", (16, 32, 35, 36, 48, 63, 64)), ("cpu", (16, 32, 35, 36, 48, 63, 64))):
        with mock.patch.object(jax, "devices", lambda kind=kind: [SimpleNamespace(device_kind=kind)]):
            assert tuple(t for t in sizes if llama.projections_in_kernel(t)) == runs, kind


def test_a_biased_qkv_keeps_xlas_gemm_beside_o_and_down_in_the_kernels(tmp_path):
    """Qwen2's q|k|v has a bias, which the kernels do not add: q|k|v stays XLA's GEMM and bias, o and down run in
    `matmul_add`, and the logits are XLA's within bfloat16's rounding."""
    from unittest import mock

    from jlora.models import llama

    cfg = testing.tiny_config("qwen2", hidden_size=256, intermediate_size=512, vocab_size=100)
    testing.write_model(str(tmp_path / "m"), cfg, seed=4)
    engine = Engine.from_pretrained(str(tmp_path / "m"), dtype="bfloat16", backend="pallas", max_loras=1,
                                    max_lora_rank=4, max_seq_len=64, progress=False)
    calls, matmul, matmul_add = [], llama.matmul, llama.matmul_add
    prompt = list(range(1, 41))
    with mock.patch.object(llama, "matmul", lambda *a: calls.append("matmul") or matmul(*a)), \
            mock.patch.object(llama, "matmul_add", lambda *a: calls.append("matmul_add") or matmul_add(*a)):
        fused = engine.prefill_logits([prompt], [None])[0]
    assert calls == ["matmul_add", "matmul_add"] * cfg["num_hidden_layers"]
    with mock.patch.object(llama, "projections_in_kernel", lambda tokens: False):
        apart = engine.prefill_logits([prompt], [None])[0]
    assert oracle.rel_err(fused, apart) < 1e-2


def test_decode_steps_rope_and_write_in_the_attention_kernel_unless_lora_adds_its_delta_apart(tmp_path):
    """Decode steps on the Pallas kernels hand the attention kernel q|k|v before RoPE (`rope_in_attention`, a
    `NewToken`), except where the Pallas LoRA kernels write q|k|v's delta for XLA to add (an explicit "pallas"
    backend with an adapter: there XLA rotates and writes); either way, and with the decision forced the other
    way, the steps decode the logits a full forward computes."""
    from unittest import mock

    from jlora.models import llama

    model_dir = _model(tmp_path, "llama")
    testing.write_adapter(str(tmp_path / "a"), MODELS["llama"], seed=6, r=8, alpha=16, target_modules=LINEAR_MODULES)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def decode(rule):
        """(whether each traced kernel call took a `NewToken`, rope_in_attention's arguments) under `rule`."""
        engine = Engine.from_pretrained(model_dir, max_batch=2, max_loras=1, max_lora_rank=8, dtype="float32",
                                        backend="pallas", progress=False)
        engine.load_adapter("a", str(tmp_path / "a"))
        asked, kinds, attend = [], [], llama.decode_attention
        spy_attention = lambda q, *args, **kw: kinds.append(isinstance(q, NewToken)) or attend(q, *args, **kw)
        spy_rule = lambda apart: asked.append(apart) or rule(apart)
        for adapter in ("a", None):
            full = engine.prefill_logits([prompt], [adapter])[0]
            slots = np.array([engine.pool.slot(adapter) if adapter else -1] * 2, np.int32)
            cache = KVCache.zeros(engine.model_config, 2, 16, engine.runner.dtype)
            with mock.patch.object(llama, "rope_in_attention", spy_rule), \
                    mock.patch.object(llama, "decode_attention", spy_attention):
                tokens = np.array([prompt[:4]] * 2, np.int32)
                logits, cache = engine.runner.run(tokens, np.tile(np.arange(4, dtype=np.int32), (2, 1)),
                                                  np.repeat(slots, 4), cache)
                steps = [np.asarray(logits)]
                for pos in range(4, 8):
                    logits, cache = engine.runner.run(np.full((2, 1), prompt[pos], np.int32),
                                                      np.full((2, 1), pos, np.int32), slots, cache)
                    steps.append(np.asarray(logits))
            for row in np.concatenate(steps, axis=1):
                np.testing.assert_allclose(row, full, rtol=1e-4, atol=1e-4)
        return kinds, asked

    layers = MODELS["llama"]["num_hidden_layers"]
    kinds, asked = decode(llama.rope_in_attention)  # one trace of the decode step each, adapter then base
    assert asked == [True] * layers + [False] * layers
    assert kinds == [False] * layers + [True] * layers
    kinds, _ = decode(lambda apart: True)  # the delta added by XLA before the kernel rotates
    assert kinds == [True] * (2 * layers)


def test_base_first_reorders_the_schedule_not_the_numbers(tmp_path):
    """`base_first` (the engine's decode steps) adds an optimization barrier at each projection an adapter targets
    where the LoRA runs in XLA (auto is reference on CPU, gather on GPU), none where it runs the Pallas kernels,
    none where the projections are row reductions (one token over [out, in]: `base_first_projection`), and leaves
    the logits as they were."""
    kind = "llama"
    engine = Engine.from_pretrained(_model(tmp_path, kind), max_loras=2, max_lora_rank=16, dtype="float32",
                                    progress=False)
    testing.write_adapter(str(tmp_path / "a"), MODELS[kind], seed=3, **ADAPTERS["all_rslora"])
    engine.load_adapter("a", str(tmp_path / "a"))
    config = engine.model_config
    slots = jnp.asarray([0, -1, 0], jnp.int32)
    tokens = jnp.asarray([[3], [5], [7]], jnp.int32)
    positions = jnp.asarray([[2], [4], [0]], jnp.int32)
    call = Call(Batch.of(tokens, positions), slots, jnp.asarray(engine.pool.ranks))
    args = (engine.runner.model_def, engine.runner.params, call)
    outs, texts = {}, {}
    for base_first in (False, True):
        cache = KVCache.zeros(config, 3, 8, jnp.float32)
        options = StepOptions(16, "auto", base_first=base_first)
        texts[base_first] = forward.with_options({}).lower(*args, cache, engine.pool.weights, options).as_text()
        outs[base_first] = np.asarray(forward(*args, cache, engine.pool.weights, options)[0])
    targeted = len(engine.pool.weights.layers[0].a)
    assert targeted == 4  # q|k|v, o, gate|up, down
    assert texts[False].count("optimization_barrier") == 0
    assert texts[True].count("optimization_barrier") == targeted * config.num_layers
    np.testing.assert_allclose(outs[True], outs[False], rtol=1e-6, atol=1e-6)
    for backend, barriers in (("gather", targeted), ("pallas", 0)):  # what auto picks on a GPU
        cache = KVCache.zeros(config, 3, 8, jnp.float32)
        options = StepOptions(16, backend, base_first=True)
        text = forward.with_options({}).lower(*args, cache, engine.pool.weights, options).as_text()
        assert text.count("optimization_barrier") == barriers * config.num_layers, backend
    one = Engine.from_pretrained(_model(tmp_path, kind), max_batch=1, max_loras=2, max_lora_rank=16, dtype="float32",
                                 progress=False)  # its weights [out, in]
    one.load_adapter("a", str(tmp_path / "a"))
    assert one.model_config.weights_out_in
    call = Call(Batch.of(tokens[:1], positions[:1]), slots[:1], jnp.asarray(one.pool.ranks))
    cache = KVCache.zeros(config, 1, 8, jnp.float32)
    text = forward.with_options({}).lower(one.runner.model_def, one.runner.params, call, cache, one.pool.weights,
                                          StepOptions(16, "gather", base_first=True)).as_text()
    assert text.count("optimization_barrier") == 0


@pytest.mark.parametrize("backend", ["pallas"])  # decode group in the kernel; the engine's tests run the others
def test_a_mixed_call_decodes_and_prefills_pieces_as_full_forwards_do(tmp_path, backend):
    """One call with two groups: every cache row's decode token (two rows valid) and prompt pieces into two
    other rows (one prompt whole, one's first piece, its rest in a later call), logits at chosen tokens; each
    token's logits equal a full forward of its request's sequence."""
    model_dir = _model(tmp_path, "mistral")
    testing.write_adapter(str(tmp_path / "a"), MODELS["mistral"], seed=5, r=8, alpha=16, target_modules=LINEAR_MODULES)
    engine = Engine.from_pretrained(model_dir, max_loras=2, max_lora_rank=8, dtype="float32", progress=False,
                                    backend=backend)
    engine.load_adapter("a", str(tmp_path / "a"))
    a = engine.pool.slot("a")
    seqs = {1: ([3, 1, 4, 1, 5, 9, 2], a), 3: ([2, 7, 1, 8, 2, 8, 1], -1),  # row: (sequence, slot)
            0: ([5, 3, 5, 8, 9, 7, 9], a), 2: ([6, 2, 6, 4, 3, 3, 8, 3, 2], -1)}
    full = dict(zip(seqs, engine.prefill_logits([s for s, _ in seqs.values()], ["a" if t == a else None
                                                                              for _, t in seqs.values()])))
    model = engine.runner.model_def.merge(engine.runner.params)
    ranks, ones = engine.pool.ranks, np.ones(engine.pool.ranks.shape, np.float32)
    cache = KVCache.zeros(engine.model_config, 4, 16, jnp.float32)

    @jax.jit
    def run(cache, batch, slots):
        info = LoRABatchInfo.build(slots, ranks, ones)
        at = batch.logits_at
        head_info = None if at is None else LoRABatchInfo.build(slots[at], ranks, ones)
        return model(batch, cache, LoRAInput(engine.pool.step_weights, info, head_info), CallOptions(backend))

    def call(groups, logits_at):  # groups: (tokens, positions, valid, rows, slots)
        slots = np.concatenate([g[4].reshape(-1) for g in groups])
        groups = tuple(Group(*g[:3], tables=None if g[3] is None else g[3][:, None]) for g in groups)
        return run(cache, Batch(groups, logits_at), slots)

    def piece(rows, start, length):  # [B, length] pieces of rows' sequences from `start`
        tokens = np.array([seqs[r][0][start: start + length] for r in rows], np.int32)
        slots = np.array([[seqs[r][1]] * length for r in rows], np.int32)
        positions = np.broadcast_to(np.arange(start, start + length, dtype=np.int32), tokens.shape)
        return tokens, positions, np.ones(tokens.shape, bool), np.array(rows, np.int32), slots

    _, cache = call([piece([1, 3], 0, 5)], np.arange(2))
    tokens, positions, _, _, slots = piece([0, 1, 2, 3], 5, 1)  # every row's token at position 5
    decoding = np.array([[False], [True], [False], [True]])  # rows 0 and 2 do not decode yet
    decode = (tokens, positions, decoding, None, np.where(decoding, slots, -1))
    tokens, positions, slots, valid = pack_prompts([seqs[0][0], seqs[2][0][:4]], [a, -1])  # [2, 16]
    pieces = (tokens, positions, valid, np.array([0, 2], np.int32), slots)
    at = np.array([1, 3, 4 + 4, 4 + 6, 4 + 16 + 3])  # decode rows 1, 3; prompt tokens 4, 6; first piece's last
    logits, cache = call([decode, pieces], at)
    want = [full[1][5], full[3][5], full[0][4], full[0][6], full[2][3]]
    np.testing.assert_allclose(np.asarray(logits), np.stack(want), rtol=1e-4, atol=1e-4)
    rest, cache = call([piece([2], 4, 5)], None)  # the rest of row 2's prompt reads its first piece's cache
    np.testing.assert_allclose(np.asarray(rest)[0], full[2][4:], rtol=1e-4, atol=1e-4)
