"""Every adapter an engine can serve, whether or not it sits in a device slot: the registry (name -> directory).

A registration carries a generation, unique over the process: registering a name again (after unregistering
it) gives a new one, so anything keyed by an adapter's identity (its host copy, a failure, a cache entry)
never mistakes the new adapter for the old (`jlora.adapters.tiers`). A failed load is remembered for
`retry_after` seconds, so the requests for a broken adapter fail at once rather than each reading it again, and
a fault that passes (storage back, a reader process killed mid-read, files fixed in place) does not disable the
adapter for good. A directory scanned (`scan`: `jlora serve --lora-dir`) stays watched: an adapter subdirectory
added to it later is registered when a request names it (`find`) or the adapters are listed (`available`), and
one removed is not served while it is gone. The registry is thread-safe: the server reads it from its request
threads while the engine's loop and its loader threads write it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time

from jlora.adapters.config import AdapterError, adapter_file, check_adapter_name

__all__ = ["AdapterRegistry", "Registration", "Scan"]

_generations = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Registration:
    """A registered adapter: its name, directory and generation (unique per registration), the directories its
    files must resolve into whenever they are read (a runtime load's --lora-root; empty: any), and whether it was
    found in a directory scanned (`AdapterRegistry.scan`): then it is not served while its directory is gone."""

    name: str
    adapter_dir: str
    generation: int
    roots: tuple[str, ...] = ()
    watched: bool = False


@dataclasses.dataclass(frozen=True)
class Scan:
    """What `AdapterRegistry.scan` did with a directory's adapter subdirectories."""

    registered: tuple[Registration, ...]
    skipped: tuple[tuple[str, str], ...]  # (subdirectory, why it was not registered)


class AdapterRegistry:
    """name -> `Registration`, independent of device slots, and the registrations whose last load failed.

    Args:
      retry_after: seconds a failed load is remembered (`fail`): requests for it fail at once meanwhile.
    """

    def __init__(self, retry_after: float = 30.0):
        if not retry_after > 0:
            raise ValueError(f"retry_after must be > 0 seconds, got {retry_after}")
        self.retry_after = retry_after
        self._lock = threading.Lock()
        self._entries: dict[str, Registration] = {}
        self._failed: dict[int, tuple[str, float]] = {}  # generation -> (why its load failed, until when: monotonic)
        self._scanned: list[tuple[str, frozenset[str]]] = []  # the directories `scan` registered from, their reserved

    def register(self, name: str, adapter_dir: str, roots: tuple[str, ...] = (), watched: bool = False) -> Registration:
        """Registers `name` for `adapter_dir` under a new generation, its files to be read inside `roots` if given
        (`watched`: found in a directory scanned).

        Raises:
          ValueError: an invalid name, or one registered already (unregister it first).
          AdapterError: `adapter_dir` has no adapter_config.json (the rest is checked when it loads).
        """
        check_adapter_name(name)
        adapter_file(adapter_dir, "adapter_config.json", roots)
        entry = Registration(name, adapter_dir, next(_generations), roots, watched)
        with self._lock:
            if name in self._entries:
                raise ValueError(f"adapter {name!r} is already registered; unload it first")
            self._entries[name] = entry
        return entry

    def scan(self, root: str, reserved: frozenset[str] = frozenset()) -> Scan:
        """Registers every subdirectory of `root` that holds an adapter_config.json, named after it (sorted).
        One whose name is not a valid adapter name, is registered already or is in `reserved` (the served base
        model's name) is skipped, and the result says why. `root` stays watched (`find`, `rescan`)."""
        with self._lock:
            if (root, reserved) not in self._scanned:
                self._scanned.append((root, reserved))
        registered, skipped = [], []
        for sub in sorted(os.listdir(root)):
            path = os.path.join(root, sub)
            if not os.path.isfile(_config(path)):
                continue
            if sub in reserved:
                skipped.append((sub, "the served base model's name"))
                continue
            try:
                registered.append(self.register(sub, path, watched=True))
            except ValueError as err:
                skipped.append((sub, "registered already" if sub in self else str(err)))
        return Scan(tuple(registered), tuple(skipped))

    def rescan(self) -> list[Registration]:
        """Registers the adapter subdirectories added to the directories scanned (`scan`) since; a directory that
        cannot be listed now (removed, unmounted) adds none."""
        registered = []
        for root, _ in list(self._scanned):
            try:
                subs = sorted(os.listdir(root))
            except OSError:
                continue
            # names registered already cost nothing here: `find` registers the others as a request would
            registered += [entry for sub in subs if sub not in self and (entry := self.find(sub)) is not None]
        return registered

    def available(self) -> list[str]:
        """The names a request may use now (`find`), sorted: those registered, with the adapters added to the
        directories scanned since (`rescan`), less those found there whose directory was removed."""
        self.rescan()
        return [name for name in self.names if self.find(name) is not None]

    def find(self, name: str) -> Registration | None:
        """`name`'s registration, if it may be served: not one found in a directory scanned whose directory is gone
        now (it is again once the directory is back). A name not registered is registered first when a directory
        scanned (`scan`) has an adapter subdirectory of that name, added since (or unregistered since): the name is
        one path component there, as `scan` names them. None when neither."""
        entry = self.get(name)
        if entry is not None:
            return None if entry.watched and not os.path.isfile(_config(entry.adapter_dir)) else entry
        if not self._scanned or "/" in name or os.sep in name:
            return None
        try:
            check_adapter_name(name)
        except ValueError:
            return None
        for root, reserved in list(self._scanned):
            path = os.path.join(root, name)
            if name in reserved or not os.path.isfile(_config(path)):
                continue
            try:
                return self.register(name, path, watched=True)
            except (ValueError, AdapterError):  # registered meanwhile on another thread; its config just removed
                return self.get(name)
        return None

    def unregister(self, name: str) -> Registration:
        """Raises KeyError when `name` is not registered."""
        with self._lock:
            entry = self._entries.pop(name)
            self._failed.pop(entry.generation, None)
            return entry

    def get(self, name: str) -> Registration | None:
        return self._entries.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def fail(self, entry: Registration, message: str) -> None:
        """Records that `entry` cannot be loaded: requests for it fail at once (`failure`) for `retry_after`
        seconds, or until it is registered again; the first one after loads it again."""
        with self._lock:
            if self._entries.get(entry.name) is entry:
                self._failed[entry.generation] = (message, time.monotonic() + self.retry_after)

    def failure(self, entry: Registration) -> str | None:
        """Why `entry`'s last load failed, while that is remembered (`fail`); else None."""
        with self._lock:
            failed = self._failed.get(entry.generation)
            if failed is not None and time.monotonic() >= failed[1]:
                del self._failed[entry.generation]
                failed = None
            return None if failed is None else failed[0]


def _config(adapter_dir: str) -> str:
    """The path of `adapter_dir`'s adapter_config.json."""
    return os.path.join(adapter_dir, "adapter_config.json")
