"""The environment of a subprocess that runs JAX on virtual CPU devices."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_devices_env(count: int) -> dict[str, str]:
    """os.environ with JAX on `count` virtual CPU devices and this repository importable; the XLA_FLAGS the
    session runs with (tests/conftest.py) are kept."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
