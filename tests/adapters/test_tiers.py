"""The host tier and the device cache: least recently used adapters evicted past a count and past a byte budget,
the bytes held counted as adapters come, go and come again; an adapter evicted from its slot comes back from the
device cache without a read or a copy, with the tokens of an engine that never evicted it; the device cache gives
way when the device runs out of memory."""

import threading

import jax
import numpy as np
import pytest

from jlora import testing
from jlora.adapters.peft import LINEAR_MODULES, HostAdapter
from jlora.adapters.pool import PreparedAdapter
from jlora.adapters.tiers import AdapterCache
from jlora.engine import Engine


def _adapter(nbytes: int) -> PreparedAdapter:
    a, b = np.zeros(nbytes // 8, np.float32), np.zeros(nbytes // 8, np.float32)
    return PreparedAdapter(HostAdapter(rank=4, layers=({"qkv": (a, b)},), embed=None, lm_head=None), None, None)


def test_evicts_the_least_recently_used_past_the_bytes_and_the_count():
    tier = AdapterCache(capacity=3, max_bytes=1000)
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
    assert engine.tiers.host.max_bytes == int(1e-9 * 2**30)  # the config's budget, too small for any adapter
    sizes = [engine.pool.prepare(str(tmp_path / n)).nbytes for n in names]
    budget = sizes[1] + sizes[2]  # holds the last two, not all three
    engine.tiers.host.max_bytes = budget
    outs = [list(engine.generate([[1, 2, 3]], [n], max_new_tokens=2)[0]) for n in names]
    assert len(engine.tiers.host) == 2 and engine.tiers.host.nbytes == budget
    assert [list(engine.generate([[1, 2, 3]], [n], max_new_tokens=2)[0]) for n in names] == outs  # read again


@pytest.mark.parametrize("gib", [0, -1.0, float("inf")])
def test_a_bad_budget_names_the_option(gib):
    with pytest.raises(ValueError, match="max_cpu_lora_memory must be a number of GiB > 0"):
        Engine(None, max_cpu_lora_memory=gib)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """A tiny model and three adapters of different ranks and targets."""
    root = tmp_path_factory.mktemp("tiers")
    cfg = testing.tiny_config("llama")
    testing.write_model(str(root / "m"), cfg, seed=1)
    kinds = [(2, ["q_proj", "v_proj"]), (8, list(LINEAR_MODULES)), (4, ["o_proj", "down_proj"])]
    for i, (r, targets) in enumerate(kinds):
        testing.write_adapter(str(root / f"a{i}"), cfg, r=r, alpha=8, seed=i, target_modules=targets)
    return root


def _counting(engine: Engine, monkeypatch) -> dict[str, list]:
    """The adapter directories `engine` reads and the adapters it copies to the device, as they happen."""
    seen = {"reads": [], "copies": []}
    prepare, copied = engine.pool.prepare, engine.pool._copied
    monkeypatch.setattr(engine.pool, "prepare",
                        lambda path, *roots: (seen["reads"].append(path), prepare(path, *roots))[1])
    monkeypatch.setattr(engine.pool, "_copied", lambda p: (seen["copies"].append(p), copied(p))[1])
    return seen


def test_the_device_cache_brings_evicted_adapters_back_without_a_read_or_a_copy(lib, monkeypatch):
    """One slot, no host tier, three adapters taking turns: with a device cache each adapter is read and copied
    once, and every later turn only writes the slot; the tokens equal an engine's that holds all three in slots.
    Without one, every turn reads and copies again."""
    names = ["a0", "a1", "a2"]
    truth = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=3, max_lora_rank=8, progress=False)
    for n in names:
        truth.load_adapter(n, str(lib / n))
    want = [list(truth.generate([[1, 2, 3]], [n], max_new_tokens=3, temperature=1.0, seed=5)[0]) for n in names]
    for cache in (None, 1.0):
        engine = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=1, max_cpu_loras=0,
                                        max_lora_rank=8, device_cache_memory=cache, progress=False)
        for n in names:
            engine.register_adapter(n, str(lib / n))
        seen = _counting(engine, monkeypatch)
        for _ in range(2):
            got = [list(engine.generate([[1, 2, 3]], [n], max_new_tokens=3, temperature=1.0, seed=5)[0])
                   for n in names]
            assert got == want
        assert engine.pool.evictions == 5
        turns = 3 if cache else 6
        assert len(seen["reads"]) == len(seen["copies"]) == turns, cache
        assert len(engine.tiers.device) == (3 if cache else 0) and len(engine.tiers.host) == 0
        if cache:  # the bytes counted are the staged arrays'
            assert engine.tiers.device.nbytes == sum(engine.tiers.device.get(e.generation).nbytes
                                                     for e in map(engine.registry.get, names))


