"""Writing a streamed answer: upstream chunks -> ``EventRelay`` -> client.

From ``prepare()`` on, the status is 200 and any failure can only be told as
a ``data: {"error": ...}`` event followed by ``data: [DONE]``. The row is
committed before ``[DONE]`` is written, so a client that saw the end of its
stream always has its usage row. A client that leaves raises out of the
``write`` (or, with ``handler_cancellation``, cancels the handler): the
caller's ``finally`` closes the upstream request and records the row as
disconnected.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11

from ..call import Call
from ..sse import DONE_FRAME, KEEPALIVE_FRAME
from .upstream.deadlines import DeadlinePassed
from .gateway import Gateway
from .relay.plain_relay import EventRelay
from .request_record import RequestRecord
from .relay.errors import StreamPluginError, error_frame
from .relay.sse_response import SSE_HEADERS, SSEResponse
from .relay.tapped_stream import TappedRelay, TappedResponse
from .upstream.responses import UpstreamResponse
from .upstream.routes import Route

log = logging.getLogger("kilnproxy")

def stream_response(headers: dict, upstream, first: bytes | None) -> SSEResponse:
    """The client's response: its head held back for the first events only when they are here already
    (the upstream sent its answer at once), so that no client ever waits longer for the head.

    No ``Connection`` header: aiohttp writes ``Connection: close`` when the connection ends after the
    response (a draining gateway, a client that asked for it); a fixed ``keep-alive`` would then lie,
    and a load balancer would send its next request on a connection being closed (HTTP/1.0 apart:
    ``start_stream``)."""
    return SSEResponse(headers, first is not None or upstream.content.has_data())


class ShuttingDown(aiohttp.ClientError):
    """Set on an upstream response's stream when the gateway ends it at shutdown."""

    code = "shutting_down"

    def __init__(self) -> None:
        super().__init__("The gateway is shutting down; retry the request.")


async def relay_stream(request: web.Request, gw: Gateway, call: Call, route: Route, record: RequestRecord,
                       upstream: UpstreamResponse, headers: dict, first: bytes | None = None,
                       ) -> web.StreamResponse:
    """``first``: the stream's first bytes when they were read already (to meet a first-byte deadline)."""
    if record.tap is None:
        response = stream_response(headers, upstream, first)
        relay = EventRelay(call, route, record, gw.hooks.transform_event)
    else:  # the inspector's capture: the same relay and response, showing the tap what passes
        response = TappedResponse(record.tap, status=200, headers={**SSE_HEADERS, **headers})
        relay = TappedRelay(record.tap, call, route, record, gw.hooks.transform_event)
    keepalive = await start_stream(request, gw, record, response)
    try:
        tail = await _pump(upstream, response, relay, record, keepalive, first)
        await end_stream(gw, record, response, keepalive, tail, upstream if relay.clean_end else None)
    except ConnectionResetError:  # the client went away; the caller records it
        record.disconnected = True
    finally:
        keepalive.cancel()
    return response


