import jax
import pytest

if jax.default_backend() == "gpu":
    # float32 checks compare against float64 oracles: no TF32 in XLA's own matmuls.
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests skip unless JAX runs on a GPU."""
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
