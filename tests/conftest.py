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
