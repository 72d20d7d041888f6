import importlib.metadata
import importlib.util
import os
import shutil
import tempfile

# XLA's persistent cache, shared by the session's engines and processes: tests build many engines of the same
# shapes, whose steps compile to the same programs, and the servers and tensor-parallel runs they start as
# subprocesses inherit the directory (so do xdist's workers, started after this). The process that makes the
# directory (the session's first) removes it at the end; a JAX_COMPILATION_CACHE_DIR given outside is kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jlora-tests-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tiny models compile in well under 1 s

# On the CPU the tiny models' tests are compile-bound (XLA's compilation is most of a slow test's time), and LLVM's
# optimization level 0 compiles their steps about a quarter faster: the same programs, under XLA's same math
# settings. Not where a GPU plugin is installed, whose suite is to run the kernels as users compile them. An
# XLA_FLAGS that sets the level wins; subprocesses inherit it (tests/cpu_devices.py).
_GPU_PLUGIN = bool(importlib.metadata.entry_points(group="jax_plugins")) and os.environ.get("JAX_PLATFORMS") != "cpu"
if not _GPU_PLUGIN and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402 (JAX reads the cache's settings when it is imported)
import pytest  # noqa: E402

if _OWN_CACHE is not None:  # in case a plugin imported JAX first
    jax.config.update("jax_compilation_cache_dir", _OWN_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_collection_modifyitems(config, items):
    """The tests marked slow run first, so that xdist's workers end on short tests together rather than one
    waiting for the other's last minute-long test. GPU-marked tests skip unless JAX runs on a GPU; serving-marked
    ones where the server's packages are not installed (the GPU machine)."""
    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: otherwise in collection order
    skips = {}
    if jax.default_backend() != "gpu":
        skips["gpu"] = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
    if importlib.util.find_spec("starlette") is None:
        skips["serving"] = pytest.mark.skip(reason="needs the server's packages (starlette is not installed)")
    for item in items:
        for mark, skip in skips.items():
            if mark in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _free_compilations():
    """Frees each test module's compiled executables after it: every engine a module builds compiles its own
    steps (the model definition is part of the key), and on the CPU each executable holds memory mappings, so a
    worker that ran many modules reached the kernel's limit (vm.max_map_count, 65530) and crashed in LLVM."""
    yield
    jax.clear_caches()


def pytest_sessionfinish(session):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
