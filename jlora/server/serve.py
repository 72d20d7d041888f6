"""Builds the server from a model directory and adapters, and runs it under uvicorn."""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import sys
from collections.abc import Sequence

from jlora.adapters.config import check_start_adapters
from jlora.chat import ChatTemplate
from jlora.engine_config import EngineConfig
from jlora.models.loading import eos_token_ids, generation_defaults
from jlora.server.config import ServerConfig

__all__ = ["ServerConfig", "build", "check_start", "serve", "served_name"]


def served_name(model_dir: str, config: ServerConfig) -> str:
    """The base model's name in the API: the config's, else the model directory's name."""
    return config.served_model_name or os.path.basename(os.path.normpath(model_dir))


def check_start(model_dir: str, config: ServerConfig, loras: Sequence[tuple[str, str]]) -> None:
    """What a start reads before the weights, so that a bad file or name stops it before the minutes a large
    checkpoint takes (and, under Ray, before any replica starts): the `--lora` adapters (`check_start_adapters`),
    and the chat template, end-of-sequence ids and sampling defaults that `Engine.from_pretrained` reads. Says
    on stderr which sampling defaults requests get from the model (`ServerConfig.generation_config`).

    Raises:
      ValueError: naming the option or file at fault (`AdapterError` for an adapter's config).
    """
    check_start_adapters(loras, reserved=served_name(model_dir, config))
    eos_token_ids(model_dir)
    ChatTemplate(model_dir)
    defaults = generation_defaults(model_dir).set() if config.generation_config == "auto" else {}
    if defaults:
        print(f"jlora: requests that do not set them take the model's generation_config.json "
              f"{', '.join(f'{k}={v:g}' for k, v in defaults.items())} (--generation-config none: OpenAI's defaults)",
              file=sys.stderr, flush=True)


def build(model_dir: str, config: ServerConfig, engine_config: EngineConfig = EngineConfig(), *,
          loras: Sequence[tuple[str, str]] = (), lora_dirs: Sequence[str] = ()):
    """Loads the model and adapters: (the Starlette app, its `OnlineEngine`, the config with
    `served_model_name` set). The app starts and stops the engine's loop with its lifespan.

    Args:
      model_dir: the HF model directory.
      config: the server's options (`served_model_name` None: the directory's name).
      engine_config: the engine's options.
      loras: (name, directory) of each PEFT adapter to load at start: read and checked now (a bad one stops the
        start), into device slots while there are free ones, all registered.
      lora_dirs: directories whose subdirectories holding an adapter_config.json are registered, named after
        them: read when a request first needs them.
    """
    from jlora.engine import Engine
    from jlora.server.app import build_app
    from jlora.server.online import OnlineEngine

    config = dataclasses.replace(config, served_model_name=served_name(model_dir, config))
    check_start(model_dir, config, loras)
    engine = Engine.from_pretrained(model_dir, engine_config)
    for name, path in loras:
        engine.load_adapter(name, path)
    for root in lora_dirs:
        scan = engine.registry.scan(root, reserved=frozenset({config.served_model_name}))
        count = len(scan.registered)
        print(f"jlora: {count} adapter{'s' * (count != 1)} registered from {root}", file=sys.stderr, flush=True)
        for sub, why in scan.skipped:
            print(f"jlora: skipped {os.path.join(root, sub)}: {why}", file=sys.stderr, flush=True)
    online = OnlineEngine(engine, max_waiting=config.max_waiting)
    app = build_app(online, config)
    gc.collect()  # the objects alive after loading (JAX's, the model's) left out of later collections, which a
    gc.freeze()   # large request's parse triggers while it holds the interpreter lock
    return app, online, config


def serve(model_dir: str, config: ServerConfig, engine_config: EngineConfig = EngineConfig(), *,
          loras: Sequence[tuple[str, str]] = (), lora_dirs: Sequence[str] = ()) -> None:
    """Loads the model and adapters (`build`'s arguments) and serves them until interrupted (`jlora serve`)."""
    import uvicorn

    from jlora.server.protocol import header_deadline_protocol
    from jlora.server.shutdown import ShutdownServer

    with listening_socket(config.host, config.port) as sock:  # closed too when the start fails
        app, online, config = build(model_dir, config, engine_config, loras=loras, lora_dirs=lora_dirs)
        adapters = online.engine.adapters
        shown = (f"{len(adapters)} adapters" if len(adapters) > 16 else
                 f"adapters {adapters}" if adapters else "no adapters")
        host = f"[{config.host}]" if ":" in config.host else config.host
        print(f"jlora: serving {config.served_model_name!r} and {shown} on "
              f"http://{host}:{sock.getsockname()[1]}/v1", file=sys.stderr, flush=True)
        if config.allow_runtime_lora:
            print(f"jlora: runtime adapter loads allowed from {list(config.lora_roots)}"
                  + ("" if config.api_key else " by any caller (no --api-key)"), file=sys.stderr, flush=True)
        server = ShutdownServer(uvicorn.Config(
            app, log_level="warning", http=header_deadline_protocol(config.header_timeout),
            limit_concurrency=config.max_connections, timeout_keep_alive=config.keep_alive), online)
        try:
            server.run(sockets=[sock])
        finally:  # a forced exit skips the app's shutdown: the engine loop still ends before the process does
            online.stop()


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) (port 0: a free one), made before the model loads, so that an address
    in use stops the start at once rather than after the minutes a large checkpoint takes."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        sock.bind(address)
    except OSError as err:
        if sock is not None:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock
