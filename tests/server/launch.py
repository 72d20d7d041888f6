"""Starts `jlora serve` as a user runs it: a subprocess on 127.0.0.1 (float32, JAX on the CPU)."""

import os
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, *args: str) -> tuple[subprocess.Popen, str]:
    """(the process, its base URL) once /health answers; `args` are `jlora serve`'s options."""
    port = _free_port()
    cmd = [sys.executable, "-m", "jlora", "serve", "--model", model_dir, "--port", str(port), "--dtype", "float32",
           *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ | {"JAX_PLATFORMS": "cpu"})
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
