import jax
import pytest


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests skip unless JAX runs on a GPU."""
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_compilations():
    """Frees each test module's compiled executables after it: every engine a module builds compiles its own
    steps (the model definition is part of the key), and on the CPU each executable holds memory mappings, so a
    worker that ran many modules reached the kernel's limit (vm.max_map_count, 65530) and crashed in LLVM."""
    yield
    jax.clear_caches()
