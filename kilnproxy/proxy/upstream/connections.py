"""HTTP/1.1 connections to the model servers, kept alive in one pool per origin.

``UpstreamConnection`` is an asyncio protocol that carries one request at a
time and parses the answer with httptools (llhttp, the C parser uvicorn uses)
into its ``UpstreamResponse``. It goes back to its ``ConnectionPool`` the
moment a whole message has arrived on a connection both sides keep alive; any
other end (a parse error, a hang-up, a response closed early) closes it.

``ConnectionPool`` hands out its most recently used idle connection (the one
least likely to be closing), closes connections idle for ``keepalive``
seconds (shorter than the servers' own idle timeout, so that a request never
goes out on a connection the server is closing at that moment), and opens new
ones within ``connect_timeout`` seconds.

Errors: a refused or failed connect is ``aiohttp.ClientConnectorError``, a
connect that takes too long ``TimeoutError``; a connection that ends before the
response's headers is ``UpstreamDisconnected`` (``answered`` tells whether any
byte of an answer came), one that ends inside a body of known length
``UpstreamPayloadError``, bytes that are not HTTP ``UpstreamBadResponse`` (a
status line or header llhttp refuses, a status below 100, a switch of
protocols, broken chunked framing). All are ``aiohttp.ClientError``s, as the
callers caught before; ``UpstreamBadResponse`` is the one that says a server
answered, but not in HTTP (the request path's ``upstream_bad_response``).
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from typing import Callable, NamedTuple

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from .responses import UpstreamResponse


class UpstreamDisconnected(aiohttp.ServerDisconnectedError):
    """The connection ended before the response's status line and headers were complete."""

    def __init__(self, answered: bool, cause: BaseException | None = None):
        detail = "mid-headers" if answered else "before answering"
        super().__init__(f"Server disconnected {detail}" + (f": {cause}" if cause else ""))
        self.answered = answered  # some byte of an answer arrived: the request must not be sent again


class UpstreamPayloadError(aiohttp.ClientPayloadError):
    """The connection ended before the end of a body whose length was known (chunked, Content-Length)."""


class UpstreamBadResponse(aiohttp.ClientResponseError):
    """The upstream sent bytes that are not an HTTP/1.1 response."""

    def __init__(self, message: str):
        super().__init__(None, (), message=message)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return self.message


class Origin(NamedTuple):
    """Where connections go: the pool's key (also what ``ClientConnectorError`` reads)."""

    scheme: str
    host: str
    port: int

    @property
    def ssl(self) -> bool:
        return self.scheme == "https"


class UpstreamConnection(asyncio.Protocol):
    """One connection; ``send(data, response)`` when idle, the answer goes to ``response``."""

    __slots__ = ("pool", "transport", "parser", "response", "header_list", "received", "closed", "idle_since",
                 "delimited_by_close", "informational")

    def __init__(self, pool: "ConnectionPool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.header_list: list[tuple[str, str]] = []  # the answer's headers, decoded as they arrive
        self.received = False  # a byte of the current answer arrived
        self.closed = False
        self.idle_since = 0.0
        self.delimited_by_close = False  # the current body ends when the connection does
        self.informational = False  # a 1xx head, skipped

    def send(self, data: bytes, response: UpstreamResponse) -> None:
        self.response = response
        self.received = False
        self.header_list = []
        self.transport.write(data)

    def hang_up(self) -> None:
        """Close the connection; it is never used again."""
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            self.transport.close()

    # -- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.hang_up()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBadResponse(f"invalid HTTP response: {exc}"))
        except httptools.HttpParserUpgrade:  # 101 Switching Protocols: no answer of ours follows
            self._fail(UpstreamBadResponse("the upstream switched protocols"))

    def eof_received(self) -> None:
        return None  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        response, self.response = self.response, None
        if response is None:
            return
        if response.headers is None:
            response.broke(UpstreamDisconnected(self.received, exc))
        elif self.delimited_by_close and exc is None:
            response.ended()
        else:
            response.broke(UpstreamPayloadError(f"Response payload is not completed: {exc!r}"))

    def _fail(self, exc: BaseException) -> None:
        response, self.response = self.response, None
        if response is not None:
            response.broke(exc)
        self.hang_up()

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.response is None:  # a second answer after the one asked for: never reuse the connection
            self.hang_up()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_list.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        response = self.response
        status = self.parser.get_status_code()
        if status < 100:  # llhttp reads any three digits: "000" is no status, not an interim answer
            self._fail(UpstreamBadResponse(f"invalid HTTP response: status {status:03d}"))
            return
        if status < 200:  # 100 Continue and the like: the answer follows
            self.informational = True
            self.header_list = []
            return
        headers = CIMultiDict(self.header_list)
        # no length and not chunked: the body ends with the connection (RFC 9112 6.3)
        self.delimited_by_close = "Content-Length" not in headers \
            and "chunked" not in headers.get("Transfer-Encoding", "").lower()
        if response is not None:
            response.headers_arrived(status, CIMultiDictProxy(headers))

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:
            response.body_arrived(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        response, self.response = self.response, None
        if response is None:
            return
        response.ended()
        if self.parser.should_keep_alive() and not self.closed:
            self.pool.put_back(self)
        else:
            self.hang_up()


class ConnectionPool:
    """Connections to one origin: idle ones kept for ``keepalive`` seconds, new ones opened on demand."""

    def __init__(self, origin: Origin, keepalive: float, connect_timeout: float):
        self.origin = origin
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self.loop = asyncio.get_running_loop()
        self.idle: list[UpstreamConnection] = []  # the most recently used last
        self.open: set[UpstreamConnection] = set()
        self.sweep: asyncio.TimerHandle | None = None
        self.ssl = ssl_module.create_default_context() if origin.ssl else None

    def take(self) -> UpstreamConnection | None:
        """An idle connection young enough to use, or None."""
        idle = self.idle
        oldest = self.loop.time() - self.keepalive
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing():
                continue
            if conn.idle_since <= oldest:
                conn.hang_up()
                continue
            return conn
        return None

    async def connect(self) -> UpstreamConnection:
        """A new connection (``ClientConnectorError`` when refused, ``TimeoutError`` past the timeout)."""
        origin = self.origin
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: UpstreamConnection(self), origin.host, origin.port, ssl=self.ssl,
                    server_hostname=origin.host if self.ssl else None)
        except OSError as exc:
            raise aiohttp.ClientConnectorError(origin, exc) from exc  # type: ignore[arg-type]
        self.open.add(conn)
        return conn

    def put_back(self, conn: UpstreamConnection) -> None:
        conn.idle_since = self.loop.time()
        self.idle.append(conn)
        if self.sweep is None:
            self.sweep = self.loop.call_at(conn.idle_since + self.keepalive, self._sweep)

    def forget(self, conn: UpstreamConnection) -> None:
        self.open.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive``; come back for the next one due."""
        self.sweep = None
        oldest = self.loop.time() - self.keepalive
        for conn in [c for c in self.idle if c.idle_since <= oldest]:
            conn.hang_up()
        if self.idle:
            self.sweep = self.loop.call_at(self.idle[0].idle_since + self.keepalive, self._sweep)

    def fail_waiting(self, error: Callable[[], Exception]) -> None:
        """Every request still waiting for its response's head gets ``error()``; its connection is closed."""
        for conn in list(self.open):
            if conn.response is not None and conn.response.headers is None:
                conn._fail(error())

    def close(self) -> None:
        """Close every connection, idle or not."""
        if self.sweep is not None:
            self.sweep.cancel()
            self.sweep = None
        for conn in list(self.open):
            conn.hang_up()
        self.idle.clear()
