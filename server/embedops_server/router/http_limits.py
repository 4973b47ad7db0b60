"""HTTP limits a hardened server has and uvicorn's httptools protocol does not (issue 53): the size and number of a
request's header lines (431), a deadline for receiving a whole request, headers and body (408, then the connection
is closed), counted from the connection's first byte or its previous answer. uvicorn's own `limit_concurrency`
bounds the connections (503 beyond).

Measured before (`--max-concurrent-requests 16`): a 1 MiB header and 20,000 headers were served (200); 300
connections sending a header byte every 5 s were all kept open for 70 s; TEI 1.9.3 answers 431 to the first two
and keeps the slow ones too (docs/security.md).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024  # the request line and every header line, as nginx's 4 x 8k buffers and more
    max_headers: int = 100  # hyper's (TEI's HTTP library) default
    request_timeout: float = 30.0  # from a request's first byte (or the connection's start) to its last


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that was already answered."""


def _response(status: int, reason: str, message: str) -> bytes:
    """A JSON error in TEI's shape, and the connection closed."""
    body = ('{"error":"%s","error_type":"Validation"}' % message.replace('"', "'")).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason.encode(), len(body))) + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `HttpLimits` (read from `config.http_limits`)."""

    def __init__(self, config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.limits: HttpLimits = getattr(config, "http_limits", None) or HttpLimits()
        self._refused = False
        self._header_bytes = 0
        self._header_count = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._receiving = False  # a request has begun and is not whole yet

    # --- the deadline: armed at connect and at each request's first byte, cancelled once it is whole
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.limits.request_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._receiving or self.cycle is None:
            # a connection that sent nothing, or a request not whole in time: a slow client holds a connection
            # (and, once its headers are in, an admission slot) for as long as it likes otherwise
            self._refuse(408, "Request Timeout", f"request not received within {self.limits.request_timeout:g} s")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = self._header_count = 0
        self._receiving = True
        self._arm()

    def on_message_complete(self) -> None:
        self._receiving = False
        self._disarm()
        super().on_message_complete()

    # --- header size and count
    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4, 1)
        super().on_header(name, value)

    def _count(self, size: int, headers: int) -> None:
        self._header_bytes += size
        self._header_count += headers
        if self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, "Request Header Fields Too Large",
                         f"request header fields over {self.limits.max_header_bytes} bytes")
            raise _Refused
        if self._header_count > self.limits.max_headers:
            self._refuse(431, "Request Header Fields Too Large",
                         f"more than {self.limits.max_headers} request header fields")
            raise _Refused

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self._refused = True
        self._disarm()
        if self.cycle is not None:
            self.cycle.disconnected = True  # the app's receive() sees the client gone; it answers nothing more
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_response(status, reason, message))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)  # a _Refused from a callback arrives as a parser error: answered already

    def send_400_response(self, msg: str) -> None:
        if not self._refused:
            super().send_400_response(msg)
