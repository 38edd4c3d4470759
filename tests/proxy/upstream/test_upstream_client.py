"""The gateway's own HTTP/1.1 client (kilnproxy.proxy.upstream.client) against real servers on real
ports that misbehave the ways model servers do: a kept-alive connection closed as it is reused,
chunked bodies cut anywhere, close-delimited bodies, a reset mid-body, a silent server, a client
that stops reading."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import aiohttp
import pytest
from rawhttp import read_request

from kilnproxy.config import ServerConfig
from kilnproxy.proxy.upstream.client import RequestTarget, UpstreamClient
from kilnproxy.proxy.upstream.connections import UpstreamDisconnected
from kilnproxy.proxy.upstream.responses import HIGH_WATER

ROUTE_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity", "Authorization": "Bearer up"}


class Server:
    """An HTTP/1.1 server whose every connection runs ``script(reader, writer, n, body)`` per request
    (the ``n``th of the connection; False: close it);
    it keeps each request head, and sets ``closed`` when a connection ends."""

    def __init__(self, script):
        self.script = script
        self.heads: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()
        self.ended = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> "Server":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    def url(self, path: str = "/v1/completions") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head, body = await read_request(reader)
                self.heads.append(head)
                n += 1
                if await self.script(reader, writer, n, body) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.ended += 1
            self.closed.set()


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        extra, len(body), body)


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST rather than FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def client(**server) -> UpstreamClient:
    return UpstreamClient(ServerConfig(**server))


@contextlib.asynccontextmanager
async def upstream(handle, **server_config):
    """A raw upstream answering with ``handle``, a client with ``server_config`` and the route's target;
    the client is closed on the way out."""
    async with Server(handle) as server:
        up = client(**server_config)
        try:
            yield server, up, RequestTarget(server.url(), ROUTE_HEADERS)
        finally:
            up.close()


async def test_requests_reuse_one_kept_alive_connection_with_the_prebuilt_head():
    async def echo(reader, writer, n, body):
        writer.write(answer(b'{"n":%d,"got":%s}' % (n, body), b"X-Upstream: yes\r\n"))

    async with upstream(echo) as (server, up, target):
        for i in range(3):
            resp = await up.post(target, {"traceparent": "00-abc", "Authorization": "Bearer client"},
                                 b'{"i":%d}' % i)
            assert (resp.status, resp.headers["x-upstream"], resp.headers["CONTENT-TYPE"]) == (
                200, "yes", "application/json")
            assert await resp.read() == b'{"n":%d,"got":{"i":%d}}' % (i + 1, i)
            assert resp.is_eof() and resp.content.at_eof()
            resp.release()
    assert server.connections == 1
    lines = server.heads[0].split(b"\r\n")
    assert lines[0] == b"POST /v1/completions HTTP/1.1"
    assert f"Host: 127.0.0.1:{server.port}".encode() in lines
    assert b"Authorization: Bearer up" in lines and b"Authorization: Bearer client" not in lines  # the route's wins
    assert b"traceparent: 00-abc" in lines and b"Content-Length: 7" in lines
    assert b"Accept-Encoding: identity" in lines


async def test_a_reused_connection_the_server_closes_is_retried_once_on_a_new_one():
    async def once_per_connection(reader, writer, n, body):
        if n > 1:
            return False  # hang up, unanswered, on the second request of a connection
        writer.write(answer(b"{}"))

    async with upstream(once_per_connection) as (server, up, target):
        for _ in range(3):
            resp = await up.post(target, None, b"{}")
            assert resp.status == 200 and await resp.read() == b"{}"
    assert server.connections == 3 and len(server.heads) == 5  # two requests sent twice


async def test_a_reset_after_part_of_an_answer_is_never_retried():
    async def half_a_status_line(reader, writer, n, body):
        if n == 1:
            writer.write(answer(b"{}"))
            return
        writer.write(b"HTTP/1.1 2")
        await writer.drain()
        reset(writer)
        return False

    async with upstream(half_a_status_line) as (server, up, target):
        resp = await up.post(target, None, b"{}")
        await resp.read()
        with pytest.raises(UpstreamDisconnected) as caught:
            await up.post(target, None, b"{}")
        assert caught.value.answered and isinstance(caught.value, aiohttp.ServerDisconnectedError)
    assert server.connections == 1 and len(server.heads) == 2


async def test_a_reset_on_a_new_connection_before_any_byte_is_not_retried():
    async def hang_up(reader, writer, n, body):
        reset(writer)
        return False

    async with upstream(hang_up) as (server, up, target):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await up.post(target, None, b"{}")
    assert len(server.heads) == 1


async def test_chunked_bodies_cut_at_odd_places_arrive_whole():
    pieces = [b"data: one\n\n", b"data: t", b"wo\n\ndata: [DONE]\n\n"]
    wire = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked(*pieces))

    async def cut_anywhere(reader, writer, n, body):
        step = 1 + n  # each request cuts the wire at other places
        for at in range(0, len(wire), step):
            writer.write(wire[at:at + step])
            await writer.drain()

    async with upstream(cut_anywhere) as (server, up, target):
        for _ in range(4):
            resp = await up.post(target, None, b"{}")
            assert resp.headers["Content-Type"] == "text/event-stream"
            got = []
            while chunk := await resp.content.readany():
                got.append(chunk)
            assert b"".join(got) == b"".join(pieces)
            resp.release()
    assert server.connections == 1


async def test_a_close_delimited_body_ends_with_the_connection():
    async def no_length(reader, writer, n, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: a\n\n")
        await writer.drain()
        writer.write(b"data: [DONE]\n\n")
        return False

    async with upstream(no_length) as (server, up, target):
        for _ in range(2):
            resp = await up.post(target, None, b"{}")
            assert await resp.read() == b"data: a\n\ndata: [DONE]\n\n"
            assert resp.is_eof()
            resp.release()
    assert server.connections == 2  # never kept: its end was the body's


async def test_a_reset_mid_body_gives_the_bytes_sent_then_a_payload_error():
    async def cut(reader, writer, n, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        reset(writer)
        return False

    async with upstream(cut) as (server, up, target):
        resp = await up.post(target, None, b"{}")
        got = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            while True:
                got += await resp.readany()
        assert got == b"0123456789" and not resp.is_eof()
        resp.close()


async def test_a_silent_server_times_out_and_is_hung_up_on():
    async def silent(reader, writer, n, body):
        await reader.read()  # until the gateway hangs up

    async with upstream(silent, upstream_idle_timeout=0.05) as (server, up, target):
        with pytest.raises(TimeoutError):
            await up.post(target, None, b"{}")
        await server.closed.wait()  # the server saw the gateway hang up


async def test_closing_a_stream_early_hangs_up_and_the_next_request_gets_a_new_connection():
    async def endless(reader, writer, n, body):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"5\r\nhello\r\n")
        await reader.read()  # until the gateway hangs up
        return False

    async with upstream(endless) as (server, up, target):
        resp = await up.post(target, None, b"{}")
        assert await resp.readany() == b"hello"
        resp.close()  # the client left: the model server must stop generating
        await server.closed.wait()
        resp.close()  # twice is harmless
        second = await up.post(target, None, b"{}")
        assert await second.readany() == b"hello"
        second.close()
    assert server.connections == 2


async def test_a_reader_that_stops_reading_stops_the_socket_being_read(eventually):
    piece = b"x" * 65536
    written = []
    finished = asyncio.Event()

    async def flood(reader, writer, n, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(piece) * 256))
        for _ in range(256):  # 16 MiB
            writer.write(piece)
            await writer.drain()
            written.append(len(piece))
        finished.set()

    async with upstream(flood) as (server, up, target):
        resp = await up.post(target, None, b"{}")
        transport = resp.connection.transport
        await eventually(lambda: not transport.is_reading())  # nothing read: the socket is left alone
        assert resp._size <= HIGH_WATER + len(piece)  # what the gateway holds stays small
        assert not finished.is_set()  # the server's writes are blocked
        received = 0
        while chunk := await resp.readany():
            received += len(chunk)
        assert received == len(piece) * 256 and finished.is_set()
        resp.release()


async def test_set_exception_ends_reads_and_a_refused_connect_is_a_connector_error():
    more = asyncio.Event()

    async def slow(reader, writer, n, body):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await more.wait()

    class Deadline(aiohttp.ClientError):
        pass

    async with upstream(slow) as (server, up, target):
        try:
            resp = await up.post(target, None, b"{}")
            reading = asyncio.ensure_future(resp.content.readany())
            await asyncio.sleep(0)
            resp.content.set_exception(Deadline())
            with pytest.raises(Deadline):
                await reading
            resp.close()
        finally:
            more.set()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    up = client()
    try:
        with pytest.raises(aiohttp.ClientConnectorError):
            await up.post(RequestTarget(f"http://127.0.0.1:{port}/v1/completions", ROUTE_HEADERS), None, b"{}")
    finally:
        up.close()


async def test_idle_connections_are_closed_after_the_keepalive_timeout():
    async def ok(reader, writer, n, body):
        writer.write(answer(b"{}"))

    async with upstream(ok, upstream_keepalive_timeout=0.05) as (server, up, target):
        resp = await up.post(target, None, b"{}")
        assert await resp.read() == b"{}"
        resp.release()
        await server.closed.wait()  # the gateway closed its idle connection, not the server
        assert not any(pool.open for pool in up.pools.values())


async def test_an_answer_followed_by_bytes_nobody_asked_for_is_not_reused():
    async def two_answers(reader, writer, n, body):
        writer.write(answer(b'{"n":%d}' % n) + answer(b'{"stray":1}'))

    async with upstream(two_answers) as (server, up, target):
        for _ in range(2):
            resp = await up.post(target, None, b"{}")
            assert await resp.read() == b'{"n":1}'
            resp.release()
    assert server.connections == 2