def close_after_body(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Before ``prepare``: to an HTTP/1.0 request, whose body with no length can only be framed by the
    connection's end, ``Connection: close`` and the connection closed after the body, whatever the
    request asked (aiohttp would keep it alive, and the client could not tell where the body ends)."""
    if request.version < HttpVersion11:
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"


async def start_stream(request: web.BaseRequest, gw: Gateway, record: RequestRecord,
                       response: web.StreamResponse) -> "KeepAlive":
    """Send the status line and headers (from here an error can only be an event); the keepalive, its
    timer started at once unless the stream's first events are here already (the head waits for them).
    An HTTP/1.0 request's connection ends with the body (``close_after_body``)."""
    close_after_body(request, response)
    await response.prepare(request)
    record.responded = True
    if record.trace is not None:
        record.trace.stream_started()
    held = isinstance(response, SSEResponse) and response.held
    return KeepAlive(response, gw.config.server.keepalive_seconds, armed=not held, loop=gw.loop)


async def end_stream(gw: Gateway, record: RequestRecord, response: web.StreamResponse, keepalive: "KeepAlive",
                     tail: bytes, finished: UpstreamResponse | None) -> None:
    """The row committed, then ``tail`` with the end of the chunked body (one write); an upstream that
    ``finished`` its answer is read to its end, so that its connection goes back to the pool."""
    keepalive.cancel()
    await gw.submit(record)
    await response.write_eof(tail)
    if finished is not None and not finished.content.at_eof():
        await _drain(finished)


async def _pump(upstream: UpstreamResponse, response: web.StreamResponse, relay: EventRelay,
                record: RequestRecord, keepalive: "KeepAlive", first: bytes | None) -> bytes:
    """Relay until the upstream ends; return what must follow (the last chunk's events, the usage chunk,
    ``[DONE]``): written in one go once the row is committed."""
    content = upstream.content
    while True:
        try:
            if first is None:
                chunk = await content.readany()
            else:
                chunk, first = first, None
        except asyncio.TimeoutError:
            if relay.answered():
                return _closed(relay, record)
            return _failed(record, "upstream_timeout", "The upstream sent nothing for too long.")
        except (ShuttingDown, DeadlinePassed) as exc:
            return _failed(record, exc.code, str(exc))
        except aiohttp.ClientError as exc:
            if relay.answered():
                return _closed(relay, record)
            return _failed(record, "upstream_error", f"The upstream connection failed: {type(exc).__name__}.")
        if not chunk:
            return _closed(relay, record)
        if record.ttft_ms is None:
            record.first_byte()
        try:
            out = relay.feed_chunk(chunk)
        except StreamPluginError as exc:
            return _plugin_failed(record, exc)
        except Exception:
            return _bug(record)
        if relay.ended:  # the chunk's events go out with the tail, after the row's commit: one write
            return out + _tail(relay, record)
        keepalive.touch()  # the stream goes on: the next silence is timed from here
        if out:
            await response.write(out)


def _closed(relay: EventRelay, record: RequestRecord) -> bytes:
    """The upstream's body has ended (closed; or its connection lost, or silent, once the answer was
    whole): what was left of it, then the tail if ``[DONE]`` came or every choice had its finish reason
    (the usage chunk if asked for, the upstream's counts if they came, else the estimate; and ``[DONE]``:
    no error event after a whole answer, on which the openai SDK raises and a client would retry it),
    else an ``upstream_error`` event."""
    try:
        out = relay.close()
    except StreamPluginError as exc:
        return _plugin_failed(record, exc)
    except Exception:
        return _bug(record)
    if relay.ended or relay.answered():
        return out + _tail(relay, record)
    return out + _failed(record, "upstream_error", "The upstream closed the stream before it finished.")


def _tail(relay: EventRelay, record: RequestRecord) -> bytes:
    try:
        return relay.tail()
    except StreamPluginError as exc:  # a transform_event plugin raised on the usage chunk
        return _plugin_failed(record, exc)
    except Exception:
        return _bug(record)


async def _drain(upstream: UpstreamResponse) -> None:
    """Read the few bytes after ``[DONE]`` so the connection can be reused."""
    try:
        async with asyncio.timeout(1.0):
            while await upstream.content.readany():
                pass
    except (TimeoutError, aiohttp.ClientError):
        pass


def _failed(record: RequestRecord, code: str, message: str) -> bytes:
    record.error_code = code
    return error_frame(message, code) + DONE_FRAME


def _plugin_failed(record: RequestRecord, exc: StreamPluginError) -> bytes:
    record.error_code = exc.error.code
    return exc.before + exc.frame() + DONE_FRAME


def _bug(record: RequestRecord) -> bytes:
    """A fault of the relay's own: logged, and told as an ``internal_error`` event (the status went already)."""
    log.exception("unexpected error relaying the stream of %s", record.call.generation_id)
    record.error_code = "internal_error"
    return error_frame("The gateway failed unexpectedly; see its log.", "internal_error", "server_error") + DONE_FRAME


class KeepAlive:
    """Sends ``: keepalive`` whenever the upstream has been silent for ``seconds``.

    One timer per stream, re-armed lazily: ``touch()`` only stores a time, so
    the per-chunk cost is one clock read. A stream whose first events were
    there when it began starts its timer at its first ``touch()``, after
    them: one that ends with them (the upstream sent its whole answer at
    once) never needs one.
    """

    __slots__ = ("response", "seconds", "last", "loop", "handle", "task")

    def __init__(self, response: web.StreamResponse, seconds: float, armed: bool = True,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.response = response
        self.seconds = seconds
        self.loop = loop or asyncio.get_running_loop()
        self.last = self.loop.time()
        self.task: asyncio.Task | None = None
        self.handle: asyncio.TimerHandle | None = self.loop.call_at(self.last + seconds, self._due) if armed else None

    def touch(self) -> None:
        self.last = self.loop.time()
        if self.handle is None:
            self.handle = self.loop.call_at(self.last + self.seconds, self._due)

    def _due(self) -> None:
        due = self.last + self.seconds
        if self.loop.time() < due:
            self.handle = self.loop.call_at(due, self._due)
            return
        self.last = self.loop.time()
        self.task = asyncio.ensure_future(self._send())
        self.handle = self.loop.call_at(self.last + self.seconds, self._due)

    async def _send(self) -> None:
        try:
            await self.response.write(KEEPALIVE_FRAME)
        except (ConnectionError, RuntimeError):
            pass  # the client is gone; the relay finds out at its next write

    def cancel(self) -> None:
        """For good: a ``touch()`` after it starts no timer."""
        if self.handle is not None:
            self.handle.cancel()
        self.handle = _ENDED
        if self.task is not None and not self.task.done():
            self.task.cancel()


class _Ended:
    """The timer of a ``KeepAlive`` cancelled for good."""

    @staticmethod
    def cancel() -> None:
        pass


_ENDED = _Ended()
