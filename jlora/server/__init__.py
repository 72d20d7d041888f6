"""`jlora serve`: an OpenAI-compatible multi-LoRA server on an online engine.

`build_app`, `ApiError`, `OnlineEngine` and `QueueFull` load their module on first use, so a module that
needs none of the serving packages (`jlora.server.text`) imports without them.
"""

import importlib

from jlora.server.config import ServerConfig
from jlora.server.serve import serve  # imports uvicorn only when called

__all__ = ["ApiError", "OnlineEngine", "QueueFull", "ServerConfig", "build_app", "serve"]
_MODULES = {"ApiError": "errors", "build_app": "app", "OnlineEngine": "online", "QueueFull": "online"}


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'jlora.server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jlora.server.{_MODULES[name]}"), name)
