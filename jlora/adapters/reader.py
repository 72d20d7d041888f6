"""Adapter files read in child processes, so that reading them never holds the engine loop's GIL.

`read_adapter` spends its time in safetensors reads and NumPy conversions, much of it holding the GIL: on a
loader thread each of them makes the engine loop wait up to the interpreter's switch interval (5 ms) whenever
it needs the GIL, which delays its steps while adapters load (docs/performance.md § Tenancy). `ProcessReader`
runs `read_adapter` in child processes (`serve`, started as reads need them) and takes the arrays back through
a shared-memory file mapped into this process: no copy, so taking a result holds the GIL for microseconds. A
child that dies reading a file fails that adapter only and is replaced; one that died while idle fails nothing
(the read goes to another).

Protocol, over the child's stdin and stdout: a request is a pickled `ReadRequest`; the answer a pickled
`(adapter, path, spans)`, the adapter pickled with its arrays out of band in the file at `path` at `spans`
(offset, length), or `(error, None, None)`. Each is preceded by its length (8 bytes, little-endian).
"""

from __future__ import annotations

import atexit
import dataclasses
import io
import mmap
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading

import jax.numpy as jnp
import numpy as np

from jlora.adapters.config import AdapterError
from jlora.adapters.peft import BaseRowsNeeded, HostAdapter, read_adapter
from jlora.models.config import ModelConfig

__all__ = ["ProcessReader", "ReadRequest"]

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None  # else the tmp dir
_ALIGN = 64  # each array's offset in the file


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """`read_adapter`'s arguments but the base rows (a child has no model); `dtype` the slots' type, which A
    and B come back in (float32 for DoRA); `roots` the directories its files must resolve into (empty: any)."""

    adapter_dir: str
    config: ModelConfig
    max_rank: int
    padded_rank: int
    max_extra_vocab: int = 0
    max_seq_len: int | None = None
    dtype: str = "float32"
    roots: tuple[str, ...] = ()

    def read(self, base=None) -> HostAdapter:
        return read_adapter(self.adapter_dir, self.config, self.max_rank, self.padded_rank, base=base,
                            max_extra_vocab=self.max_extra_vocab, max_seq_len=self.max_seq_len,
                            dtype=jnp.dtype(self.dtype), roots=self.roots)


