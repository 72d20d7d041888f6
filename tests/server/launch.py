"""Starts `jlora serve` as a user runs it: a subprocess on 127.0.0.1 (float32, JAX on the CPU)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

# `jlora serve`, on which Ctrl-C's SIGINT raises KeyboardInterrupt as in a terminal, also where this process was
# started ignoring SIGINT (a background job of a non-interactive shell: its children inherit the ignoring)
_RUN_WITH_SIGINT = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                    "from jlora.cli import main; sys.exit(main(sys.argv[1:]))")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """(the process, its base URL) once /health answers; `args` are `jlora serve`'s options, `env` its environment
    (default: this process's). A crash prints every thread's stack (faulthandler) into its output."""
    port = _free_port()
    cmd = [sys.executable, "-c", _RUN_WITH_SIGINT, "serve", "--model", model_dir, "--port", str(port), "--dtype",
           "float32", *args]
    env = (os.environ if env is None else env) | {"JAX_PLATFORMS": "cpu", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read().decode())
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, as a process manager stops a server: it exits with the signal's code, and its reader processes
    (which lead process groups of their own, so no group signal reaches them) end with it."""
    children = [pid for pid in process_ids() if _stat(pid)[1] == str(proc.pid)]
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM, proc.stdout.read().decode()[-3000:]
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in children if _stat(pid)[0] not in ("", "Z")]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"reader processes {alive} outlived their server"


def process_ids() -> list[int]:
    """The ids of this machine's processes."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _stat(pid: int) -> tuple[str, str]:
    """(state, parent pid) of a process; ("", "") when it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return tuple(f.read().rsplit(")", 1)[1].split()[:2])
    except OSError:
        return "", ""
