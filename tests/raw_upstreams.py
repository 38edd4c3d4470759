"""Raw upstreams for tests (on ``rawhttp.raw_server``: a real port, the exact bytes given):
``raw_upstream(go, stream)`` sends a stream's head and then, once ``go`` is set, the whole ``stream`` in one
write (``WHOLE_STREAM``, a completion, by default; ``WHOLE_MESSAGES_STREAM`` is an Anthropic Messages one);
``answering(raw)`` answers every request with ``raw``, such as ``http(body, status, **headers)`` makes."""

import asyncio
from contextlib import asynccontextmanager

import orjson
from rawhttp import raw_server, read_request

from kilnproxy.testing import UPSTREAM_MODEL


def sse_frame(data: dict) -> bytes:
    return b"data: " + orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1,
                                     "model": UPSTREAM_MODEL, **data}) + b"\n\n"


WHOLE_STREAM = (b"".join(sse_frame({"choices": [{"index": 0, "text": w, "finish_reason": None}]}) for w in ("a", " b"))
                + sse_frame({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
                + sse_frame({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
                + b"data: [DONE]\n\n")


def anthropic_frame(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": UPSTREAM_MODEL, "content": [],
           "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 0}}


WHOLE_MESSAGES_STREAM = b"".join((
    anthropic_frame("message_start", {"message": MESSAGE}),
    anthropic_frame("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    *(anthropic_frame("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": w}})
      for w in ("a", " b")),
    anthropic_frame("content_block_stop", {"index": 0}),
    anthropic_frame("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}}),
    anthropic_frame("message_stop", {})))


@asynccontextmanager
async def raw_upstream(go: asyncio.Event | None = None, stream: bytes = WHOLE_STREAM):
    """An upstream that sends its head and, once ``go`` is set (at once without one), ``stream`` in
    one write: its base URL."""
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                     % len(stream))
        if go is not None:
            await writer.drain()
            await go.wait()
        writer.write(stream)
        await writer.drain()
        writer.close()
    async with raw_server(serve) as url:
        yield url


def http(body: bytes, status: str = "200 OK", **headers: str) -> bytes:
    """A response of ``body``; ``headers`` (``Content_Type=...``) replace the usual ones, an empty one drops it."""
    head = {"Content-Type": "application/json", "Content-Length": str(len(body)),
            **{name.replace("_", "-"): value for name, value in headers.items()}}
    return (f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items() if v)
            + "\r\n").encode("utf-8", "surrogateescape") + body


@asynccontextmanager
async def answering(raw: bytes):
    """An upstream that answers every request with ``raw``, then closes the connection: its base URL."""
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(raw)
        await writer.drain()
        writer.close()
    async with raw_server(serve) as url:
        yield url
