"""`adapter_config.json` as untrusted input: each mutation of a valid config raises an `AdapterError` naming
the field (never echoing the value), arbitrary JSON in any field raises nothing else, and adapter names are
checked before anything is registered."""

import json
import math
import os

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from jlora import testing
from jlora.adapters import AdapterError, check_adapter_name, read_adapter
from jlora.adapters.config import MAX_CONFIG_BYTES, read_config
from jlora.models.config import ModelConfig

CFG = testing.tiny_config("llama")
SECRET = "s3cr3t-value"  # planted in mutated fields: no message may show it


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("adapter"))
    testing.write_adapter(path, CFG, r=4, alpha=8, seed=1)
    with open(os.path.join(path, "adapter_config.json")) as f:
        return path, json.load(f)


def _write(path: str, text: str | bytes) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return path


# name: (the config's changes, or a function of the valid config to the file's text; the message expected)
MUTATIONS = {
    "target_modules a number": ({"target_modules": 5}, "'target_modules' must be a list of module names or a regular"),
    "target_modules a list of numbers": ({"target_modules": [1, 2]}, "'target_modules' must be"),
    "target_modules a bad regex": ({"target_modules": "(" + SECRET}, "'target_modules' must be"),
    "target_modules a huge regex": ({"target_modules": "a" * 5000}, "'target_modules' must be"),
    "lora_alpha a string": ({"lora_alpha": SECRET}, "'lora_alpha' must be a finite number"),
    "lora_alpha NaN": (lambda c: json.dumps(c | {"lora_alpha": float("nan")}), "'lora_alpha' must be a finite number"),
    "lora_alpha infinite": (lambda c: json.dumps(c | {"lora_alpha": float("inf")}), "'lora_alpha' must be a finite"),
    "lora_alpha 1e38": ({"lora_alpha": 1e38}, "magnitude at most 65536"),
    "lora_alpha true": ({"lora_alpha": True}, "'lora_alpha' must be a finite number"),
    "rank_pattern a string": ({"rank_pattern": "x"}, "'rank_pattern' must be an object of module patterns"),
    "rank_pattern a zero rank": ({"rank_pattern": {"q_proj": 0}}, "'rank_pattern' must be"),
    "rank_pattern a bad regex key": ({"rank_pattern": {"[": 4}}, "'rank_pattern' must be"),
    "alpha_pattern a string alpha": ({"alpha_pattern": {"q_proj": SECRET}}, "'alpha_pattern' must be"),
    "layers_to_transform a string": ({"layers_to_transform": "abc"}, "'layers_to_transform' must be a layer index"),
    "layers_to_transform negative": ({"layers_to_transform": [-1]}, "'layers_to_transform' must be"),
    "r zero": ({"r": 0}, "'r' must be a positive integer"),
    "r negative": ({"r": -4}, "'r' must be a positive integer"),
    "r a float": ({"r": 4.0}, "'r' must be a positive integer"),
    "r a string": ({"r": "4"}, "'r' must be a positive integer"),
    "use_dora a string": ({"use_dora": "false"}, "'use_dora' must be true or false"),
    "use_rslora a number": ({"use_rslora": 1}, "'use_rslora' must be true or false"),
    "lora_bias a string": ({"lora_bias": "yes"}, "'lora_bias' must be true or false"),
    "modules_to_save a string": ({"modules_to_save": "embed_tokens"}, "'modules_to_save' must be a list"),
    "trainable_token_indices strings": ({"trainable_token_indices": {"embed_tokens": "abc"}},
                                        "'trainable_token_indices' must be"),
    "context_length a string": ({"context_length": SECRET}, "'context_length' must be a positive integer"),
    "peft_type another": ({"peft_type": SECRET}, "'peft_type' must be \"LORA\""),
    "no r": (lambda c: json.dumps({k: v for k, v in c.items() if k != "r"}), "needs 'r' and 'lora_alpha'"),
    "a JSON list": (lambda c: json.dumps([c]), "must hold a JSON object"),
    "a JSON string": (lambda c: json.dumps(SECRET), "must hold a JSON object"),
    "nested 100k deep": (lambda c: '{"r": 4, "lora_alpha": 8, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                         "nested too deeply"),
    "not JSON": (lambda c: SECRET + "{", "not valid JSON"),
    "not UTF-8": (lambda c: json.dumps(c).encode()[:-1] + b' "\xff"}', "not valid UTF-8"),
    "larger than 1 MiB": (lambda c: json.dumps(c | {"x": "a" * MAX_CONFIG_BYTES}), "larger than 1048576 bytes"),
    "trained base biases": ({"bias": "all"}, "trained biases of the base layers"),
    # PEFT 0.21's LoRA variants whose forward is not LoRA's, as their configs save them
    "activated LoRA": ({"alora_invocation_tokens": [5, 6]}, r"Activated LoRA \(alora_invocation_tokens\) is not"),
    "BD-LoRA": ({"use_bdlora": {"target_modules_bd_a": ["q_proj"], "nblocks": 2}}, r"BD-LoRA \(use_bdlora\)"),
    "Arrow routing": ({"arrow_config": {"top_k": 3}}, r"Arrow routing \(arrow_config\)"),
    "KaSA": ({"kasa_config": {"beta": 1}}, r"KaSA \(kasa_config\)"),
    "MonteCLoRA": ({"monteclora_config": {"num_samples": 4}}, r"MonteCLoRA \(monteclora_config\)"),
}


@pytest.mark.parametrize("case", list(MUTATIONS))
def test_each_config_mutation_is_an_adapter_error_naming_the_field(tmp_path, adapter, case):
    _, valid = adapter
    change, match = MUTATIONS[case]
    path = _write(str(tmp_path / "a"), change(valid) if callable(change) else json.dumps(valid | change))
    with pytest.raises(AdapterError, match=match) as err:
        read_config(path)
    assert SECRET not in str(err.value)


def test_a_config_with_a_lone_surrogate_loads_or_refuses_cleanly(tmp_path, adapter):
    """JSON allows "\\ud800"; a module name holding one matches no module, and the message stays encodable."""
    src, valid = adapter
    path = str(tmp_path / "a")
    os.makedirs(path)
    os.symlink(os.path.join(src, "adapter_model.safetensors"), os.path.join(path, "adapter_model.safetensors"))
    _write(path, json.dumps(valid | {"target_modules": ["q_proj\ud800"]}))
    with pytest.raises(AdapterError, match="outside target_modules") as err:
        read_adapter(path, ModelConfig.from_hf_config(CFG), 8, 16)
    str(err.value).encode("utf-8")


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=12)
_FIELDS = ["r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "layers_to_transform", "use_rslora",
           "use_dora", "lora_bias", "modules_to_save", "trainable_token_indices", "context_length", "peft_type", "bias",
           "fan_in_fan_out", "layer_replication", "use_qalora", "target_parameters", "alora_invocation_tokens",
           "use_bdlora", "arrow_config", "kasa_config", "monteclora_config"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(_FIELDS), _json, min_size=1, max_size=3))
def test_any_json_in_any_field_raises_only_adapter_errors(tmp_path_factory, adapter, changes):
    src, valid = adapter
    path = str(tmp_path_factory.mktemp("fuzz"))
    os.symlink(os.path.join(src, "adapter_model.safetensors"), os.path.join(path, "adapter_model.safetensors"))
    _write(path, json.dumps(valid | changes))
    try:
        host = read_adapter(path, ModelConfig.from_hf_config(CFG), 8, 16, max_seq_len=64)
    except AdapterError as err:
        str(err).encode("utf-8")
        return
    for a, b in host.layers[0].values():  # what loaded is finite
        assert np.isfinite(a).all() and np.isfinite(b).all()
    assert math.isfinite(host.rope_factor)


@pytest.mark.parametrize("name", ["", " a", "a b", "-a", "a\ud800", "a\n", "é", "a" * 129, 5, None, "a\x00"])
def test_bad_adapter_names_are_refused(name):
    with pytest.raises(ValueError, match="invalid adapter name"):
        check_adapter_name(name)


@pytest.mark.parametrize("name", ["a", "sql-lora", "org/model-lora:v2", "A.b_c@1+2", "x" * 128])
def test_good_adapter_names_pass(name):
    check_adapter_name(name)
