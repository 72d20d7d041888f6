"""The host tier: least recently used adapters evicted past its count and past its byte budget, the bytes it
holds counted as adapters come, go and come again."""

import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import HostAdapter
from jlora.adapters.pool import PreparedAdapter
from jlora.adapters.registry import HostTier
from jlora.engine import Engine


def _adapter(nbytes: int) -> PreparedAdapter:
    a, b = np.zeros(nbytes // 8, np.float32), np.zeros(nbytes // 8, np.float32)
    return PreparedAdapter(HostAdapter(rank=4, layers=({"qkv": (a, b)},), embed=None, lm_head=None), None, None)


def test_evicts_the_least_recently_used_past_the_bytes_and_the_count():
    tier = HostTier(capacity=3, max_bytes=1000)
    for generation, size in enumerate([400, 400, 160]):  # 960 bytes; least recently used first: 0, 1, 2
        tier.put(generation, _adapter(size))
    assert len(tier) == 3 and tier.nbytes == 960
    assert tier.get(0) is not None  # 1, 2, 0
    tier.put(3, _adapter(200))  # 1160 bytes and 4 entries: 1 goes, and that is enough: 2, 0, 3
    assert len(tier) == 3 and tier.nbytes == 760 and tier.get(1) is None
    tier.put(3, _adapter(480))  # the same generation again, counted once at its new size: 1040 bytes, 2 goes
    assert len(tier) == 2 and tier.nbytes == 880
    assert tier.get(2) is None and tier.get(0) is not None and tier.get(3) is not None
    tier.drop(3)
    assert tier.get(3) is None and tier.nbytes == 400
    tier.put(9, _adapter(2000))  # larger than the whole budget: kept by nothing, and nothing else kept
    assert tier.get(9) is None and len(tier) == 0 and tier.nbytes == 0


def test_the_engine_keeps_its_host_tier_within_max_cpu_lora_memory(tmp_path):
    cfg = testing.tiny_config("llama")
    testing.write_model(str(tmp_path / "m"), cfg, seed=1)
    engine = Engine.from_pretrained(str(tmp_path / "m"), dtype="float32", max_loras=1, max_cpu_loras=10,
                                    max_lora_rank=8, max_cpu_lora_memory=1e-9, progress=False)
    names = []
    for i, r in enumerate([2, 8, 4]):
        testing.write_adapter(str(tmp_path / f"a{i}"), cfg, r=r, alpha=8, seed=i)
        engine.register_adapter(f"a{i}", str(tmp_path / f"a{i}"))
        names.append(f"a{i}")
    assert engine.host.max_bytes == int(1e-9 * 2**30)  # the config's budget, too small for any adapter
    sizes = [engine.pool.prepare(str(tmp_path / n)).nbytes for n in names]
    budget = sizes[1] + sizes[2]  # holds the last two, not all three
    engine.host.max_bytes = budget
    outs = [list(engine.generate([[1, 2, 3]], [n], max_new_tokens=2)[0]) for n in names]
    assert len(engine.host) == 2 and engine.host.nbytes == budget
    assert [list(engine.generate([[1, 2, 3]], [n], max_new_tokens=2)[0]) for n in names] == outs  # read again


@pytest.mark.parametrize("gib", [0, -1.0, float("inf")])
def test_a_bad_budget_names_the_option(gib):
    with pytest.raises(ValueError, match="max_cpu_lora_memory must be a number of GiB > 0"):
        Engine(None, max_cpu_lora_memory=gib)
