"""uvicorn's server with `jlora serve`'s shutdown, one step per Ctrl-C.

The first Ctrl-C (or SIGTERM) stops taking connections and lets the running requests finish, as uvicorn does. A
second Ctrl-C ends them at once, between two engine steps: each client gets a 503 naming the shutdown, or an error
event and the end of its stream, so the server still exits through its clean path (no request handler is cancelled
mid-response, which logs tracebacks). A third forces the exit, as uvicorn's own second Ctrl-C does; uvicorn's logs
of the handlers it then cancels are left out, as that is what was asked for.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import uvicorn

from jlora.server.online import OnlineEngine

__all__ = ["ShutdownServer"]


class ShutdownServer(uvicorn.Server):
    """`uvicorn.Server` serving `online`'s app, whose second Ctrl-C ends `online`'s requests (above)."""

    def __init__(self, config: uvicorn.Config, online: OnlineEngine):
        super().__init__(config)
        self.online = online
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ending = False  # the second Ctrl-C came: the requests are being ended

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        first, again = not self.should_exit, self.should_exit and sig == signal.SIGINT
        super().handle_exit(sig, frame)  # the first signal: should_exit; another Ctrl-C: force_exit
        # uvicorn raises the signals it caught again once done, to exit as they would have: the first alone. For
        # the first SIGINT asyncio's runner cancels the server's task and raises KeyboardInterrupt once the event
        # loop has returned; for a second it raises it from the handler, inside an iteration of the loop, which
        # uvloop does not reliably survive (a server so ended crashed at exit by SIGSEGV).
        del self._captured_signals[1:]
        if first:
            self._say("shutting down once the running requests end (Ctrl-C again ends them now)")
        elif again and not self._ending:
            self._ending, self.force_exit = True, False
            self._say("ending the running requests (Ctrl-C again exits at once)")
            # On the event loop, not here: a signal handler may run while this thread holds the engine's lock.
            self._loop.call_soon_threadsafe(self.online.end_all, "the server is shutting down")
        elif again:  # uvicorn's forced exit: the tracebacks of the handlers and the lifespan it cancels are no news
            logging.getLogger("uvicorn.error").addFilter(lambda record: False)

    def _say(self, line: str) -> None:
        """Prints `line` from the event loop (a print inside a signal handler can interrupt another print)."""
        self._loop.call_soon_threadsafe(lambda: print(f"jlora serve: {line}", file=sys.stderr, flush=True))
