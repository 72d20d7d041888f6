"""PEFT adapter loading and the device slot pool."""

from jlora.adapters.peft import AdapterError, HostAdapter, read_adapter
from jlora.adapters.pool import AdapterPool, PoolFullError

__all__ = ["AdapterError", "AdapterPool", "HostAdapter", "PoolFullError", "read_adapter"]
