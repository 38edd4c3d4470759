"""From admission to the response, the same for every API: the upstream (``fallbacks.open_upstream``:
slots, deadlines, fallbacks), then its refusal passed through (400, 422), its JSON answer, or its
stream relayed (the API's ``relay``); the upstream connection released or hung up on every way out.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from ..answers import Answer
from ..config import KeyConfig
from ..errors import GatewayError, UpstreamFailure
from ..call import Call, set_upstream
from ..plugins.manager import plugin_headers, transformed_response
from .upstream.deadlines import DeadlinePassed, watch
from .relay.event_json import exact_integers, read_stdlib, write
from .fallbacks import open_upstream
from .gateway import Gateway
from .request_body import ENCODINGS, inflate
from .request_record import RequestRecord
from .upstream.routes import Route
from .upstream.connections import UpstreamBadResponse
from .upstream.responses import UpstreamResponse

PASS_THROUGH_STATUSES = (400, 422)
MAX_REJECTION_BYTES = 16 * 1024 * 1024  # a rejection's body, decoded


async def forward(request: web.BaseRequest, gw: Gateway, call: Call, key: KeyConfig, route: Route,
                  record: RequestRecord, body: dict, headers: dict, api) -> web.StreamResponse:
    """Steps past admission for the request's ``api`` (a ``request_path.Api``)."""
    route, upstream, resp, first, deadline = await open_upstream(gw, call, key, route, record, body,
                                                                 api.upstream_headers(request), api.hold)
    set_upstream(call, upstream.base_url)
    gw.open_upstreams.add(resp)
    timer = watch(resp, deadline)
    try:
        if gw.hooks.response_headers:
            headers = {**await plugin_headers(gw.hooks, call), **headers}
        if resp.status in PASS_THROUGH_STATUSES:
            return await pass_through(gw, resp, record, headers)
        if resp.status >= 300:
            raise UpstreamFailure(f"{upstream.base_url} answered HTTP {resp.status} on /{call.endpoint}")
        if call.stream:
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                raise UpstreamFailure(f"{upstream.base_url} did not answer with an event stream",
                                      code="upstream_bad_response")
            return await api.relay(request, gw, call, route, record, resp, headers, first)
        return await json_answer(gw, call, record, resp, headers, api)
    finally:
        if timer is not None:
            timer.cancel()
        gw.open_upstreams.discard(resp)
        upstream.release()
        if resp.content.is_eof():
            resp.release()  # back to the pool for the next request
        else:
            resp.close()  # cut short: hang up so the model server stops generating


async def pass_through(gw: Gateway, resp: UpstreamResponse, record: RequestRecord,
                       headers: dict) -> Answer:
    """Upstream 400/422: the model server rejected the request; same status, same body."""
    raw = await read_upstream(resp)
    record.first_byte()
    encoding = resp.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ENCODINGS:  # sent although the gateway asks for identity: the client gets it decoded
        try:
            raw = inflate(raw, encoding, MAX_REJECTION_BYTES)
        except ValueError as exc:
            raise UpstreamFailure(f"the upstream's {resp.status} answer is {exc}", code="upstream_bad_response") \
                from None
    elif encoding not in ("", "identity"):
        raise UpstreamFailure(f"the upstream's {resp.status} answer is in {encoding!r}", code="upstream_bad_response")
    record.fail(resp.status, _error_code(raw))
    if record.tap is not None:
        record.tap.answer(raw, raw)
    await gw.submit(record)  # the row is on disk before the response ends
    return Answer(raw, resp.status, resp.headers.get("Content-Type", "application/json"), headers)


async def json_answer(gw: Gateway, call: Call, record: RequestRecord, resp: UpstreamResponse,
                      headers: dict, api) -> Answer:
    """A non-streamed answer: what the API reads of it (usage, finish reason), then the plugins'. JSON that
    orjson refuses but the json module reads (a string escaping a lone surrogate) is read and written back
    by the json module, each lone surrogate as the escape it came as, and so is an answer holding an
    integer beyond 64 bits, which orjson reads as a float (``event_json``)."""
    raw = await read_upstream(resp)
    record.first_byte()
    dump = orjson.dumps
    try:
        read = orjson.loads(raw)
        answer = exact_integers(raw, read)
        if answer is not read:  # read again by the json module: an integer beyond 64 bits, which orjson cannot write
            dump = write
    except orjson.JSONDecodeError:
        try:  # JSON orjson refuses: a lone surrogate escape (an answer cut in the middle of an emoji)
            answer, dump = read_stdlib(raw), write
        except ValueError:
            raise UpstreamFailure("the upstream's answer is not JSON", code="upstream_bad_response") from None
    if not isinstance(answer, dict):
        raise UpstreamFailure("the upstream's answer is not a JSON object", code="upstream_bad_response")
    api.read_answer(call, record, answer)
    try:
        out = await transformed_response(gw.hooks, call, answer, dump)
    except GatewayError as err:
        if _too_deep(err):  # the upstream's answer, not a plugin: nothing was served, nothing is charged
            record.usage = None
            raise UpstreamFailure("the upstream's answer nests deeper than the gateway can write JSON back",
                                  code="upstream_bad_response") from None
        raise
    if record.tap is not None:
        record.tap.answer(raw, out)
    await gw.submit(record)
    return Answer(out, headers=headers)


async def read_upstream(resp: UpstreamResponse) -> bytes:
    try:
        return await resp.read()
    except DeadlinePassed as exc:
        raise exc.error() from None
    except UpstreamBadResponse as exc:  # e.g. chunked framing that is not HTTP's
        raise UpstreamFailure(f"the upstream's answer is not HTTP: {exc}", code="upstream_bad_response") from None
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise UpstreamFailure(f"the upstream failed while sending its answer: {type(exc).__name__}",
                              code="upstream_error") from None


def _too_deep(err: GatewayError) -> bool:
    """orjson reads JSON nested 1,024 levels deep but writes 254 at most: an answer it read, it could
    not write back."""
    cause = err.__cause__
    return isinstance(cause, TypeError) and "Recursion limit reached" in str(cause)


def _error_code(raw: bytes) -> str:
    try:
        error = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return "upstream_rejected"
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code:
        return code
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) and kind else "upstream_rejected"
