"""The gateway's HTTP/1.1 client for the model servers' POSTs (completions, chat, the other APIs).

Cheaper than aiohttp's ``ClientSession`` for the one thing the hot path does:
``RequestTarget`` holds the request head of one (upstream URL, headers)
pair, built once (method line, Host, the route's Content-Type,
Accept-Encoding and Authorization); a request adds its own few headers,
Content-Length and the body, and goes out in one ``transport.write`` on a
pooled keep-alive connection (``upstream_connections``). ``post`` returns the
``UpstreamResponse`` once its status line and headers have arrived.

A POST sent on a kept-alive connection that the server had closed (EOF or
reset before any byte of an answer) never reached it: it is sent once more on
a new connection. Never when any byte of an answer came, never for a new
connection.

Off the hot path (health checks, model discovery, plugins) the gateway keeps
its aiohttp ``ClientSession``.
"""

from __future__ import annotations

from typing import Callable, Mapping
from urllib.parse import urlsplit

from ...config import ServerConfig
from .connections import ConnectionPool, Origin, UpstreamConnection, UpstreamDisconnected
from .responses import UpstreamResponse

DEFAULT_PORTS = {"http": 80, "https": 443}
# Headers the client writes itself: a request's own headers never replace them.
OWN_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection"))


class RequestTarget:
    """A POST to ``url`` with ``headers``, its head pre-built: ``request(extra, body)`` is what goes out."""

    __slots__ = ("origin", "head", "fixed")

    def __init__(self, url: str, headers: Mapping[str, str]):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or DEFAULT_PORTS[scheme]
        self.origin = Origin(scheme, parts.hostname, port)
        host = parts.netloc.rpartition("@")[2]
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.head = ("\r\n".join(lines) + "\r\n").encode("utf-8")
        self.fixed = OWN_HEADERS | {name.lower() for name in headers}  # a request's headers cannot replace these

    def request(self, extra: Mapping[str, str] | None, body: bytes) -> bytes:
        """The whole request: the head, ``extra`` headers (CR or LF in one drops it), the body."""
        if not extra:
            return b"".join((self.head, b"Content-Length: %d\r\n\r\n" % len(body), body))
        parts = [self.head]
        fixed = self.fixed
        for name, value in extra.items():
            if name.lower() in fixed or "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                continue
            parts.append(f"{name}: {value}\r\n".encode("utf-8"))
        parts.append(b"Content-Length: %d\r\n\r\n" % len(body))
        parts.append(body)
        return b"".join(parts)


class UpstreamClient:
    """One per gateway: a pool per origin, the config's timeouts; ``close()`` hangs up everything."""

    def __init__(self, server: ServerConfig):
        self.keepalive = server.upstream_keepalive_timeout
        self.connect_timeout = server.upstream_connect_timeout
        self.idle_timeout = server.upstream_idle_timeout
        self.pools: dict[Origin, ConnectionPool] = {}
        self.refusal: Callable[[], Exception] | None = None  # the gateway is stopping: nothing is sent

    def refuse(self, error: Callable[[], Exception]) -> None:
        """From now on nothing is sent: requests still waiting for a response's head, and every later
        one, get ``error()``."""
        self.refusal = error
        for pool in self.pools.values():
            pool.fail_waiting(error)

    def pool(self, origin: Origin) -> ConnectionPool:
        pool = self.pools.get(origin)
        if pool is None:
            pool = self.pools[origin] = ConnectionPool(origin, self.keepalive, self.connect_timeout)
        return pool

    async def post(self, target: RequestTarget, extra: Mapping[str, str] | None, body: bytes) -> UpstreamResponse:
        """Send the request; the response once its headers have arrived. Raises ``aiohttp.ClientError``s,
        ``TimeoutError`` (connect or idle timeout) or ``OSError``; see ``upstream_connections``."""
        if self.refusal is not None:
            raise self.refusal()
        data = target.request(extra, body)
        pool = self.pools.get(target.origin) or self.pool(target.origin)
        conn = pool.take()
        if conn is None:
            return await self._exchange(await pool.connect(), data)
        # _exchange in line (a kept-alive connection is the usual case; take() gives none closed)
        response = UpstreamResponse(conn, pool.loop, self.idle_timeout)
        conn.send(data, response)
        try:
            await response.wait_headers()
            return response
        except UpstreamDisconnected as exc:
            response.close()
            if exc.answered:
                raise
        except BaseException:
            response.close()
            raise
        return await self._exchange(await pool.connect(), data)  # the kept-alive one had been closed

    async def _exchange(self, conn: UpstreamConnection, data: bytes) -> UpstreamResponse:
        if conn.closed:
            raise UpstreamDisconnected(False)
        response = UpstreamResponse(conn, conn.pool.loop, self.idle_timeout)  # the loop the connection serves on
        conn.send(data, response)
        try:
            await response.wait_headers()
        except BaseException:
            response.close()
            raise
        return response

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
