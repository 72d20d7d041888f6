"""PEFT adapter validation and the slot pool: every bad input raises and leaves the pool as it was."""

import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

from jlora import testing
from jlora.adapters import AdapterError, PoolFullError
from jlora.engine import Engine
from jlora.runner import forward

CFG = testing.tiny_config("llama")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model"))
    testing.write_model(path, CFG, seed=2)
    return path


def _engine(model_dir, **kw):
    kw = {"max_loras": 2, "max_lora_rank": 8, "dtype": "float32", "progress": False} | kw
    return Engine.from_pretrained(model_dir, **kw)


def _snapshot(engine):
    return (engine.adapters, engine.pool.ranks.copy(), [np.asarray(x) for x in jax.tree.leaves(engine.pool.weights)])


def _assert_unchanged(engine, snap):
    names, ranks, leaves = snap
    assert engine.adapters == names
    np.testing.assert_array_equal(engine.pool.ranks, ranks)
    for before, after in zip(leaves, jax.tree.leaves(engine.pool.weights)):
        np.testing.assert_array_equal(before, np.asarray(after))


def _break_tensor(path, key_part, fn):
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    key = next(k for k in tensors if key_part in k)
    tensors = fn(tensors, key)
    save_file(tensors, file)


def _set(w: np.ndarray, index, value) -> np.ndarray:
    w = w.copy()
    w[index] = value
    return w


def _edit_config(path, **changes):
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


_Q = "base_model.model.model.layers.0.self_attn.q_proj"
_V = "base_model.model.model.layers.0.self_attn.v_proj"


def _add(path, drop=False, **new):
    """Adds tensors to the adapter file (`drop`: replaces its tensors)."""
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "adapter_model.safetensors")
    save_file(({} if drop else load_file(file)) | new, file)


def _claimed(path, shape, dtype="BF16"):
    """adapter_model.safetensors holding one tensor of `shape` (2 bytes a value, or 1 for a float8 `dtype`) whose
    data is a hole: a sparse file of any size, as a hostile header would point at."""
    size = int(np.prod(shape)) * (1 if dtype.startswith("F8") else 2)
    header = json.dumps({f"{_Q}.lora_A.weight": {"dtype": dtype, "shape": list(shape), "data_offsets": [0, size]}})
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header.encode())
        f.truncate(8 + len(header) + size)


def _replace_file(path, name, make):
    """File `name` of the adapter replaced by what `make(path)` makes there (a directory, a link, a pipe)."""
    os.remove(os.path.join(path, name))
    make(os.path.join(path, name))


