"""PEFT adapter loading and the device slot pool."""

from jlora.adapters.config import AdapterError, check_adapter_name
from jlora.adapters.peft import HostAdapter, read_adapter
from jlora.adapters.pool import AdapterPool, PoolFullError, PreparedAdapter

__all__ = ["AdapterError", "AdapterPool", "HostAdapter", "PoolFullError", "PreparedAdapter", "check_adapter_name",
           "read_adapter"]
