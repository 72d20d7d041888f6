"""`EngineConfig`: each option checked once, with a message that names it, and the same flags on both commands."""

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jlora import EngineConfig, cli


@pytest.mark.parametrize("options, message", [
    (dict(max_loras=0), "max_loras must be an integer >= 1, got 0"),
    (dict(max_batch=2.5), "max_batch must be an integer >= 1, got 2.5"),
    (dict(max_seq_len=True), "max_seq_len must be an integer >= 1, got True"),
    (dict(max_extra_vocab=-1), "max_extra_vocab must be an integer >= 0, got -1"),
    (dict(max_cpu_loras=-2), "max_cpu_loras must be an integer >= 0, got -2"),
    (dict(adapter_readers=-1), "adapter_readers must be an integer >= 0, got -1"),
    (dict(adapter_readers=1.5), "adapter_readers must be an integer >= 0, got 1.5"),
    (dict(adapter_read_timeout=0), "adapter_read_timeout must be a number of seconds > 0, got 0"),
    (dict(adapter_read_timeout=None), "adapter_read_timeout must be a number of seconds > 0, got None"),
    (dict(adapter_retry_after=0), "adapter_retry_after must be a number of seconds > 0, got 0"),
    (dict(prefill_chunk=100), "prefill_chunk must be a power of two >= 16, got 100"),
    (dict(prefill_chunk=8), "prefill_chunk must be a power of two >= 16, got 8"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(backend="triton"), "backend must be one of"),
    (dict(evict="fifo"), "evict must be one of"),
    (dict(split_attention=True), "split_attention must be one of"),
    (dict(tensor_parallel=0), "tensor_parallel must be an integer >= 1, got 0"),
    (dict(block_size=24), "block_size must be a power of two >= 16, or 0, got 24"),
    (dict(block_size=8), "block_size must be a power of two >= 16, or 0, got 8"),
    (dict(block_size=None), "block_size must be an integer >= 0, got None"),
    (dict(kv_blocks=0), "kv_blocks must be an integer >= 1, got 0"),
    (dict(prefix_caching="yes"), "prefix_caching must be True or False, got 'yes'"),
    (dict(kv_cache_memory=0), "kv_cache_memory must be a number of GiB > 0, got 0"),
    (dict(kv_cache_memory=float("nan")), "kv_cache_memory must be a number of GiB > 0, got nan"),
    (dict(kv_cache_memory="2"), "kv_cache_memory must be a number of GiB > 0, got '2'"),
    (dict(kv_cache_memory=2, kv_blocks=10), "give kv_blocks or kv_cache_memory, not both"),
    (dict(max_cpu_lora_memory=-1), "max_cpu_lora_memory must be a number of GiB > 0, got -1"),
    (dict(device_cache_memory=0), "device_cache_memory must be a number of GiB > 0, got 0"),
    (dict(device_cache_memory=float("inf")), "device_cache_memory must be a number of GiB > 0, got inf"),
])
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**options)


def test_values_are_normalized():
    config = EngineConfig(dtype=jnp.bfloat16, max_batch=np.int64(4))
    assert config.dtype == "bfloat16" and type(config.max_batch) is int
    assert EngineConfig(dtype=np.dtype("float32")).dtype == "float32"
    assert EngineConfig().host_capacity == 8 and EngineConfig(max_cpu_loras=100).host_capacity == 100
    assert EngineConfig().host_bytes is None and EngineConfig(max_cpu_lora_memory=0.5).host_bytes == 2**29
    assert EngineConfig().device_cache_bytes == 0 and EngineConfig(device_cache_memory=2).device_cache_bytes == 2**31
    with pytest.raises(ValueError, match="max_batch"):  # replace checks again
        dataclasses.replace(EngineConfig(), max_batch=0)


def test_split_attention_is_the_engines_by_its_cache_batch_and_length():
    """'auto' splits over a paged cache, and over a contiguous one where max_batch x KV heads per device leave
    most of the SMs idle, when contexts may be long; the chunk follows max_seq_len, never a step."""
    auto = [EngineConfig(max_batch=b, max_seq_len=n, tensor_parallel=tp, block_size=bs).attention_chunk(8)
            for b, n, tp, bs in [(32, 4096, 1, 16), (256, 32768, 1, 16), (32, 512, 1, 16), (8, 4096, 1, 0),
                                 (9, 4096, 1, 0), (16, 4096, 2, 0), (32, 4096, 1, 0), (1, 1000, 1, 0)]]
    assert auto == [256, 2048, None, 256, None, 256, None, None]
    assert EngineConfig(max_batch=256, block_size=0, max_seq_len=64, split_attention="on").attention_chunk(8) == 256
    assert EngineConfig(max_seq_len=8192, block_size=1024, split_attention="on").attention_chunk(8) == 1024
    assert EngineConfig(max_batch=1, max_seq_len=8192, split_attention="off").attention_chunk(8) is None