BAD = {
    "missing dir": (lambda p: None, "adapter_config.json not found"),
    "missing weights": (lambda p: os.remove(os.path.join(p, "adapter_model.safetensors")), "adapter_model.safetensors not found"),
    "corrupt safetensors": (lambda p: open(os.path.join(p, "adapter_model.safetensors"), "wb").write(b"\x10garbage"),
                            "cannot read safetensors"),
    "a header that claims a 4 GB tensor": (lambda p: _claimed(p, (1 << 17, 1 << 14)),
                                           r"holds 2147483648 values, more than any LoRA weight of this model"),
    "more weights than an adapter holds": (lambda p: _add(p, drop=True, **{
        f"x.{i}.lora_A.weight": np.ones((8, 64), np.float32) for i in range(4000)}), "values in all, more than an "
                                           "adapter of this model up to max_lora_rank holds"),
    "rank too big": (lambda p: None, "rank 16 exceeds max_lora_rank=8"),
    "shape mismatch": (lambda p: _break_tensor(p, "q_proj.lora_A", lambda t, k: t | {k: t[k][:, :32]}),
                       "do not fit the base layer"),
    "unknown module": (lambda p: _break_tensor(p, "q_proj.lora_A", lambda t, k: t | {
        k.replace("q_proj", "r_proj"): t[k], k.replace("q_proj.lora_A", "r_proj.lora_B"): t[k.replace("lora_A", "lora_B")]}),
                       "unknown module 'model.layers.0.self_attn.r_proj'"),
    "layer out of range": (lambda p: _break_tensor(p, "layers.0.self_attn.q_proj.lora_A", lambda t, k: t | {
        k.replace("layers.0", "layers.7"): t[k], k.replace("layers.0", "layers.7").replace("lora_A", "lora_B"): t[k.replace("lora_A", "lora_B")]}),
                           "unknown module 'model.layers.7"),
    "int dtype": (lambda p: _break_tensor(p, "q_proj.lora_A", lambda t, k: t | {k: t[k].astype(np.int32)}),
                  "has dtype I32; LoRA weights must be floating"),
    "a float8 weight, which NumPy cannot hold": (lambda p: _claimed(p, (4, 64), "F8_E4M3"),
                                                 "has dtype F8_E4M3; LoRA weights must be floating"),
    "a directory in the weights' place": (lambda p: _replace_file(p, "adapter_model.safetensors", os.mkdir),
                                          "adapter_model.safetensors is not a regular file"),
    "a device in the weights' place": (lambda p: _replace_file(p, "adapter_model.safetensors",
                                                              lambda f: os.symlink("/dev/zero", f)),
                                       "adapter_model.safetensors is not a regular file"),
    "a pipe in the config's place": (lambda p: _replace_file(p, "adapter_config.json", os.mkfifo),
                                     "adapter_config.json is not a regular file"),
    "an inf weight": (lambda p: _break_tensor(p, "v_proj.lora_B", lambda t, k: t | {k: _set(t[k], (3, 1), np.inf)}),
                      r"v_proj.lora_B.weight' holds 1 non-finite values \(NaN or inf\)"),
    "NaN weights": (lambda p: _break_tensor(p, "q_proj.lora_A", lambda t, k: t | {k: _set(t[k], (slice(None), 0), np.nan)}),
                    "non-finite values"),
    "dora without magnitudes": (lambda p: _edit_config(p, use_dora=True), "use_dora=true but no lora_magnitude_vector"),
    "dora magnitude of a wrong length": (lambda p: (_edit_config(p, use_dora=True), _add(p, **{
        f"{_Q}.lora_magnitude_vector": np.ones(64, np.float32), f"{_V}.lora_magnitude_vector": np.ones(5, np.float32)})),
        r"v_proj: magnitude has shape \(5,\); the layer has 32 outputs"),
    "dora on the embedding": (lambda p: (_edit_config(p, use_dora=True, target_modules=["embed_tokens"]), _add(p, **{
        "base_model.model.model.embed_tokens.lora_embedding_A": np.ones((4, 96), np.float32),
        "base_model.model.model.embed_tokens.lora_embedding_B": np.ones((64, 4), np.float32),
        "base_model.model.model.embed_tokens.lora_magnitude_vector": np.ones(64, np.float32)}, drop=True)),
        "DoRA on the input embedding is not supported"),
    "modules_to_save of another layer": (lambda p: _edit_config(p, modules_to_save=["model.norm"]),
                                         "modules_to_save names a module other than the embedding layers"),
    "a bias without lora_bias": (lambda p: _add(p, **{f"{_Q}.lora_B.bias": np.ones(64, np.float32)}),
                                 "a lora_B bias but the config says lora_bias=false"),
    "more added tokens than max_extra_vocab": (lambda p: (_edit_config(p, modules_to_save=["embed_tokens"]), _add(p, **{
        "base_model.model.model.embed_tokens.weight": np.ones((96 + 257, 64), np.float32)})),
        "257 tokens past the base vocabulary of 96; the engine allows max_extra_vocab=256"),
    "trainable tokens outside the vocabulary": (lambda p: (_edit_config(p, trainable_token_indices=[3, 96]), _add(p, **{
        "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": np.ones((2, 64), np.float32)})),
        r"trainable_token_indices outside the vocabulary \[0, 96\)"),
    "trainable tokens without their rows": (lambda p: _edit_config(p, trainable_token_indices=[3]),
                                            "need a trainable_tokens_delta of shape"),
    "a LongLoRA context past max_seq_len": (lambda p: _edit_config(p, context_length=4096),
                                            "context_length 4096 exceeds the engine's max_seq_len 2048"),
    "rank disagrees with config": (lambda p: _edit_config(p, r=6), "rank 4 but the config says r=6"),
    "a string alpha": (lambda p: _edit_config(p, lora_alpha="16"), "'lora_alpha' must be a finite number"),
    "zero rank": (lambda p: _edit_config(p, r=0), "'r' must be a positive integer"),
    "a config nested 100k deep": (lambda p: open(os.path.join(p, "adapter_config.json"), "w").write(
        '{"r": 4, "lora_alpha": 8, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deeply"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_raises_and_leaves_pool_unchanged(tmp_path, model_dir, case):
    engine = _engine(model_dir)
    testing.write_adapter(str(tmp_path / "good"), CFG, r=4, alpha=8, seed=1)
    engine.load_adapter("good", str(tmp_path / "good"))
    snap = _snapshot(engine)
    bad = str(tmp_path / "bad")
    if case != "missing dir":
        testing.write_adapter(bad, CFG, r=16 if case == "rank too big" else 4, alpha=8, seed=2)
    mutate, match = BAD[case]
    mutate(bad)
    with pytest.raises(AdapterError, match=match):
        engine.load_adapter("bad", bad)
    _assert_unchanged(engine, snap)
    assert "bad" not in engine.adapters


def test_lru_eviction_refusal_and_unload(tmp_path, model_dir):
    """Slots evict the least recently used idle adapter; an evicted adapter stays registered and comes back
    into a slot when a call needs it."""
    for i in range(4):
        testing.write_adapter(str(tmp_path / f"a{i}"), CFG, r=4, alpha=8, seed=i)
    engine = _engine(model_dir)
    engine.load_adapter("a0", str(tmp_path / "a0"))
    engine.load_adapter("a1", str(tmp_path / "a1"))
    engine.prefill_logits([[1, 2]], ["a0"])  # a0 becomes the most recently used
    engine.load_adapter("a2", str(tmp_path / "a2"))  # evicts a1 from its slot
    assert sorted(engine.resident_adapters) == ["a0", "a2"] and engine.adapters == ["a0", "a1", "a2"]
    with pytest.raises(ValueError, match="already registered"):
        engine.load_adapter("a2", str(tmp_path / "a2"))
    engine.pool.hold(["a0", "a2"])
    with pytest.raises(PoolFullError, match="all in use"):
        engine.prefill_logits([[1, 2]], ["a1"])
    engine.pool.release(["a0", "a2"])
    want = engine.prefill_logits([[1, 2]], ["a1"])[0]  # back in a slot: a0's (least recently used)
    assert sorted(engine.resident_adapters) == ["a1", "a2"] and engine.pool.evictions == 2
    with pytest.raises(KeyError, match="unknown adapter"):
        engine.prefill_logits([[1, 2]], ["a3"])
    engine.unload_adapter("a2")
    assert engine.adapters == ["a0", "a1"] and engine.resident_adapters == ["a1"]
    fresh = _engine(model_dir)
    fresh.load_adapter("a1", str(tmp_path / "a1"))
    np.testing.assert_array_equal(want, fresh.prefill_logits([[1, 2]], ["a1"])[0])

    strict = _engine(model_dir, evict="refuse", max_loras=1)
    strict.load_adapter("a0", str(tmp_path / "a0"))
    with pytest.raises(PoolFullError, match="eviction is off"):
        strict.load_adapter("a1", str(tmp_path / "a1"))


def test_loads_and_mixes_do_not_recompile(tmp_path, model_dir):
    engine = _engine(model_dir, max_loras=3)
    names = []
    for i in range(5):
        testing.write_adapter(str(tmp_path / f"a{i}"), CFG, r=2 + i, alpha=8, seed=i, target_modules=["q_proj", "down_proj"])
    rng = np.random.default_rng(0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    engine.load_adapter("a0", str(tmp_path / "a0"))  # the parts every later adapter targets: in the variant
    testing.compile_prefill(engine, prompts)
    compiled = forward._cache_size()
    for i in range(1, 5):
        if len(engine.adapters) == 3:
            engine.unload_adapter(engine.adapters[0])
        engine.load_adapter(f"a{i}", str(tmp_path / f"a{i}"))
        names = engine.adapters + [None]
        engine.prefill_logits(prompts, [names[j] for j in rng.integers(0, len(names), 3)])
    assert forward._cache_size() == compiled


def test_a_step_runs_only_the_parts_adapters_target(tmp_path, model_dir):
    """Adapters of q_proj and v_proj: the step's weights hold the q|k|v group only (no other group, embedding or
    lm_head), and a request's logits are those of a step that holds every part (beside an adapter of every
    module, the embedding and the lm_head). A part stays in the step after the adapter that brought it leaves."""
    from jlora.adapters.peft import LINEAR_MODULES

    engine = _engine(model_dir)
    testing.write_adapter(str(tmp_path / "qv"), CFG, r=4, alpha=8, seed=1, target_modules=["q_proj", "v_proj"])
    testing.write_adapter(str(tmp_path / "all"), CFG, r=4, alpha=8, seed=2, target_modules=LINEAR_MODULES,
                          embeddings=True, lm_head=True)
    engine.load_adapter("qv", str(tmp_path / "qv"))
    w = engine.pool.step_weights
    assert all(set(layer.a) == set(layer.b) == {"qkv"} for layer in w.layers)
    assert w.embed_a is None and w.lm_head_a is None
    prompts = [[1, 2, 3, 4], [5, 6]]
    alone = engine.prefill_logits(prompts, ["qv", "qv"])
    engine.load_adapter("all", str(tmp_path / "all"))
    w = engine.pool.step_weights
    assert all(set(layer.a) == {"qkv", "o", "gate_up", "down"} for layer in w.layers)
    assert w.embed_a is not None and w.lm_head_a is not None
    mixed = engine.prefill_logits(prompts + prompts, ["qv", "qv", "all", "all"])
    for a, b in zip(alone, mixed[:2]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert not np.allclose(mixed[2], alone[0])
    engine.unload_adapter("all")
    assert engine.pool.step_weights.lm_head_a is not None


def test_an_adapter_written_over_one_that_targeted_more_zeroes_the_rest_of_its_slot(tmp_path, model_dir):
    """One slot: an adapter of every linear module, the embedding and the lm_head, then one of q_proj and v_proj
    written over it. The slot's other parts are zeros and the second adapter's logits are those of a fresh engine
    that only ever held it."""
    from jlora.adapters.peft import LINEAR_MODULES

    testing.write_adapter(str(tmp_path / "all"), CFG, r=4, alpha=8, seed=1, target_modules=LINEAR_MODULES,
                          embeddings=True, lm_head=True)
    testing.write_adapter(str(tmp_path / "qv"), CFG, r=4, alpha=8, seed=2)
    engine, fresh = _engine(model_dir, max_loras=1), _engine(model_dir, max_loras=1)
    engine.load_adapter("all", str(tmp_path / "all"))
    engine.prefill_logits([[1, 2]], ["all"])
    engine.load_adapter("qv", str(tmp_path / "qv"))  # evicts "all" from the one slot
    assert engine.resident_adapters == ["qv"]
    w = engine.pool.weights
    for layer in w.layers:
        for g in ("o", "gate_up", "down"):
            assert not np.asarray(layer.a[g][0]).any() and not np.asarray(layer.b[g][0]).any(), g
    assert not any(np.asarray(x[0]).any() for x in (w.embed_a, w.embed_b, w.lm_head_a, w.lm_head_b))
    fresh.load_adapter("qv", str(tmp_path / "qv"))
    prompts = [[1, 2, 3, 4], [5, 6]]
    # (a step that holds more groups compiles to other fusions: on the GPU equal within float32 rounding)
    for x, y in zip(engine.prefill_logits(prompts, ["qv", "qv"]), fresh.prefill_logits(prompts, ["qv", "qv"])):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_the_pool_holds_only_the_parts_some_adapter_targeted(tmp_path, model_dir):
    """A fresh pool holds no stacks; a q_proj + v_proj adapter adds q|k|v's alone; a later adapter of every
    linear module, the embedding and the lm_head adds the rest, zero in the first adapter's slot, whose logits
    stay what they were, and what an engine that only ever held it gives."""
    from jlora.adapters.peft import LINEAR_MODULES

    testing.write_adapter(str(tmp_path / "qv"), CFG, r=4, alpha=8, seed=2)
    testing.write_adapter(str(tmp_path / "all"), CFG, r=4, alpha=8, seed=1, target_modules=LINEAR_MODULES,
                          embeddings=True, lm_head=True)
    engine, fresh = _engine(model_dir, max_loras=2), _engine(model_dir, max_loras=1)
    held = lambda: (sorted(engine.pool.weights.layers[0].a), engine.pool.weights.embed_a is not None,
                    engine.pool.weights.lm_head_a is not None)
    assert held() == ([], False, False) and not jax.tree.leaves(engine.pool.weights) and engine.pool.nbytes == 0
    engine.load_adapter("qv", str(tmp_path / "qv"))
    assert held() == (["qkv"], False, False)
    r, h, d = engine.pool.rank, CFG["hidden_size"], CFG["hidden_size"] // CFG["num_attention_heads"]
    q_kv_v = (CFG["num_attention_heads"] + 2 * CFG["num_key_value_heads"]) * d
    assert engine.pool.nbytes == CFG["num_hidden_layers"] * 2 * (3 * r * h + q_kv_v * r) * 4  # 2 slots, float32
    prompts = [[1, 2, 3, 4], [5, 6]]
    before = engine.prefill_logits(prompts, ["qv", "qv"])
    engine.load_adapter("all", str(tmp_path / "all"))
    assert held() == (["down", "gate_up", "o", "qkv"], True, True)
    slot = engine.pool.slot("qv")
    w = engine.pool.weights
    for layer in w.layers:
        for g in ("o", "gate_up", "down"):
            assert not np.asarray(layer.a[g][slot]).any() and not np.asarray(layer.b[g][slot]).any(), g
    assert not any(np.asarray(x[slot]).any() for x in (w.embed_a, w.embed_b, w.lm_head_a, w.lm_head_b))
    fresh.load_adapter("qv", str(tmp_path / "qv"))
    # (a step that holds more groups compiles to other fusions: on the GPU equal within float32 rounding)
    after, alone = engine.prefill_logits(prompts, ["qv", "qv"]), fresh.prefill_logits(prompts, ["qv", "qv"])
    for x, y, z in zip(after, before, alone):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(x, z, rtol=1e-5, atol=1e-5)


def test_an_adapter_is_held_and_copied_at_its_rank_bucket_and_written_at_the_slots(tmp_path, model_dir):
    """An r=3 adapter (every linear module, the embedding and the lm_head) in r=64 slots: its host arrays and
    its staged copy are at rank 8 (`rank_bucket`), a slot gets them zero-padded to 64 with each fused slice's
    rows in place (from the staged copy, or from host arrays `install` stages), and its logits equal those in r=16 slots."""
    from jlora.adapters.peft import LINEAR_MODULES

    testing.write_adapter(str(tmp_path / "a"), CFG, r=3, alpha=8, seed=4, target_modules=LINEAR_MODULES,
                          embeddings=True, lm_head=True)
    wide, narrow = _engine(model_dir, max_lora_rank=64), _engine(model_dir, max_lora_rank=16)
    prepared = wide.pool.prepare(str(tmp_path / "a"))
    staged = wide.pool.stage(prepared)
    assert staged.staged and not prepared.staged
    for host, device in zip(prepared.host.layers, staged.host.layers):
        for g, (a, b) in host.items():
            slices = a.shape[0] // 8
            assert b.shape[1] == 8 and slices == {"qkv": 3, "gate_up": 2}.get(g, 1)
            for x, y in zip((a, b), device[g]):  # the one transfer split back into each array, bit for bit
                np.testing.assert_array_equal(np.asarray(y), x)
    assert prepared.host.embed[0].shape[0] == prepared.host.lm_head[0].shape[0] == 8
    for x, y in zip(prepared.host.embed + prepared.host.lm_head, staged.host.embed + staged.host.lm_head):
        np.testing.assert_array_equal(np.asarray(y), x)
    slot = wide.pool.install("a", staged)
    for layer, host in zip(wide.pool.weights.layers, prepared.host.layers):
        for g, (a, b) in host.items():
            slot_a, slot_b = np.asarray(layer.a[g][slot]), np.asarray(layer.b[g][slot])
            slices = a.shape[0] // 8
            want_a = np.zeros((slices, 64, a.shape[1]), np.float32)
            want_a[:, :8] = a.reshape(slices, 8, -1)
            np.testing.assert_array_equal(slot_a, want_a.reshape(slot_a.shape))
            np.testing.assert_array_equal(slot_b, np.pad(b, ((0, 0), (0, 56))))
    wide.pool.unload("a")  # and loaded again from its host arrays, the engine's way
    for engine in (wide, narrow):
        engine.load_adapter("a", str(tmp_path / "a"))
    prompts = [[1, 2, 3, 4], [5, 6]]
    for x, y in zip(wide.prefill_logits(prompts, ["a", "a"]), narrow.prefill_logits(prompts, ["a", "a"])):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_adapters_of_mixed_ranks_loaded_in_turn_into_one_wide_slot_generate_as_in_narrow_slots(tmp_path, model_dir):
    """Adapters with per-module ranks (rank_pattern: buckets 8 and 16) through `Engine.generate` with one r=64
    slot, so each is staged and written in turn over the one before: the tokens of r=16 slots holding all."""
    from jlora.adapters.peft import LINEAR_MODULES

    for i, (r, pattern) in enumerate([(3, {"v_proj": 16}), (16, {"q_proj": 2}), (5, {})]):
        testing.write_adapter(str(tmp_path / f"a{i}"), CFG, r=r, alpha=8, seed=10 + i, target_modules=LINEAR_MODULES,
                              rank_pattern=pattern)
    one_slot, narrow = _engine(model_dir, max_loras=1, max_lora_rank=64), _engine(model_dir, max_loras=3,
                                                                                    max_lora_rank=16)
    for i in range(3):
        one_slot.register_adapter(f"a{i}", str(tmp_path / f"a{i}"))
        narrow.load_adapter(f"a{i}", str(tmp_path / f"a{i}"))
    prompts, names = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10, 11, 12], [13, 14]], ["a0", "a1", "a2", "a1", "a0"]
    got = one_slot.generate(prompts, names, max_new_tokens=6)
    assert [list(g) for g in got] == [list(w) for w in narrow.generate(prompts, names, max_new_tokens=6)]
    assert one_slot.pool.evictions >= 2


def test_an_adapter_holds_and_copies_only_the_targeted_modules_rows(tmp_path, model_dir, monkeypatch):
    """Adapters over seeded random subsets of the linear modules (and of the layers, and with a rank of its own for
    one module): the host arrays hold only the rows of A and B of the targeted modules (q_proj + v_proj: not
    q|k|v's k rows), `stage` copies exactly those bytes, and a slot's copy holds the whole group, the other
    modules' slices zero and each targeted module's its weights as the adapter file has them."""
    from jlora.adapters.peft import LINEAR_MODULES
    from jlora.models.lora_weights import module_shapes

    engine = _engine(model_dir, max_lora_rank=16)
    copied = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put",
                        lambda x, *a, **k: copied.append(np.asarray(x).nbytes) or device_put(x, *a, **k))
    rng = np.random.default_rng(7)
    shapes = module_shapes(engine.pool.config)
    for case in range(6):
        modules = (["q_proj", "v_proj"] if case == 0
                   else sorted(rng.choice(LINEAR_MODULES, rng.integers(1, 7), replace=False)))
        extra = {"layers_to_transform": [int(rng.integers(CFG["num_hidden_layers"]))]} if case % 3 == 2 else {}
        rank = int(rng.choice([3, 8, 16]))
        if case % 2:  # one module at a rank of its own
            extra["rank_pattern"] = {modules[-1]: int(rng.choice([2, 5, 12]))}
        path = str(tmp_path / f"a{case}")
        testing.write_adapter(path, CFG, r=rank, alpha=8, seed=case, target_modules=modules, **extra)
        prepared = engine.pool.prepare(path)
        saved = safetensors.numpy.load_file(os.path.join(path, "adapter_model.safetensors"))
        copied.clear()
        staged = engine.pool.stage(prepared)
        held = 0
        for i, (host, device) in enumerate(zip(prepared.host.layers, staged.host.layers)):
            for g, (a, b) in host.items():
                outs = shapes[g][1]
                targeted = [j for j, (name, _) in enumerate(outs) if name in modules]
                assert prepared.host.slices.get((i, g), tuple(range(len(outs)))) == tuple(targeted)
                r = b.shape[1]
                assert a.shape[0] == len(targeted) * r and b.shape[0] == sum(outs[j][1] for j in targeted)
                held += a.nbytes + b.nbytes
                whole_a, whole_b = (np.asarray(x) for x in device[g])
                assert whole_a.shape[0] == len(outs) * r and whole_b.shape[0] == sum(n for _, n in outs)
                for x, y in zip(prepared.host.group(i, g, outs), (whole_a, whole_b)):  # DoRA's and TP's whole group
                    np.testing.assert_array_equal(x, y)
                starts, at = np.cumsum([0] + [n for _, n in outs]), np.cumsum([0] + [outs[j][1] for j in targeted])
                for j, (name, _) in enumerate(outs):
                    slice_a, slice_b = whole_a[j * r : (j + 1) * r], whole_b[starts[j] : starts[j + 1]]
                    if j not in targeted:
                        assert not slice_a.any() and not slice_b.any()
                        continue
                    p = targeted.index(j)
                    np.testing.assert_array_equal(slice_a, a[p * r : (p + 1) * r])
                    np.testing.assert_array_equal(slice_b, b[at[p] : at[p + 1]])
                    parent = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                    key = f"base_model.model.model.layers.{i}.{parent}.{name}"
                    own = extra.get("rank_pattern", {}).get(name, rank)
                    np.testing.assert_array_equal(slice_a[:own], saved[f"{key}.lora_A.weight"].astype(np.float32))
                    np.testing.assert_allclose(slice_b[:, :own], saved[f"{key}.lora_B.weight"] * 8 / own, rtol=1e-6)
                    assert not slice_a[own:].any() and not slice_b[:, own:].any()
        assert copied == [held], (modules, copied, held)


def test_reloads_under_one_name_into_one_slot_with_other_modules_of_a_group_each_generate_as_alone(tmp_path,
                                                                                                      model_dir):
    """One slot reloaded under one name with adapters that target other slices of q|k|v (q + v, every module, k
    alone): each write leaves no slice of the one before, so each generates the tokens of an engine that holds
    only it."""
    from jlora.adapters.peft import LINEAR_MODULES

    for seed, (name, modules) in enumerate([("qv", ["q_proj", "v_proj"]), ("all", list(LINEAR_MODULES)),
                                            ("k", ["k_proj"])]):
        testing.write_adapter(str(tmp_path / name), CFG, r=4, alpha=8, seed=20 + seed, target_modules=modules)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]

    def generate(engine, name):
        engine.load_adapter("a", str(tmp_path / name))
        return [list(t) for t in engine.generate(prompts, ["a", "a"], max_new_tokens=6)]

    alone = {name: generate(_engine(model_dir, max_loras=1), name) for name in ("qv", "all", "k")}
    engine = _engine(model_dir, max_loras=1)
    for name in ("qv", "all", "qv", "k", "qv"):
        if "a" in engine.registry:
            engine.unload_adapter("a")
        assert generate(engine, name) == alone[name], name


def test_a_staged_adapters_install_compiles_nothing(tmp_path, model_dir, monkeypatch):
    """`stage` (a loader thread's work) compiles the adapter's slot write for the pool's stacks, so `install` (the
    engine loop's) only runs it: with every compilation of the write made impossible, staged adapters of ranks in
    two buckets, one into a free slot and one evicting another, install and compute what the same adapters loaded
    into a fresh engine compute. An adapter whose install adds stacks compiles its write there (the first load)."""
    import jlora.adapters.pool as pool_module

    paths = []
    for i, r in enumerate((8, 3, 16, 5)):  # rank buckets 8, 8, 16, 8
        paths.append(str(tmp_path / f"a{i}"))
        testing.write_adapter(paths[-1], CFG, r=r, alpha=8, seed=i, target_modules=["q_proj", "v_proj", "down_proj"])
    engine = _engine(model_dir, max_lora_rank=16)
    engine.load_adapter("a0", paths[0])  # adds the stacks: its write compiles in install
    staged = [engine.pool.stage(engine.pool.prepare(p)) for p in paths[1:]]
    monkeypatch.setattr(pool_module, "_write_slot", None)
    for i, prepared in enumerate(staged, 1):  # as the engine loop installs a registered adapter's staged copy
        engine.pool.install(f"a{i}", prepared, engine.registry.register(f"a{i}", paths[i]).generation)
    assert engine.pool.evictions == 2 and sorted(engine.resident_adapters) == ["a2", "a3"]
    fresh = _engine(model_dir, max_lora_rank=16)
    monkeypatch.undo()
    prompts = [[1, 2, 3, 4], [5, 6]]
    for name, path in zip(("a2", "a3"), paths[2:]):
        fresh.load_adapter(name, path)
        for got, want in zip(engine.prefill_logits(prompts, [name] * 2), fresh.prefill_logits(prompts, [name] * 2)):
            np.testing.assert_array_equal(got, want)


def test_an_adapter_staged_before_the_pool_adds_stacks_installs_as_loaded(tmp_path, model_dir):
    """An adapter staged (its write compiled for the pool's stacks then) before another's install adds the stacks
    of modules no adapter targeted installs with a write compiled for the stacks as they are now, and computes
    what it computes when loaded in the other order into a fresh engine."""
    testing.write_adapter(str(tmp_path / "a"), CFG, r=4, alpha=8, seed=1, target_modules=["q_proj", "v_proj"])
    testing.write_adapter(str(tmp_path / "b"), CFG, r=8, alpha=8, seed=2, target_modules=["gate_proj", "down_proj"])
    engine = _engine(model_dir)
    staged = engine.pool.stage(engine.pool.prepare(str(tmp_path / "a")))
    engine.load_adapter("b", str(tmp_path / "b"))
    engine.pool.install("a", staged, engine.registry.register("a", str(tmp_path / "a")).generation)
    fresh = _engine(model_dir)
    fresh.load_adapter("b", str(tmp_path / "b"))
    fresh.load_adapter("a", str(tmp_path / "a"))
    prompts = [[1, 2, 3], [4, 5]]
    for name in ("a", "b"):
        for got, want in zip(engine.prefill_logits(prompts, [name] * 2), fresh.prefill_logits(prompts, [name] * 2)):
            np.testing.assert_array_equal(got, want)
