"""Where an adapter is kept between its files and a device slot: the host tier (read and converted, LRU within
`max_cpu_loras` and `max_cpu_lora_memory`) and the device cache (also copied to the device, LRU within
`device_cache_memory`), so that an adapter evicted from its slot comes back without reading its files, and from
the device cache without a host -> device copy either: only the slot write, which moves device memory.

Both are keyed by registration generation (`Registration`): a name registered again never finds the old
adapter's copies, and a load that ends after its adapter was unregistered keeps no copy. Thread-safe: the
server's request threads, the engine's loop and its loader threads use them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from jlora.adapters.pool import AdapterPool, PreparedAdapter
from jlora.adapters.registry import AdapterRegistry, Registration

__all__ = ["AdapterCache", "AdapterTiers"]

T = TypeVar("T")


class AdapterCache:
    """`PreparedAdapter`s by generation, least recently used evicted past `capacity` entries (None: no count bound)
    or past `max_bytes` of arrays (None: no byte budget)."""

    def __init__(self, capacity: int | None, max_bytes: int | None = None):
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.nbytes = 0  # of the adapters kept
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, PreparedAdapter] = collections.OrderedDict()

    def get(self, generation: int) -> PreparedAdapter | None:
        with self._lock:
            prepared = self._entries.get(generation)
            if prepared is not None:
                self._entries.move_to_end(generation)
            return prepared

    def put(self, generation: int, prepared: PreparedAdapter) -> None:
        with self._lock:
            self._pop(generation)
            self._entries[generation] = prepared
            self.nbytes += prepared.nbytes
            while self._entries and (self.capacity is not None and len(self._entries) > self.capacity
                                     or self.max_bytes is not None and self.nbytes > self.max_bytes):
                self._pop(next(iter(self._entries)))  # the least recently used, this one last

    def drop(self, generation: int) -> None:
        with self._lock:
            self._pop(generation)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _pop(self, generation: int) -> None:
        prepared = self._entries.pop(generation, None)
        if prepared is not None:
            self.nbytes -= prepared.nbytes

    def __len__(self) -> int:
        return len(self._entries)


@dataclasses.dataclass(frozen=True)
class AdapterTiers:
    """The host tier and the device cache of one engine, over its registry."""

    host: AdapterCache
    device: AdapterCache
    registry: AdapterRegistry

    def keep(self, cache: AdapterCache, entry: Registration, prepared: PreparedAdapter) -> None:
        """Puts `entry`'s adapter into `cache` (the host tier or the device cache) unless `entry` is no longer
        registered. Checked after the put: an unregister racing with it drops the copy either way (`drop` runs
        after `AdapterRegistry.unregister`), so no copy outlives its registration, unreachable until evicted."""
        cache.put(entry.generation, prepared)
        current = self.registry.get(entry.name)
        if current is None or current.generation != entry.generation:
            cache.drop(entry.generation)

    def find(self, generation: int) -> tuple[str, PreparedAdapter | None]:
        """The nearest tier that holds the adapter: ("device", staged), ("host", prepared) or ("disk", None)."""
        staged = self.device.get(generation)
        if staged is not None:
            return "device", staged
        prepared = self.host.get(generation)
        return ("host", prepared) if prepared is not None else ("disk", None)

    def staged(self, pool: AdapterPool, entry: Registration, found: PreparedAdapter | None,
               timed: Callable[[str, float], None] = lambda stage, seconds: None) -> PreparedAdapter:
        """`entry`'s adapter on the device, ready for `pool.install` (`pool.stage`: its slot write compiled): `found`
        (`find`'s) when staged, else copied there, its files read first when `found` is None (`pool.prepare`). Each
        tier it passes through keeps it; `timed` is told the read's and the copy's seconds ("disk_to_host",
        "host_to_device").

        Raises:
          AdapterError: the adapter is invalid.
        """
        if found is not None and found.staged:  # from the device cache: only its write to compile, if that
            return self.retried(pool.stage, found)
        if found is None:
            start = time.monotonic()
            found = pool.prepare(entry.adapter_dir, entry.roots)
            self.keep(self.host, entry, found)
            timed("disk_to_host", time.monotonic() - start)
        start = time.monotonic()
        staged = self.retried(pool.stage, found)
        timed("host_to_device", time.monotonic() - start)
        self.keep(self.device, entry, staged)
        return staged

    def relieve(self, err: Exception) -> bool:
        """Whether `err` is the device out of memory (XLA's RESOURCE_EXHAUSTED) while the device cache held adapters,
        which it then lets go, so that the work that raised it may be tried once more: the cache gives way before
        a load fails."""
        if "RESOURCE_EXHAUSTED" not in str(err) or not len(self.device):
            return False
        self.device.clear()
        return True

    def retried(self, work: Callable[..., T], *args) -> T:
        """`work(*args)`, run once more if it ran the device out of memory while the device cache held adapters
        (`relieve`)."""
        try:
            return work(*args)
        except RuntimeError as err:
            if not self.relieve(err):
                raise
            return work(*args)

    def drop(self, generation: int) -> None:
        """Forgets an adapter in both tiers (unregistered)."""
        self.host.drop(generation)
        self.device.drop(generation)
