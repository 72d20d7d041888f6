"""`jlora serve`: an OpenAI-compatible multi-LoRA server on an online engine."""

from jlora.server.app import ApiError, build_app
from jlora.server.online import OnlineEngine, QueueFull
from jlora.server.serve import serve

__all__ = ["ApiError", "OnlineEngine", "QueueFull", "build_app", "serve"]
