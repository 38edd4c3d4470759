"""HTTP/1.1 over a raw socket: for requests that client libraries refuse to send.

``exchange(url, data)`` writes ``data`` as it is and reads one response (a
``Content-Length`` body, a chunked body, or everything up to the close);
``exchange_all`` sends several on one connection, to see whether it stays
usable. ``read_request`` is the other side: a raw upstream's read of one POST. The timeout only stops a test that would otherwise hang; no assertion
depends on it.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

GIVE_UP_SECONDS = 30.0


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    closed: bool = False  # the response said it closes the connection (Connection: close, HTTP/1.0)

    def json(self):
        return orjson.loads(self.body)

    @property
    def error_code(self):
        return self.json()["error"]["code"]


@asynccontextmanager
async def raw_server(serve):
    """A server running ``serve(reader, writer)`` on each connection: its base URL (``.../v1``)."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()
        await server.wait_closed()


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


async def exchange(url: str, data: bytes) -> RawResponse:
    """Send ``data`` on a new connection and read one response (no body if ``data`` is a HEAD)."""
    responses = await exchange_all(url, data)
    assert responses, "the server closed the connection without an answer"
    return responses[0]


async def exchange_all(url: str, *requests: bytes) -> list[RawResponse]:
    """Send each request on one connection, each after the answer to the one before; the
    answers, fewer than the requests when the server closed the connection early."""
    reader, writer = await asyncio.open_connection(*address(url))
    out: list[RawResponse] = []
    try:
        async with asyncio.timeout(GIVE_UP_SECONDS):
            for data in requests:
                writer.write(data)
                await writer.drain()
                try:
                    out.append(await read_response(reader, head=data.startswith(b"HEAD ")))
                except (asyncio.IncompleteReadError, ConnectionResetError):
                    break
                if out[-1].closed:
                    break
            return out
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader, head: bool = False) -> RawResponse:
    while True:  # past interim answers (100 Continue)
        raw_head = await reader.readuntil(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        if status >= 200:
            break
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if head or status in (204, 304):
        body = b""
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = await _read_chunked(reader)
    else:
        body = await reader.read()
    closed = headers.get("connection", "").lower() == "close" or lines[0].startswith("HTTP/1.0")
    return RawResponse(status, headers, body, closed)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request with a ``Content-Length`` body (what the gateway sends upstream): its head and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head, await reader.readexactly(length)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


def request(method: str, path: str, headers: dict[str, str] | list[tuple[str, str]] | None = None,
            body: bytes = b"", *, host: str = "127.0.0.1", length: bool = True) -> bytes:
    """A request's bytes; header values may be ``bytes`` to send any byte at all."""
    items = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    if not any(k.lower() == "host" for k, _ in items):
        items.insert(0, ("Host", host))
    if length and body and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in items):
        items.append(("Content-Length", str(len(body))))
    out = [f"{method} {path} HTTP/1.1".encode()]
    for k, v in items:
        out.append(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()))
    return b"\r\n".join(out) + b"\r\n\r\n" + body