def test_the_device_cache_serves_prefill_logits_and_forgets_an_unregistered_adapter(lib, monkeypatch):
    """The path that writes slots without `Admission` (`prefill_logits`) takes adapters from the device cache
    too; unloading an adapter drops it from both tiers, and registering the name again reads the new files."""
    engine = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=1, max_lora_rank=8,
                                    device_cache_memory=1.0, progress=False)
    for n in ["a0", "a1"]:
        engine.register_adapter(n, str(lib / n))
    first = [engine.prefill_logits([[1, 2, 3]], [n])[0] for n in ["a0", "a1"]]
    seen = _counting(engine, monkeypatch)
    again = [engine.prefill_logits([[1, 2, 3]], [n])[0] for n in ["a0", "a1"]]
    assert seen == {"reads": [], "copies": []}
    np.testing.assert_array_equal(np.stack(again), np.stack(first))
    engine.unload_adapter("a0")  # in the cache, not in the slot
    assert len(engine.tiers.device) == 1 and len(engine.tiers.host) == 1
    engine.register_adapter("a0", str(lib / "a2"))  # the name again, other files
    got = engine.prefill_logits([[1, 2, 3]], ["a0"])[0]
    assert seen["reads"] == [str(lib / "a2")] and len(seen["copies"]) == 1
    assert not np.array_equal(got, first[0])


@pytest.mark.parametrize("when", ["read", "copy"])
def test_a_load_that_ends_after_its_adapter_was_unloaded_keeps_no_copy(lib, monkeypatch, when):
    """The adapter is unloaded while a loader thread reads its files or copies it to the device: the load ends,
    and neither tier keeps a copy that nothing could find again; the name's next registration loads its own."""
    engine = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=1, max_lora_rank=8,
                                    device_cache_memory=1.0, progress=False)
    engine.register_adapter("a0", str(lib / "a0"))
    entry = engine.registry.get("a0")
    step = {"read": "prepare", "copy": "_copied"}[when]
    real = getattr(engine.pool, step)

    def unloaded_meanwhile(*args):
        engine.unload_adapter("a0")
        return real(*args)

    monkeypatch.setattr(engine.pool, step, unloaded_meanwhile)
    assert engine.tiers.staged(engine.pool, entry, None).staged
    assert len(engine.tiers.host) == len(engine.tiers.device) == 0
    assert engine.tiers.host.nbytes == engine.tiers.device.nbytes == 0
    monkeypatch.setattr(engine.pool, step, real)
    engine.register_adapter("a0", str(lib / "a1"))
    engine.generate([[1, 2]], ["a0"], max_new_tokens=1)
    assert len(engine.tiers.host) == len(engine.tiers.device) == 1


def test_a_cached_adapter_back_after_the_stacks_grew_compiles_its_write_off_the_loop(lib, monkeypatch):
    """An adapter of new modules makes new slot stacks, so every compiled slot write is dropped; an adapter that
    comes back from the device cache afterwards has its write compiled again on a loader thread, not on the
    thread that runs the steps, and gives the tokens of an engine that never evicted it."""
    from jlora.adapters import pool as pool_module

    truth = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=2, max_lora_rank=8, progress=False)
    for n in ["a0", "a2"]:
        truth.load_adapter(n, str(lib / n))
    want = list(truth.generate([[1, 2, 3]], ["a0"], max_new_tokens=3)[0])
    engine = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=1, max_cpu_loras=0, max_lora_rank=8,
                                    device_cache_memory=1.0, progress=False)
    for n in ["a0", "a2"]:
        engine.register_adapter(n, str(lib / n))
    engine.generate([[1, 2, 3]], ["a0"], max_new_tokens=1)  # a0 (q|k|v) in the slot and the device cache
    engine.generate([[1, 2, 3]], ["a2"], max_new_tokens=1)  # a2 (o, down): new stacks, a0's write dropped
    compiled_on, lower = [], pool_module._write_slot.lower

    class Spy:
        def lower(self, *args, **kwargs):
            compiled_on.append(threading.current_thread().name)
            return lower(*args, **kwargs)

    monkeypatch.setattr(pool_module, "_write_slot", Spy())
    seen = _counting(engine, monkeypatch)
    assert list(engine.generate([[1, 2, 3]], ["a0"], max_new_tokens=3)[0]) == want
    assert seen == {"reads": [], "copies": []}  # from the device cache
    assert compiled_on and all(name.startswith("jlora-adapter-load") for name in compiled_on), compiled_on


def test_a_device_cache_smaller_than_an_adapter_keeps_none(lib):
    engine = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=1, max_lora_rank=8,
                                    device_cache_memory=1e-9, progress=False)
    engine.register_adapter("a1", str(lib / "a1"))
    engine.generate([[1, 2]], ["a1"], max_new_tokens=1)
    assert len(engine.tiers.device) == 0 and engine.tiers.device.nbytes == 0 and len(engine.tiers.host) == 1


