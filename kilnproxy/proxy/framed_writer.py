"""Writing a stream of the Responses API or Anthropic Messages: upstream chunks -> ``FramedRelay`` -> client.

As ``stream.py`` does for completions: the status and headers go once the
upstream has answered 200 with an event stream; from then on a failure is the
format's own ``event: error`` (none once the format's last event has passed:
the answer was whole); the row is committed before the body ends; a
client that leaves raises out of a write (or cancels the handler) and the
caller closes the upstream request and records the row as disconnected.
No ``[DONE]``: these formats end with their last event.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from ..call import Call
from .upstream.deadlines import DeadlinePassed
from .relay.framed_relay import FramedRelay
from .gateway import Gateway
from .request_record import RequestRecord
from .stream_writer import KeepAlive, ShuttingDown, end_stream, start_stream, stream_response
from .relay.errors import StreamPluginError
from .upstream.responses import UpstreamResponse

log = logging.getLogger("kilnproxy")


async def relay_framed(request: web.BaseRequest, gw: Gateway, call: Call, record: RequestRecord,
                       upstream: UpstreamResponse, headers: dict, first: bytes | None = None,
                       ) -> web.StreamResponse:
    """``first``: the stream's first bytes when they were read already (to meet a first-byte deadline)."""
    response = stream_response(headers, upstream, first)
    relay = FramedRelay(call, record, gw.hooks.transform_event)
    keepalive = await start_stream(request, gw, record, response)
    try:
        tail = await _pump(upstream, response, relay, record, keepalive, first)
        if record.tap is not None and tail:
            record.tap.client_write(tail)
        await end_stream(gw, record, response, keepalive, tail, upstream if relay.finished else None)
    except ConnectionResetError:
        record.disconnected = True
    finally:
        keepalive.cancel()
    return response


async def _pump(upstream: UpstreamResponse, response: web.StreamResponse, relay: FramedRelay,
                record: RequestRecord, keepalive: KeepAlive, first: bytes | None) -> bytes:
    """Relay until the upstream ends; return what must close the body, written once the row is committed
    (the last chunk's events, an error event, or nothing)."""
    content = upstream.content
    tap = record.tap
    while True:
        try:
            if first is None:
                chunk = await content.readany()
            else:
                chunk, first = first, None
        except (asyncio.TimeoutError, ShuttingDown, DeadlinePassed, aiohttp.ClientError) as exc:
            if relay.finished:  # the answer's last event has passed: what fails after it changes nothing
                return b""
            if isinstance(exc, asyncio.TimeoutError):
                return _failed(relay, record, "upstream_timeout", "The upstream sent nothing for too long.")
            if isinstance(exc, (ShuttingDown, DeadlinePassed)):
                return _failed(relay, record, exc.code, str(exc))
            return _failed(relay, record, "upstream_error", f"The upstream connection failed: {type(exc).__name__}.")
        last = not chunk
        try:
            if last:
                out = relay.close()
            else:
                record.first_byte()
                if tap is not None:
                    tap.upstream_chunk(chunk)
                out = relay.feed_chunk(chunk)
                if relay.finished and not relay.ended and content.at_eof():  # the whole answer is here
                    out += relay.close()
                    last = True
        except StreamPluginError as exc:
            record.error_code = exc.error.code
            return exc.before + relay.error_frame(exc.error.message, exc.error.code)
        except Exception:  # a fault of the relay's own: logged, told as the format's error event
            log.exception("unexpected error relaying the stream of %s", record.call.generation_id)
            return _failed(relay, record, "internal_error", "The gateway failed unexpectedly; see its log.")
        if relay.ended or relay.finished and last:  # the last events go out with the body's end: one write
            return out
        if chunk:
            keepalive.touch()  # the stream goes on: the next silence is timed from here
        if out:
            if tap is not None:
                tap.client_write(out)
            await response.write(out)
        if not chunk:
            return _failed(relay, record, "upstream_error", "The upstream closed the stream before it finished.")


def _failed(relay: FramedRelay, record: RequestRecord, code: str, message: str) -> bytes:
    record.error_code = code
    return relay.error_frame(message, code)
