"""HTTP/1.0 clients: a streamed answer has no length and HTTP/1.0 no chunked encoding, so its body ends
where the connection does. The gateway says ``Connection: close`` and closes the socket after the body,
even when the request asked to keep the connection alive; a non-streamed answer keeps its
``Content-Length`` and the connection. Over raw sockets, on the hot routes' fast path and on the app's
own router (a path with a query string goes there)."""

import asyncio

import orjson
import pytest

from kilnproxy.testing import MODEL

GEN = "X-Neocloud-Generation-Id"
FIXED = {"id": "cmpl-fixed", "created": 1700000000}
GIVE_UP_SECONDS = 30.0  # only stops a test that would hang; no assertion depends on it


def port_of(h) -> int:
    return int(h.url.rsplit(":", 1)[1])


def http10(h, path: str, body: dict, keep_alive: bool = True) -> bytes:
    data = orjson.dumps(body)
    return (f"POST {path} HTTP/1.0\r\nHost: x\r\n{h.headers()['Authorization'].join(('Authorization: ', ''))}\r\n"
            + ("Connection: keep-alive\r\n" if keep_alive else "")
            + f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def split_head(raw: bytes) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    return lines[0], [tuple(line.split(b": ", 1)) for line in lines[1:]], body


async def read_to_eof(h, data: bytes) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(h))
    try:
        writer.write(data)
        async with asyncio.timeout(GIVE_UP_SECONDS):
            return await reader.read()
    finally:
        writer.close()


async def over_http11(h, path: str, body: dict) -> bytes:
    async with h.post(path, body) as resp:
        assert resp.status == 200
        return await resp.read()


STREAMS = {
    "completions, fast path": ("/v1/completions", {"prompt": "The capital of France is"}),
    "completions, the app's router": ("/v1/completions?x=1", {"prompt": "The capital of France is"}),
    "chat, fast path": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    "messages, fast path": ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}]}),
}


def every_endpoint(config):
    config["models"][0]["endpoints"] = ["completions", "chat/completions", "messages"]


@pytest.mark.parametrize("keep_alive", [True, False], ids=["keep-alive", "no connection header"])
@pytest.mark.parametrize("case", STREAMS)
async def test_a_stream_to_an_http10_request_ends_with_the_connection(harness, case, keep_alive):
    async with harness(configure=every_endpoint) as gw:
        await stream_ends_with_the_connection(gw, *STREAMS[case], keep_alive)


async def stream_ends_with_the_connection(gw, path, extra, keep_alive):
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "mock": FIXED, **extra}
    raw = await read_to_eof(gw, http10(gw, path, body, keep_alive))
    status, headers, got = split_head(raw)
    assert status == b"HTTP/1.0 200 OK"
    names = [name for name, _ in headers]
    assert names == [b"Content-Type", b"Cache-Control", b"X-Accel-Buffering", GEN.encode(), b"Connection", b"Date",
                     b"Server"]
    values = dict(headers)
    assert (values[b"Content-Type"], values[b"Cache-Control"], values[b"X-Accel-Buffering"], values[b"Connection"]) \
        == (b"text/event-stream; charset=utf-8", b"no-cache", b"no", b"close")
    assert got == await over_http11(gw, path, body)  # read to the server's close: the same SSE bytes
    assert got.endswith(b"data: [DONE]\n\n" if "messages" not in path else b'"type":"message_stop"}\n\n')
    assert len(await gw.rows(id=values[GEN.encode()].decode())) == 1


async def test_a_json_answer_to_an_http10_keep_alive_request_keeps_its_length_and_the_connection(gw):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "mock": FIXED}
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gw))
    try:
        answers = []
        async with asyncio.timeout(GIVE_UP_SECONDS):
            for _ in range(2):  # the second on the same connection: it was kept alive
                writer.write(http10(gw, "/v1/completions", body))
                status, headers, _ = split_head(await reader.readuntil(b"\r\n\r\n"))
                values = dict(headers)
                answers.append((status, values.get(b"Connection"),
                                orjson.loads(await reader.readexactly(int(values[b"Content-Length"])))))
    finally:
        writer.close()
    assert [(status, connection) for status, connection, _ in answers] == [(b"HTTP/1.0 200 OK", b"keep-alive")] * 2
    assert answers[0][2]["choices"][0]["text"] == " Paris is the capital"
