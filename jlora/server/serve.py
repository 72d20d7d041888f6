"""Builds the server from a model directory and adapters, and runs it under uvicorn."""

from __future__ import annotations

import json
import os
import sys

__all__ = ["eos_token_ids", "serve"]


def eos_token_ids(model_dir: str) -> frozenset[int]:
    """The model's end-of-sequence ids (generation_config.json, else config.json): where generation stops."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
            if value is not None:
                return frozenset([value] if isinstance(value, int) else value)
    return frozenset()


def serve(model_dir: str, *, loras: list[tuple[str, str]] = (), served_model_name: str | None = None,
          host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, allow_runtime_lora: bool = False,
          max_waiting: int = 256, **engine_options) -> None:
    """Loads the model and adapters and serves them until interrupted (`jlora serve`).

    Args:
      model_dir: the HF model directory.
      loras: (name, directory) of each PEFT adapter to load at start.
      served_model_name: the base model's name in the API (default: the directory's name).
      host, port: where to listen.
      api_key: when given, every route but /health needs `Authorization: Bearer <api_key>`.
      allow_runtime_lora: enable /v1/load_lora_adapter and /v1/unload_lora_adapter.
      max_waiting: requests waiting for a row beyond which new ones get 503.
      engine_options: `Engine.from_pretrained`'s options (max_loras, max_lora_rank, max_batch, prefill_chunk, ...).
    """
    import uvicorn

    from jlora.engine import Engine
    from jlora.server.app import build_app
    from jlora.server.chat import ChatTemplate
    from jlora.server.online import OnlineEngine

    engine = Engine.from_pretrained(model_dir, **engine_options)
    for name, path in loras:
        engine.load_adapter(name, path)
    name = served_model_name or os.path.basename(os.path.normpath(model_dir))
    online = OnlineEngine(engine, max_waiting=max_waiting)
    app = build_app(online, served_model_name=name, chat=ChatTemplate(model_dir), eos_token_ids=eos_token_ids(model_dir),
                    api_key=api_key, allow_runtime_lora=allow_runtime_lora, adapter_paths=dict(loras))
    print(f"jlora: serving {name!r} and adapters {engine.adapters} on http://{host}:{port}/v1", file=sys.stderr,
          flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
