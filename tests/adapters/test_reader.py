"""Adapters read in child processes (`ProcessReader`) equal those read on the calling thread, bit for bit; a
child that dies or hangs fails one read and is replaced; no shared-memory file outlives its read."""

import concurrent.futures
import dataclasses
import glob
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest

from jlora import testing
from jlora.adapters import AdapterError
from jlora.adapters.config import OutsideRootsError
from jlora.adapters.reader import ProcessReader, ReadRequest
from jlora.engine import Engine
from jlora.models.config import ModelConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "peft", "llama")
CFG = testing.tiny_config("llama")


SHARED = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()  # where answers are handed over


@pytest.fixture
def leftover_files():
    """A function: the hand-over files made since the test began, but those of live readers that are not this
    process's (another test worker's). Files an earlier run left are not this test's."""
    def foreign(path: str) -> bool:
        try:
            with open(f"/proc/{os.path.basename(path).split('-')[2]}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1]) != os.getpid()  # its parent
        except (OSError, ValueError, IndexError):
            return False  # its reader has ended

    def files() -> set[str]:
        return set(glob.glob(os.path.join(SHARED, "jlora-adapter-*")))

    before = files()
    return lambda: sorted(p for p in files() - before if not foreign(p))


def _same(a, b) -> None:
    """Equal pytrees, dataclasses (a HostAdapter), dicts and tuples of arrays, bit for bit."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for field in dataclasses.fields(a):
            _same(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
        assert len(la) == len(lb)
        for x, y in zip(la, lb):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_peft_feature_reads_the_same_in_a_child_process(dtype, leftover_files):
    """PEFT's own files of every feature (DoRA, LoRA bias, saved and added embedding rows, trainable tokens,
    LongLoRA; those with embedding rows read back here with the base's) give the same slots either way, in
    float32 and in bf16 (A and B cast by the child). Those a bf16 engine refuses (lm_head rows that
    differ from the bf16 base) are refused with the same message either way."""
    names = sorted(n for n in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, n, "adapter_config.json")))
    assert {"dora", "bias", "emb", "tokens", "long"} <= set(names)
    pools, outcomes = [], []
    for readers in (0, 2):
        engine = Engine.from_pretrained(os.path.join(FIXTURES, "model"), dtype=dtype, max_loras=len(names),
                                        max_lora_rank=16, max_seq_len=64, max_extra_vocab=128, progress=False,
                                        adapter_readers=readers)
        assert (engine.pool.reader is None) == (readers == 0)
        assert engine.loader._max_workers == 4 and engine.max_loads == 8  # readers <= 4: the defaults
        outcome = {}
        for name in names:
            try:
                engine.load_adapter(name, os.path.join(FIXTURES, name))
            except AdapterError as err:
                outcome[name] = str(err)
        pools.append(engine.pool)
        outcomes.append(outcome)
    assert outcomes[0] == outcomes[1]
    assert {"plain", "long", "emb"} <= set(pools[0].names) and (dtype == "bfloat16" or not outcomes[0]), outcomes[0]
    (thread, process) = pools
    assert thread.names == process.names
    np.testing.assert_array_equal(thread.ranks, process.ranks)
    _same(thread.weights, process.weights)
    assert not leftover_files()


def _request_and_truth(tmp_path) -> tuple[ReadRequest, object]:
    """A request for an r=4 adapter written to tmp_path, and the adapter read on this thread."""
    path = str(tmp_path / "a")
    testing.write_adapter(path, CFG, r=4, alpha=8, seed=0)
    request = ReadRequest(path, ModelConfig.from_hf_config(CFG), 8, 16)
    return request, request.read()


def test_many_threads_share_few_children(tmp_path, leftover_files):
    config = ModelConfig.from_hf_config(CFG)
    requests = []
    for i in range(6):
        path = str(tmp_path / f"a{i}")
        testing.write_adapter(path, CFG, r=2 + i, alpha=8, seed=i, target_modules=["q_proj", "v_proj", "down_proj"])
        requests.append(ReadRequest(path, config, 8, 16, dtype="bfloat16" if i % 2 else "float32"))
    reader = ProcessReader(2)
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as threads:
            got = list(threads.map(reader.read, requests))
        assert len(reader._children) == 2
        for request, adapter in zip(requests, got):
            assert adapter.layers[0]["qkv"][0].dtype.name == request.dtype  # cast in the child
            _same(adapter, request.read())
    finally:
        reader.close()
    assert not leftover_files()


def test_a_bad_file_and_a_dead_child_fail_only_their_read(tmp_path, leftover_files, monkeypatch):
    """A file the parser refuses fails its read and the child serves on; a child that dies during a read (as if a
    file had crashed the parser) fails that read and is replaced."""
    config = ModelConfig.from_hf_config(CFG)
    good = str(tmp_path / "good")
    testing.write_adapter(good, CFG, r=4, alpha=8, seed=0)
    bad = str(tmp_path / "bad")
    testing.write_adapter(bad, CFG, r=4, alpha=8, seed=1)
    with open(os.path.join(bad, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x10garbage")
    reader = ProcessReader(1)
    try:
        with pytest.raises(AdapterError, match="cannot read safetensors"):
            reader.read(ReadRequest(bad, config, 8, 16))
        want = ReadRequest(good, config, 8, 16).read()
        _same(reader.read(ReadRequest(good, config, 8, 16)), want)  # the same child, still serving

        dead = reader._children[0].process
        half_written = os.path.join(SHARED, f"jlora-adapter-{dead.pid}-x")
        open(half_written, "wb").close()  # as if it had died writing its answer
        os.kill(dead.pid, signal.SIGSTOP)  # it takes the request but reads nothing ...
        receive = type(reader._children[0]).receive

        def killed_reading(child):  # ... and is killed once the read waits for its answer
            dead.kill()
            return receive(child)

        monkeypatch.setattr(type(reader._children[0]), "receive", killed_reading)
        with pytest.raises(AdapterError, match="ended the reader process"):
            reader.read(ReadRequest(good, config, 8, 16))
        monkeypatch.undo()
        _same(reader.read(ReadRequest(good, config, 8, 16)), want)  # a new child took its place
        assert len(reader._children) == 1 and not os.path.exists(half_written)
    finally:
        reader.close()
    assert not leftover_files()


def test_children_that_died_while_idle_fail_no_read(tmp_path, leftover_files, monkeypatch):
    """Children killed between reads (the OOM killer, an operator's kill) cannot take a request: each read goes to
    a new child and returns its adapter, however many of the idle children died; only a new child that cannot
    take a request fails the read, at once."""
    request, want = _request_and_truth(tmp_path)
    reader = ProcessReader(3)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as threads:  # three children, all idle after
            for got in threads.map(lambda _: reader.read(request), range(3)):
                _same(got, want)
        dead = [child.process for child in reader._children]
        assert len(dead) == 3
        for process in dead:
            process.kill()
            process.wait()
        for _ in range(4):  # one read per dead child, and one more
            _same(reader.read(request), want)
        assert len(reader._children) == 1 and reader._children[0].process not in dead

        child_type = type(reader._children[0])
        reader._children[0].process.kill()
        reader._children[0].process.wait()
        monkeypatch.setattr(child_type, "send", lambda child, request: child.process.stdin.close() or
                            (_ for _ in ()).throw(BrokenPipeError(32, "Broken pipe")))  # no child takes it
        with pytest.raises(AdapterError, match="a new reader process ended before it took the read"):
            reader.read(request)
        monkeypatch.undo()
        _same(reader.read(request), want)
    finally:
        reader.close()
    assert not leftover_files()


def test_a_read_inside_roots_refuses_a_file_linked_outside_them_every_time(tmp_path, leftover_files):
    """A runtime load's adapter is read inside --lora-root whenever it is read: a file of its directory replaced
    after its load by a link to one outside (read again after an eviction) is refused in the reader child, as its
    own error type; a link to a file inside is read."""
    root, outside = os.path.realpath(tmp_path / "root"), os.path.realpath(tmp_path / "outside")
    for path, seed in [(os.path.join(root, "a"), 0), (os.path.join(root, "b"), 1), (os.path.join(outside, "c"), 2)]:
        testing.write_adapter(path, CFG, r=4, alpha=8, seed=seed)
    request = ReadRequest(os.path.join(root, "a"), ModelConfig.from_hf_config(CFG), 8, 16, roots=(root,))
    weights = os.path.join(root, "a", "adapter_model.safetensors")
    reader = ProcessReader(1)
    try:
        _same(reader.read(request), request.read())
        os.remove(weights)
        os.symlink(os.path.join(outside, "c", "adapter_model.safetensors"), weights)
        with pytest.raises(OutsideRootsError, match="a: adapter_model.safetensors leads through a link outside the "
                                                    "directories adapters may be loaded from$") as refused:
            reader.read(request)
        assert outside not in str(refused.value)  # where the link leads is not said
        weights_of = lambda adapter: dataclasses.replace(adapter, files="")  # noqa: E731 - "a"'s files, "c"'s data
        _same(weights_of(reader.read(dataclasses.replace(request, roots=()))),  # no roots: read where a link leads
              weights_of(ReadRequest(os.path.join(outside, "c"), request.config, 8, 16).read()))
        os.remove(weights)
        os.symlink(os.path.join(root, "b", "adapter_model.safetensors"), weights)
        _same(weights_of(reader.read(request)),
              weights_of(ReadRequest(os.path.join(root, "b"), request.config, 8, 16).read()))
    finally:
        reader.close()
    assert not leftover_files()


def test_a_read_that_hangs_is_stopped_at_the_timeout(tmp_path, leftover_files):
    """A child that never answers (storage that hangs: here a stopped process) is killed at the timeout; the
    read fails with a message that names the limit, and the next read gets a new child. A read that answers
    in time is unaffected by its timer."""
    request, want = _request_and_truth(tmp_path)
    reader = ProcessReader(1)
    try:
        _same(reader.read(request, timeout=60), want)
        stuck = reader._children[0].process
        os.kill(stuck.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(AdapterError, match=r"took longer than 0.5 s \(adapter_read_timeout\)"):
            reader.read(request, timeout=0.5)
        assert time.monotonic() - start < 10 and stuck.poll() is not None  # killed, not left stopped
        _same(reader.read(request, timeout=60), want)
        assert len(reader._children) == 1 and reader._children[0].process is not stuck
    finally:
        reader.close()
    assert not leftover_files()


def test_a_read_in_flight_when_the_reader_closes_ends_its_child(tmp_path, leftover_files):
    """`close` while a read is in flight and another waits for a child: `close` returns at once; the read in
    flight still gets its answer and then ends its child (not handed to a later read: its reader was closed);
    the waiting read starts a new child."""
    request, want = _request_and_truth(tmp_path)
    reader = ProcessReader(1)
    try:
        _same(reader.read(request), want)
        child = reader._children[0].process
        os.kill(child.pid, signal.SIGSTOP)  # the next read waits for its answer until the child goes on
        with concurrent.futures.ThreadPoolExecutor(2) as threads:
            in_flight = threads.submit(reader.read, request)
            while not reader._idle.empty():  # the read has taken the child
                time.sleep(0.01)
            waiting = threads.submit(reader.read, request)
            time.sleep(0.2)
            reader.close()
            assert not waiting.done() and child.poll() is None
            os.kill(child.pid, signal.SIGCONT)
            _same(in_flight.result(timeout=60), want)
            _same(waiting.result(timeout=60), want)
        assert child.poll() is not None
        assert len(reader._children) == 1 and reader._children[0].process is not child
    finally:
        reader.close()
    assert not leftover_files()


def _parent_killed_after_its_child_answered(tmp_path) -> tuple[int, str]:
    """Runs a process that asks a reader child for an adapter and is killed (SIGKILL: no `close` runs) once the
    child has written its answer's file, before reading the answer. Returns (the child's pid, that file)."""
    request, _ = _request_and_truth(tmp_path)
    with open(tmp_path / "request.pkl", "wb") as f:
        pickle.dump(request, f)
    code = (f"import time; from jlora.adapters import reader\n"
            f"child = reader._Child()\n"
            f"reader._send(child.process.stdin, open({str(tmp_path / 'request.pkl')!r}, 'rb').read())\n"
            f"print(child.process.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    for _ in range(600):
        written = glob.glob(os.path.join(SHARED, f"jlora-adapter-{pid}-*")) + \
            glob.glob(os.path.join(tempfile.gettempdir(), f"jlora-adapter-{pid}-*"))
        if written:
            break
        time.sleep(0.05)
    assert written, "the child wrote no answer"
    time.sleep(0.2)  # the answer's bytes are in the pipe: the child waits for the next request
    parent.kill()
    parent.wait()
    return pid, written[0]


def test_a_child_whose_parent_was_killed_removes_its_answers_file(tmp_path):
    """A server killed with SIGKILL (the OOM killer, `kill -9`) runs no `close`: its reader child, left with an
    answer its parent never took, removes that file (shared memory lives until a reboot) and ends."""
    pid, written = _parent_killed_after_its_child_answered(tmp_path)
    for _ in range(600):
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail("the child did not end when its parent died")
    assert not os.path.exists(written)


def test_ctrl_c_reaches_the_server_not_its_reader_children(tmp_path, leftover_files):
    """Ctrl-C in a terminal signals the foreground process group: a reader child leads a group of its own, so
    no read in flight fails and no child prints a traceback of its own; the server ends the children when it
    shuts down."""
    request, want = _request_and_truth(tmp_path)
    reader = ProcessReader(1)
    try:
        _same(reader.read(request), want)
        child = reader._children[0].process
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
    finally:
        reader.close()
    assert child.poll() is not None and not leftover_files()


def test_a_full_shared_memory_hands_over_through_the_temporary_directory(tmp_path, monkeypatch):
    """A container's /dev/shm is often 64 MB: a child that cannot write there writes to the temporary directory,
    and one that can write nowhere fails that adapter with a message that says so."""
    from jlora.adapters import reader

    path = str(tmp_path / "a")
    testing.write_adapter(path, CFG, r=4, alpha=8, seed=0)
    request = ReadRequest(path, ModelConfig.from_hf_config(CFG), 8, 16)
    monkeypatch.setattr(reader, "_SHM", str(tmp_path / "no-such-shm"))
    pickled, file, spans = reader._answer(request)
    assert os.path.dirname(file) == tempfile.gettempdir()
    _same(reader._mapped(pickled, file, spans), request.read())
    assert not os.path.exists(file)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    error, file, _ = reader._answer(request)
    assert file is None and isinstance(error, AdapterError)
    assert "cannot hand the adapter over" in str(error) and "no-such-tmp" in str(error)


def test_the_loader_keeps_every_reader_busy():
    """More reader processes than the 4 loader threads: as many threads, so all of them read at once."""
    engine = Engine.from_pretrained(os.path.join(FIXTURES, "model"), dtype="float32", progress=False,
                                    adapter_readers=6)
    assert engine.loader._max_workers == 6 and engine.max_loads == 12
    assert engine.pool.reader.processes >= 6


def test_a_read_that_a_writer_changes_is_read_again_and_never_mixes_two_states(tmp_path, monkeypatch):
    """Files rewritten while they are read (a copy into place still being written): the read starts over, so the
    adapter is one state of the files, never the old config with the new weights, and an error that the
    half-written file gave is not kept; files that change at every read fail naming that; a broken file that
    does not change fails at once, read once."""
    from jlora.adapters import peft

    config = ModelConfig.from_hf_config(CFG)
    path, want = str(tmp_path / "a"), str(tmp_path / "want")
    testing.write_adapter(want, CFG, r=4, alpha=16, seed=2)
    read_tensors, calls = peft._read_tensors, []

    def writer(action):
        def read(*args):
            calls.append(1)
            out = read_tensors(*args)  # raises for the half-written file
            action(len(calls))
            return out
        return read

    def rewrite(n):  # the first read took the r=2 config and weights: the writer puts r=4 ones in place
        if n == 1:
            testing.write_adapter(path, CFG, r=4, alpha=16, seed=2)

    testing.write_adapter(path, CFG, r=2, alpha=8, seed=1)
    monkeypatch.setattr(peft, "_read_tensors", writer(rewrite))
    got = peft.read_adapter(path, config, 8, 8)
    fresh = peft.read_adapter(want, config, 8, 8)
    assert len(calls) == 3 and got.rank == 4 and got.files == peft.files_version(path)  # 2 reads, + want's
    for lg, lw in zip(got.layers, fresh.layers):
        for g in lw:
            np.testing.assert_array_equal(lg[g][0], lw[g][0])
            np.testing.assert_array_equal(lg[g][1], lw[g][1])

    calls.clear()
    weights = f"{path}/adapter_model.safetensors"
    good = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(good[: len(good) // 2])  # half written: the writer finishes during the read

    def finish(*args):
        calls.append(1)
        try:
            return read_tensors(*args)  # the first: cannot read the half-written file
        finally:
            if len(calls) == 1:
                with open(weights, "wb") as f:
                    f.write(good)

    monkeypatch.setattr(peft, "_read_tensors", finish)
    assert peft.read_adapter(path, config, 8, 8).rank == 4 and len(calls) == 2

    calls.clear()
    ns = iter(range(10**18, 2 * 10**18, 10**9))
    monkeypatch.setattr(peft, "_read_tensors", writer(lambda n: os.utime(weights, ns=(next(ns), next(ns)))))
    with pytest.raises(AdapterError, match="changed while they were read, 3 times"):
        peft.read_adapter(path, config, 8, 8)
    assert len(calls) == 3

    calls.clear()
    with open(weights, "wb") as f:
        f.write(b"\x10garbage")
    monkeypatch.setattr(peft, "_read_tensors", writer(lambda n: None))
    with pytest.raises(AdapterError, match="cannot read safetensors"):
        peft.read_adapter(path, config, 8, 8)
    assert len(calls) == 1
