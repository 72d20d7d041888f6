"""`AdapterRegistry`: a directory scanned stays watched, so an adapter subdirectory added later is registered
when named (`find`) or listed (`available`), only as `scan` would have named it, and one removed is not served
while it is gone; a failed load is remembered for `retry_after` seconds."""

import concurrent.futures
import os
import time

import pytest

from jlora import testing
from jlora.adapters.registry import AdapterRegistry

CFG = testing.tiny_config("llama")


def test_find_registers_a_subdirectory_added_after_the_scan_as_the_scan_names_it(tmp_path):
    lib = tmp_path / "lib"
    testing.write_adapter(str(lib / "first"), CFG, r=2, alpha=4, seed=1)
    testing.write_adapter(str(tmp_path / "outside"), CFG, r=2, alpha=4, seed=2)
    registry = AdapterRegistry()
    assert registry.find("first") is None  # nothing scanned: nothing watched
    assert [e.name for e in registry.scan(str(lib), reserved=frozenset({"base"})).registered] == ["first"]
    for name in ("late", "base", "nested/deep"):
        testing.write_adapter(str(lib / name), CFG, r=2, alpha=4, seed=3)
    (lib / "notes").mkdir()
    entry = registry.find("late")
    assert entry is not None and entry.adapter_dir == os.path.join(str(lib), "late") and registry.find("late") is entry
    # the served model's name, a deeper path, a path out of the directory, a directory without a config, an
    # invalid name, and nothing there: not adapters
    for name in ("base", "nested/deep", "nested", "../outside", "lib/../outside", "notes", "-x", "", "nope", "a\0"):
        assert registry.find(name) is None, name
    assert registry.names == ["first", "late"]
    registry.unregister("late")  # unregistered, its directory still there: named again, registered again
    again = registry.find("late")
    assert again is not None and again.generation != entry.generation


def test_rescan_registers_what_was_added_and_keeps_what_is_registered(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    testing.write_adapter(str(lib / "a"), CFG, r=2, alpha=4, seed=1)
    registry = AdapterRegistry()
    registry.scan(str(lib))
    a = registry.get("a")
    tried = []  # what rescan tries to register: none of the names registered already
    register = registry.register
    monkeypatch.setattr(registry, "register", lambda name, *a, **kw: tried.append(name) or register(name, *a, **kw))
    assert registry.rescan() == [] and tried == []
    testing.write_adapter(str(lib / "b"), CFG, r=2, alpha=4, seed=2)
    testing.write_adapter(str(lib / "bad name"), CFG, r=2, alpha=4, seed=2)
    assert [e.name for e in registry.rescan()] == ["b"] and registry.get("a") is a and tried == ["b"]
    assert registry.names == ["a", "b"]
    lib.rename(tmp_path / "gone")  # the directory removed or unmounted: nothing added, nothing raised
    assert registry.rescan() == [] and registry.find("c") is None and registry.names == ["a", "b"]


def test_an_adapter_whose_directory_is_removed_is_not_served_until_it_is_back(tmp_path):
    """Found in a directory scanned: while its directory is gone, `find` and `available` leave it out (a request
    answers 404), and once it is back it is served under the same registration. An adapter registered by name
    (--lora, a runtime load) is not watched: its load reports missing files."""
    lib = tmp_path / "lib"
    for name in ("a", "b"):
        testing.write_adapter(str(lib / name), CFG, r=2, alpha=4, seed=1)
    testing.write_adapter(str(tmp_path / "named"), CFG, r=2, alpha=4, seed=1)
    registry = AdapterRegistry()
    registry.register("named", str(tmp_path / "named"))
    registry.scan(str(lib))
    testing.write_adapter(str(lib / "late"), CFG, r=2, alpha=4, seed=1)
    late = registry.find("late")
    a = registry.get("a")
    assert registry.available() == ["a", "b", "late", "named"]
    for name in ("a", "late"):
        (lib / name).rename(tmp_path / f"away-{name}")
    (tmp_path / "named").rename(tmp_path / "away-named")
    assert registry.find("a") is None and registry.find("late") is None and registry.find("named") is not None
    assert registry.available() == ["b", "named"] and registry.names == ["a", "b", "late", "named"]
    (tmp_path / "away-a").rename(lib / "a")
    (tmp_path / "away-late").rename(lib / "late")
    assert registry.find("a") is a and registry.find("late") is late and len(registry.available()) == 4


def test_concurrent_finds_register_a_name_once(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    registry = AdapterRegistry()
    registry.scan(str(lib))
    testing.write_adapter(str(lib / "x"), CFG, r=2, alpha=4, seed=1)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        found = list(pool.map(lambda _: registry.find("x"), range(64)))
    assert len({id(e) for e in found}) == 1 and found[0] is not None and len(registry) == 1


def test_a_failure_is_remembered_for_retry_after_seconds(tmp_path):
    testing.write_adapter(str(tmp_path / "a"), CFG, r=2, alpha=4, seed=1)
    with pytest.raises(ValueError, match="retry_after must be > 0"):
        AdapterRegistry(0)
    registry = AdapterRegistry(retry_after=0.3)
    entry = registry.register("a", str(tmp_path / "a"))
    registry.fail(entry, "broken")
    assert registry.failure(entry) == "broken"
    time.sleep(0.3)
    assert registry.failure(entry) is None
    registry.fail(entry, "broken again")
    registry.unregister("a")
    again = registry.register("a", str(tmp_path / "a"))
    assert registry.failure(again) is None and registry.failure(entry) is None
