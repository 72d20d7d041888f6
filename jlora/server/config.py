"""`ServerConfig`: every option of `jlora serve` beyond the engine's, validated in one place."""

from __future__ import annotations

import dataclasses
import os

from jlora.adapters.config import within

__all__ = ["GENERATION_CONFIGS", "ServerConfig"]

GENERATION_CONFIGS = ("auto", "none")  # where a request's unset sampling settings come from (`ServerConfig`)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The server's options (the engine's are `Engine.from_pretrained`'s).

    Attributes:
      served_model_name: the base model's name in the API (None: the model directory's name).
      host, port: where to listen.
      api_key: when given, every route but /health needs `Authorization: Bearer <api_key>`.
      allow_runtime_lora: enable /v1/load_lora_adapter and /v1/unload_lora_adapter; needs `lora_roots`.
      lora_roots: the directories runtime loads may read from (real paths, symlinks resolved); a load of a
        path that resolves outside all of them answers 403.
      max_waiting: requests waiting for a row beyond which new ones get 503.
      max_body_bytes: the largest request body accepted (413 beyond), enforced while it is read.
      body_timeout: seconds a request's body may take to arrive (408 beyond).
      header_timeout: seconds a connection may take to send a request's headers before it is closed.
      keep_alive: seconds an idle keep-alive connection is held.
      max_connections: open connections beyond which uvicorn answers 503.
      max_concurrent_loads: runtime adapter loads in progress at once (429 beyond).
      generation_config: "auto": a request's unset temperature, top_p, top_k, min_p, repetition_penalty and (chat)
        max_tokens take the model's generation_config.json values (`Engine.generation_defaults`), as vLLM's server
        does; "none": OpenAI's defaults (temperature 1, top_p 1, no top_k, min_p or penalty).
    """

    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_runtime_lora: bool = False
    lora_roots: tuple[str, ...] = ()
    max_waiting: int = 256
    max_body_bytes: int = 1 << 20
    body_timeout: float = 30.0
    header_timeout: float = 10.0
    keep_alive: float = 5.0
    max_connections: int = 1024
    max_concurrent_loads: int = 2
    generation_config: str = "auto"

    def __post_init__(self):
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}")
        for name in ("max_waiting", "max_body_bytes", "max_connections", "max_concurrent_loads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("body_timeout", "header_timeout", "keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.allow_runtime_lora and not self.lora_roots:
            raise ValueError("runtime adapter loading (--allow-runtime-lora) needs at least one --lora-root DIR: "
                             "the directories callers may load adapters from (--lora-root / allows any path "
                             "the server can read)")
        missing = [r for r in self.lora_roots if not os.path.isdir(r)]
        if missing:
            raise ValueError(f"--lora-root {missing[0]!r} is not a directory")
        object.__setattr__(self, "lora_roots", tuple(os.path.realpath(r) for r in self.lora_roots))

    def resolve_lora_path(self, path: str) -> str:
        """The real path (symlinks resolved) of a runtime load's `path`: an absolute path as it is, a relative
        one under the first root where it exists (else the first root). Raises PermissionError when it lies
        outside every root, ValueError when it holds a NUL character."""
        if "\0" in path:
            raise ValueError("the path holds a NUL character")
        inside = [real for root in self.lora_roots
                  if within(real := os.path.realpath(os.path.join(root, path)), root)]
        if not inside:
            raise PermissionError(f"{path!r} is outside the directories adapters may be loaded from")
        return next((real for real in inside if os.path.isdir(real)), inside[0])