class ProcessReader:
    """Up to `processes` child processes that read adapters; `read` may be called from any number of threads
    (each waits for a free child). The children hold no state: engines share one (`shared`)."""

    _shared: ProcessReader | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, processes: int) -> ProcessReader:
        """This process's reader, with at least `processes` children (ended at exit)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls(processes)
                atexit.register(cls._shared.close)
            reader = cls._shared
        with reader._lock:
            reader.processes = max(reader.processes, processes)
        return reader

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = processes
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._lock = threading.Lock()
        self._started = 0  # children alive or being started
        self._children: list[_Child] = []

    def read(self, request: ReadRequest, base=None, timeout: float | None = None) -> HostAdapter:
        """`request.read(base)`, run in a child process. An adapter that needs the base model's rows (it carries
        embedding layers) is read on this thread instead. A child that has not answered after `timeout` seconds
        (storage that hangs, a file that never ends) is killed and replaced.

        Raises:
          AdapterError: the adapter is invalid (a file outside `request.roots`: OutsideRootsError), reading it
            killed the child, it took longer than `timeout`, or a new child ended before it took the read.
        """
        child = self._sent(request)
        stopped = threading.Event()
        timer = None if timeout is None else threading.Timer(timeout, lambda: (stopped.set(), child.process.kill()))
        if timer is not None:
            timer.start()
        try:
            answer = child.receive()
        except (OSError, EOFError, struct.error, pickle.UnpicklingError) as err:  # the child died reading it
            self._replace(child, timer)
            if stopped.is_set():
                raise AdapterError(f"{request.adapter_dir}: reading it took longer than {timeout:g} s "
                                   "(adapter_read_timeout); the reader process was stopped") from None
            raise AdapterError(f"{request.adapter_dir}: reading it ended the reader process "
                               f"({type(err).__name__}: {err})") from None
        if timer is not None:
            timer.cancel()
            timer.join()  # settled: a kill that raced the answer has happened (its answer still counts)
        result, path, spans = answer
        try:
            adapter = None if path is None else _mapped(result, path, spans)  # before a stopped child's files go
        finally:
            if stopped.is_set():
                self._replace(child, None)
            else:
                self._release(child)
        if adapter is not None:
            return adapter
        if isinstance(result, BaseRowsNeeded):
            return request.read(base)
        raise result

    def close(self) -> None:
        """Ends the idle children; a busy one is ended by its read once it has taken the answer (`_release`), so
        that no answer's file is removed before it is mapped. A later read starts new children."""
        with self._lock:
            self._children, self._started = [], 0
            idle = []
            while not self._idle.empty():
                idle.append(self._idle.get_nowait())
        for child in idle:
            if child is not None:
                child.close()

    def _release(self, child: _Child) -> None:
        """A child back to the idle ones after its read, unless `close` ended it meanwhile."""
        with self._lock:
            ended = child not in self._children
            self._idle.put(None if ended else child)  # None: a read that waits for a child starts one
        if ended:
            child.close()

    def _replace(self, child: _Child, timer: threading.Timer | None) -> None:
        """Ends a child that died or was stopped; the next read starts a new one in its place."""
        if timer is not None:
            timer.cancel()
            timer.join()
        child.close()
        with self._lock:
            if child in self._children:  # else `close` took it (and counted it)
                self._children.remove(child)
                self._started -= 1
            self._idle.put(None)

    def _sent(self, request: ReadRequest) -> _Child:
        """A child that has taken `request`. One that ended while idle (killed from outside, by the OOM killer or
        an operator) cannot take it: it is replaced and the read goes to the next, since no file of this read ended
        it. Only a new child that cannot take a request fails the read (no endless loop of them)."""
        while True:
            child = self._take()
            new = child.new
            try:
                child.send(request)
                return child
            except OSError as err:  # its stdin's other end is closed: the process has ended
                self._replace(child, None)
                if new:
                    raise AdapterError(f"{request.adapter_dir}: a new reader process ended before it took the "
                                       f"read ({type(err).__name__}: {err})") from None

    def _take(self) -> _Child:
        """An idle child, a new one while fewer than `processes` run, else the next to become idle (or the
        place of one that ended: None)."""
        while True:
            with self._lock:
                start = self._idle.empty() and self._started < self.processes
                if start:
                    self._started += 1
                    break
            child = self._idle.get()
            if child is not None:
                return child
        try:
            child = _Child()
        except BaseException:
            with self._lock:
                self._started -= 1
                self._idle.put(None)
            raise
        with self._lock:
            self._children.append(child)
        return child


class _Child:
    """One child process and its pipes."""

    def __init__(self):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the child never computes with JAX: no GPU for it
        # A process group of its own: Ctrl-C in a terminal (SIGINT to the foreground group) stops the server, which
        # ends its children; reaching them too, it would fail the reads in flight and print their tracebacks.
        self.process = subprocess.Popen([sys.executable, "-c", "from jlora.adapters.reader import serve; serve()"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, process_group=0)
        self.new = True  # it has taken no request yet

    def send(self, request: ReadRequest) -> None:
        _send(self.process.stdin, pickle.dumps(request))
        self.new = False

    def receive(self) -> tuple:
        """The answer to the request sent last."""
        return pickle.loads(_receive(self.process.stdout))

    def close(self) -> None:
        """Ends the process and removes any file it left half handed over (it was killed while writing one, or
        after writing it but before its answer was read)."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        _remove_files(self.process.pid)


def _send(pipe, data: bytes) -> None:
    pipe.write(struct.pack("<Q", len(data)))
    pipe.write(data)
    pipe.flush()


def _receive(pipe) -> bytes:
    size, = struct.unpack("<Q", _exactly(pipe, 8))
    return _exactly(pipe, size)


def _exactly(pipe, size: int) -> bytes:
    data = pipe.read(size)
    if len(data) != size:
        raise EOFError(f"the reader process's pipe closed ({len(data)} of {size} bytes)")
    return data


def _prefix(pid: int) -> str:
    """The names of the files a child of process id `pid` hands adapters over in begin with this."""
    return f"jlora-adapter-{pid}-"


def _remove_files(pid: int) -> None:
    """Removes the hand-over files of the child with process id `pid`."""
    for directory in dict.fromkeys(d for d in (_SHM, tempfile.gettempdir()) if d):
        for name in os.listdir(directory):
            if name.startswith(_prefix(pid)):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:  # removed meanwhile
                    pass


def _mapped(pickled: bytes, path: str, spans: list[tuple[int, int]]) -> HostAdapter:
    """The adapter with its arrays over a private mapping of `path` (removed here): pages are shared with the
    file until written, and the mapping lives as long as an array does."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            memory = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
    finally:
        os.unlink(path)
    view = memoryview(memory)
    return pickle.loads(pickled, buffers=[view[offset:offset + length] for offset, length in spans])


class _OutOfBand(pickle.Pickler):
    """Pickles NumPy arrays out of band whatever their dtype (NumPy's own pickling keeps bfloat16 in band)."""

    def reducer_override(self, obj):
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
            return _array, (pickle.PickleBuffer(raw), obj.dtype, obj.shape)
        return NotImplemented


def _array(buffer, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An array over `buffer` (no copy)."""
    return np.frombuffer(buffer, dtype).reshape(shape)


def _answer(request: ReadRequest) -> tuple:
    """In the child: (the adapter pickled with its arrays out of band, the file holding them, their spans)."""
    try:
        adapter = request.read()
    except AdapterError as err:  # BaseRowsNeeded included: the parent reads such an adapter itself
        return err, None, None
    except Exception as err:  # noqa: BLE001 - anything reading a hostile file raised: the parent re-raises it
        return AdapterError(f"{request.adapter_dir}: {type(err).__name__}: {str(err)[:200]}"), None, None
    buffers: list[pickle.PickleBuffer] = []
    data = io.BytesIO()
    _OutOfBand(data, protocol=5, buffer_callback=buffers.append).dump(adapter)
    failure = None
    for directory in dict.fromkeys((_SHM, None)):  # shared memory may be small (a container's 64 MB): then /tmp
        try:
            return data.getvalue(), *_written(buffers, directory)
        except OSError as err:
            failure = err
    return AdapterError(f"{request.adapter_dir}: cannot hand the adapter over ({failure})"), None, None


def _written(buffers: list[pickle.PickleBuffer], directory: str | None) -> tuple[str, list[tuple[int, int]]]:
    """(path, spans): the buffers in a new file of `directory` (None: the temporary directory), removed again
    when writing fails."""
    fd, path = tempfile.mkstemp(prefix=_prefix(os.getpid()), dir=directory)
    spans, offset = [], 0
    try:
        with os.fdopen(fd, "wb") as f:
            for buffer in buffers:
                raw = buffer.raw()
                offset = -(-offset // _ALIGN) * _ALIGN
                f.seek(offset)
                f.write(raw)
                spans.append((offset, raw.nbytes))
                offset += raw.nbytes
    except OSError:
        os.unlink(path)
        raise
    return path, spans


def serve() -> None:
    """A child's loop: answers requests from stdin until it closes, then removes any file of its own left: the
    parent closes its stdin only after taking its last answer (which removes that answer's file), so one left
    is an answer a parent killed before taking it (SIGKILL: it ran no `close`)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the answers
    stdin = sys.stdin.buffer
    try:
        while True:
            try:
                request = pickle.loads(_receive(stdin))
            except EOFError:
                return
            _send(out, pickle.dumps(_answer(request), protocol=5))
    except BrokenPipeError:  # the parent has gone
        pass
    finally:
        _remove_files(os.getpid())