@pytest.mark.parametrize("failing", ["_copied", "_allocate"])
def test_the_device_cache_gives_way_when_the_device_runs_out_of_memory(lib, monkeypatch, failing):
    """The device out of memory while the device cache holds adapters, in the copy to the device or in a slot
    write (new stacks for modules no adapter targeted before): the cache lets go of its adapters and the load
    goes on; without adapters in the cache the error stands (`test_admission`'s slot write test)."""
    from jlora.adapters.pool import AdapterPool

    truth = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=1, max_lora_rank=8, progress=False)
    truth.load_adapter("a2", str(lib / "a2"))
    want = list(truth.generate([[1, 2, 3]], ["a2"], max_new_tokens=3)[0])
    engine = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=1, max_lora_rank=8,
                                    device_cache_memory=1.0, progress=False)
    for n in ["a0", "a2"]:
        engine.register_adapter(n, str(lib / n))
    engine.generate([[1, 2, 3]], ["a0"], max_new_tokens=1)
    assert len(engine.tiers.device) == 1
    real, raised = getattr(AdapterPool, failing), []

    def out_of_memory(*args):
        if not raised:
            raised.append(True)
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 75.5MiB")
        return real(*args)

    monkeypatch.setattr(AdapterPool, failing, out_of_memory)
    assert list(engine.generate([[1, 2, 3]], ["a2"], max_new_tokens=3)[0]) == want
    assert raised and engine.resident_adapters == ["a2"]
    assert engine.tiers.device.get(engine.registry.get("a0").generation) is None  # let go


def test_a_generate_step_out_of_device_memory_empties_the_device_cache(lib, monkeypatch):
    """The call whose step ran the device out of memory raises it; the device cache lets go of its adapters, so
    the next call (the same shapes, needing the same memory) has it back."""
    engine = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_loras=1, max_lora_rank=8,
                                    device_cache_memory=1.0, progress=False)
    for n in ["a0", "a1"]:
        engine.register_adapter(n, str(lib / n))
    want = [list(engine.generate([[1, 2, 3]], [n], max_new_tokens=3)[0]) for n in ["a0", "a1"]]
    step = engine.runner.step
    monkeypatch.setattr(engine.runner, "step", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")))
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        engine.generate([[1, 2, 3]], ["a0"], max_new_tokens=3)
    assert len(engine.tiers.device) == 0 and engine.tiers.device.nbytes == 0
    monkeypatch.setattr(engine.runner, "step", step)
    assert [list(engine.generate([[1, 2, 3]], [n], max_new_tokens=3)[0]) for n in ["a0", "a1"]] == want


def test_a_device_cache_larger_than_the_free_device_memory_is_refused(lib, monkeypatch):
    """Where the backend tells its free memory (a GPU; the CPU does not), a budget above it is refused at start,
    naming both."""
    import jlora.engine

    monkeypatch.setattr(jlora.engine, "_free_bytes", lambda devices: 3 * 2**29)  # 1.5 GiB
    with pytest.raises(ValueError, match=r"device_cache_memory 2 GiB is more than the 1.5 GiB the device\(s\) have "
                                         "free beside the model"):
        Engine.from_pretrained(str(lib / "m"), dtype="float32", max_lora_rank=8, device_cache_memory=2,
                               progress=False)
    engine = Engine.from_pretrained(str(lib / "m"), dtype="float32", max_lora_rank=8, device_cache_memory=1,
                                    progress=False)
    assert engine.tiers.device.max_bytes == 2**30


def test_free_device_memory_is_summed_over_the_devices_or_the_hosts_for_cpus_or_unknown(monkeypatch):
    import jlora.engine
    from jlora.engine import _free_bytes

    class Device:  # what `_free_bytes` reads of a jax.Device
        def __init__(self, stats, platform="gpu"):
            self.memory_stats, self.platform = lambda: stats, platform

    used = [Device({"bytes_limit": 10, "bytes_in_use": 4}), Device({"bytes_limit": 8, "bytes_in_use": 1})]
    assert _free_bytes(used) == 13
    assert _free_bytes([used[0], Device(None)]) is None and _free_bytes([Device({"bytes_in_use": 1})]) is None
    monkeypatch.setattr(jlora.engine, "_host_available_bytes", lambda: 77)
    assert _free_bytes([Device(None, "cpu"), Device(None, "cpu")]) == 77  # shared by the CPU devices, not summed
    assert _free_bytes([Device(None, "cpu"), Device(None)]) is None
    monkeypatch.undo()
    with open("/proc/meminfo") as f:  # this machine's, as the engine reads it
        available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
    assert abs(jlora.engine._host_available_bytes() - available) < 2**30
    assert abs(_free_bytes(jax.devices("cpu")) - available) < 2**30
