"""Upstream connections reused: one the server closes as it is reused (llama.cpp closes its connection
right after each streamed answer, without a ``Connection: close``) has the POST sent again on another
connection, so the client never sees a 502 for it; a stream whose answer ended before its body did is
read to the body's end, so its connection is kept."""

import asyncio

import orjson
import pytest
from rawhttp import read_request

from kilnproxy.config_types import ENDPOINTS
from kilnproxy.proxy.upstream.connections import Origin
from kilnproxy.testing import MODEL, completion_body

ANSWER = orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})


class HangsUpOnReuse:
    """An HTTP/1.1 server that answers the first request of each connection (keeping it alive) and
    closes the connection, unanswered, when a second request arrives on it."""

    def __init__(self) -> None:
        self.connections = 0
        self.hung_up = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = False
        try:
            while True:
                await read_request(reader)
                if answered:
                    self.hung_up += 1
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=5\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
                answered = True
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_post_on_a_connection_the_server_hangs_up_is_sent_again(harness):
    upstream = HangsUpOnReuse()
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
            for _ in range(3):
                async with h.post("/v1/completions", completion_body()) as resp:
                    assert resp.status == 200, await resp.text()
            assert upstream.hung_up == 2  # the second and third each met a connection being closed
            assert upstream.connections == 3
            assert [r["status"] for r in await h.rows()] == [200, 200, 200]
            assert all(u.failures == 0 for u in h.gw.routes[h.model].upstreams)  # not counted against it
    finally:
        server.close()
        await server.wait_closed()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


TEXT = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"a"}]}\n\n'
LLAMA_ERROR = (b'data: {"error":{"code":500,"message":"got exception: Unexpected empty grammar stack",'
               b'"type":"server_error"}}\n\n')
ANTHROPIC_ERROR = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
# path, the stream's frames; its last one ends the answer, and the chunked body's end comes only later
ENDS = {
    "done": ("/v1/completions", [TEXT, b"data: [DONE]\n\n"]),
    "error-event": ("/v1/completions", [TEXT, LLAMA_ERROR]),  # llama.cpp's, then the body's end
    "messages-error-event": ("/v1/messages", [ANTHROPIC_ERROR]),
}


class EndsLater:
    """An HTTP/1.1 server that streams ``frames`` as chunks and ends the chunked body only once
    ``release`` is set (llama.cpp ends it in a write of its own, after the last event)."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.release = asyncio.Event()
        self.connections = 0
        self.hung_up = False  # the gateway closed a connection

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + b"".join(chunk(f) for f in self.frames))
                await self.release.wait()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up = True
        finally:
            writer.close()


@pytest.mark.parametrize("end", list(ENDS))
async def test_a_stream_the_upstream_ended_is_read_to_its_end_and_its_connection_reused(harness, eventually, end):
    """After ``[DONE]`` or an error event the gateway reads the rest of the body (to its end, a
    second at most) instead of hanging up: the next request takes the same connection."""
    path, frames = ENDS[end]
    upstream = EndsLater(frames)
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    body = ({"model": MODEL, "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "x"}]}
            if path == "/v1/messages" else completion_body(stream=True))

    def configure(config):
        config["models"][0].update(upstreams=[url], endpoints=list(ENDPOINTS))
    try:
        async with harness(configure=configure) as h:
            async with h.post(path, body) as resp:
                assert resp.status == 200
                await resp.read()  # the client's stream ended before the upstream's body did
            pool = h.gw.upstream_client.pool(Origin("http", "127.0.0.1", server.sockets[0].getsockname()[1]))
            upstream.release.set()
            await eventually(lambda: pool.idle or upstream.hung_up)
            assert not upstream.hung_up and upstream.connections == 1
            async with h.post(path, body) as resp:
                await resp.read()
            assert upstream.connections == 1
            assert [r["error_code"] is None for r in await h.rows()] == [end == "done"] * 2
    finally:
        server.close()
        await server.wait_closed()


async def test_an_upstream_that_never_ends_its_body_after_an_error_event_is_hung_up_and_its_slot_freed(
        harness, eventually):
    """The read to the body's end lasts a second at most: then the gateway hangs up, and the upstream's
    one slot (``max_in_flight = 1``) serves the next request."""
    upstream = EndsLater(ENDS["error-event"][1])  # its release is never set
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"

    def configure(config):
        config["models"][0].update(upstreams=[{"url": url, "max_in_flight": 1}], queue_timeout=5)
    try:
        async with harness(configure=configure) as h:
            for _ in range(2):  # the second waits for the first's slot
                async with h.post("/v1/completions", completion_body(stream=True)) as resp:
                    assert resp.status == 200
                    assert (await resp.read()).endswith(b"data: [DONE]\n\n")
            assert upstream.connections == 2  # the first was hung up, not kept
            rows = await h.rows()
            assert [(r["status"], r["error_code"]) for r in rows] == [(200, "upstream_error")] * 2
            route = h.gw.routes[h.model]
            await eventually(lambda: route.upstreams[0].in_flight == 0)
    finally:
        upstream.release.set()
        server.close()
        await server.wait_closed()