def test_a_config_and_keywords_together_are_refused():
    from jlora.engine import Engine

    with pytest.raises(TypeError, match="not both"):
        Engine.from_pretrained("/nonexistent", EngineConfig(), max_loras=2)


def test_an_unknown_option_is_named_with_the_nearest_field_before_the_model_loads():
    from jlora.engine import Engine

    with pytest.raises(TypeError, match="unknown engine option 'num_blocks'; did you mean 'kv_blocks'"):
        Engine.from_pretrained("/nonexistent", num_blocks=10)
    with pytest.raises(TypeError, match="unknown engine option 'zzz'; the options are EngineConfig's fields"):
        Engine.from_pretrained("/nonexistent", max_loras=2, zzz=1)


def test_every_field_is_a_flag_with_its_default():
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args([])) == EngineConfig()
    args = parser.parse_args(["--max-loras", "3", "--prefill-chunk", "64", "--dtype", "float32", "--evict",
                              "refuse", "--max-cpu-loras", "5", "--backend", "reference", "--kv-cache-memory", "1.5"])
    assert not EngineConfig.from_args(parser.parse_args(["--no-prefix-caching"])).prefix_caching
    assert EngineConfig.from_args(args, max_batch=2) == EngineConfig(
        max_loras=3, prefill_chunk=64, dtype="float32", evict="refuse", max_cpu_loras=5, backend="reference",
        kv_cache_memory=1.5, max_batch=2)


def test_settings_parse_as_the_flags_do():
    """`serve run jlora.ray:app KEY=VALUE ...` gives text: every field parses to the config its flag gives (a
    value of every field unlike its default); a config file's values are taken as they are; a bad key or value is
    named."""
    values = dict(max_loras="3", max_cpu_loras="5", max_cpu_lora_memory="0.5", device_cache_memory="2",
                  adapter_readers="0", adapter_read_timeout="30", adapter_retry_after="5", max_lora_rank="16", max_extra_vocab="0",
                  max_batch="4", max_seq_len="256", prefill_chunk="64", block_size="0", kv_blocks="100",
                  prefix_caching="false", dtype="float32", backend="reference", split_attention="on", evict="refuse",
                  tensor_parallel="2")
    assert set(values) == {f.name for f in dataclasses.fields(EngineConfig)} - {"kv_cache_memory"}  # or kv_blocks
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    flags = [arg for name, text in values.items() if name != "prefix_caching"
             for arg in ("--" + name.replace("_", "-"), text)] + ["--no-prefix-caching"]
    assert EngineConfig.from_settings(values) == EngineConfig.from_args(parser.parse_args(flags))
    assert EngineConfig.from_settings({"prefix_caching": "True", "kv_cache_memory": "1.5"}) == EngineConfig(
        kv_cache_memory=1.5)
    assert EngineConfig.from_settings({"prefix_caching": False, "max_loras": 3, "kv_cache_memory": 2}) == EngineConfig(
        prefix_caching=False, max_loras=3, kv_cache_memory=2.0)  # a config file's YAML values
    for bad, message in [({"max_loras": "eight"}, "max_loras must be an integer, got 'eight'"),
                         ({"max_loras": "2.5"}, "max_loras must be an integer, got '2.5'"),
                         ({"kv_cache_memory": "lots"}, "kv_cache_memory must be a number, got 'lots'"),
                         ({"prefix_caching": "no"}, "prefix_caching must be true or false, got 'no'"),
                         ({"max_batch": "0"}, "max_batch must be an integer >= 1, got 0"),
                         ({"max_batch": 2.5}, "max_batch must be an integer >= 1, got 2.5"),
                         ({"backend": "triton"}, "backend must be one of"),
                         ({"max_lora": "8", "batch": "2"}, "unknown engine option(s) 'batch', 'max_lora'")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            EngineConfig.from_settings(bad)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_both_commands_take_the_engine_flags(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = capsys.readouterr().out
    skipped = {"generate": ("max_loras", "max_cpu_loras", "max_cpu_lora_memory", "device_cache_memory", "evict"),
               "serve": ()}[command]
    for field in dataclasses.fields(EngineConfig):
        assert ("--" + field.name.replace("_", "-") in text) == (field.name not in skipped), field.name


@pytest.mark.serving
def test_serve_refuses_a_bad_option_without_a_traceback(capsys, tmp_path):
    assert cli.main(["serve", "--model", str(tmp_path), "--max-batch", "0"]) == 1
    err = capsys.readouterr().err
    assert "jlora serve: error: max_batch must be an integer >= 1, got 0" in err and "Traceback" not in err
