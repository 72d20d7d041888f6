"""uvicorn's h11 HTTP/1.1 protocol with a deadline on a request's headers.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a connection that sends part of
its headers and then nothing (slowloris) is held open without limit, before the app ever sees it. Here a
connection has `header_timeout` seconds from its first byte, or from the end of its previous response, to
complete the headers of its next request; otherwise it is closed. The body's deadline is the app's
(`ServerConfig.body_timeout`).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["header_deadline_protocol"]


class _HeaderDeadlineH11(H11Protocol):
    header_timeout: float  # set by header_deadline_protocol

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._cycle_at_arm = None  # the request cycle current when the deadline was set: a new one ends the wait

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of a request after a response
        super().data_received(data)
        if self._deadline is not None and self.cycle is not self._cycle_at_arm:
            self._disarm()  # its headers are complete

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._cycle_at_arm = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.cycle is self._cycle_at_arm and not self.transport.is_closing():
            self.transport.close()


def header_deadline_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`: h11 with `header_timeout` seconds for headers."""
    return type("HeaderDeadlineH11", (_HeaderDeadlineH11,), {"header_timeout": header_timeout})
