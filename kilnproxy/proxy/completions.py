"""POST /v1/completions and /v1/chat/completions: the request's whole path.

client -> auth & admission (``rules``) -> plugins check and rewrite ->
upstream (``upstream.Route.open``) -> JSON answer here, or the line-by-line
stream (``stream``) -> exactly one usage row (``Gateway.submit``), whatever way
the request ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from functools import partial
from typing import Callable

import aiohttp
import orjson
from aiohttp import web

from ..errors import GatewayError, UpstreamFailure
from ..plugins.call import Call
from ..plugins.manager import plugin_headers, run_request_hooks, transformed_response
from ..store.limits import Hold
from ..usage import Usage
from . import rules
from .gateway import GATEWAY, Gateway
from .request_record import RequestRecord
from .stream import relay_stream
from .upstream import Route

GENERATION_HEADER = "X-Neocloud-Generation-Id"
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before any response was sent
PASS_THROUGH_STATUSES = (400, 422)

log = logging.getLogger("kilnproxy")


def _generation_ids():
    """``gen-`` + the time in ms (12 hex digits) + 48 random bits (12 hex digits): ids sort by
    creation time, so the usage table's key grows at its end rather than at random pages."""
    while True:  # random bytes read from the OS 4096 ids at a time
        block = os.urandom(6 * 4096).hex()
        for start in range(0, len(block), 12):
            yield f"gen-{int(time.time() * 1000):012x}{block[start:start + 12]}"


new_generation_id = _generation_ids().__next__


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, request.app[GATEWAY], "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, request.app[GATEWAY], "chat/completions")


def hot_routes(gw: Gateway) -> dict[tuple[str, str], Callable]:
    """The endpoints of this module for the server's own route table (``fastpath``)."""
    return {("POST", "/v1/completions"): partial(handle, gw=gw, endpoint="completions"),
            ("POST", "/v1/chat/completions"): partial(handle, gw=gw, endpoint="chat/completions")}


async def handle(request: web.BaseRequest, gw: Gateway, endpoint: str) -> web.StreamResponse:
    """The request's whole path (a plain ``BaseRequest`` from the route table, or the app's ``Request``)."""
    key = gw.keys.authenticate(request.headers.get("Authorization"))  # 401: no org, no row
    call = Call(new_generation_id(), key.org, key.id, endpoint, gw.plugin_settings)
    record = RequestRecord(call)
    trace = record.trace = None if gw.tracer is None else gw.tracer.begin(request.headers, endpoint, call)
    headers = {GENERATION_HEADER: call.generation_id}
    try:
        rules.check_account(key, gw.disabled_orgs, gw.credits, gw.config.maintenance)  # steps 1-2
        body = await rules.read_json_body(request, gw.config.server)  # step 3
        record.model, record.body = body["model"], body
        if trace is not None:
            trace.model(str(record.model))
        if gw.capture is not None:
            record.tap = gw.capture.tap(record, body)
        route = rules.check_model(body, key, gw.routes)  # step 4
        call.model, call.upstream_model, call.pricing = route.id, route.model.upstream_model, route.pricing
        hold = Hold(call, record.created_at, body, route.model.context_window)
        slot = rules.take_slot(gw.admission, hold, gw.limit_for(key.org), key, gw.per_minute.get(key.org))  # step 5
        if trace is None:
            await slot
        else:
            with trace.admission():
                await slot
        record.hold = hold  # released with the row, in Gateway.submit
        rules.check_stream(body, call)  # step 6
        rules.check_chat_params(body, call, route)  # step 7
        await run_request_hooks(gw.hooks, call, body)  # steps 8-9, with the built-in upstream_body plugin
        return await forward(request, gw, call, route, record, body, headers)
    except (GatewayError, UpstreamFailure) as err:
        record.fail(err.status, err.code)
        await gw.submit(record)  # the row is on disk before the response ends
        return err.response(headers)
    except (asyncio.CancelledError, ConnectionResetError):
        record.disconnected = True
        if not record.responded:
            record.fail(CLIENT_CLOSED, None)
        raise
    except Exception:  # a bug: still one row, with the status the client gets
        record.error_code = "internal_error"
        if record.responded:
            raise
        log.exception("unexpected error on %s %s", request.method, request.path)
        err = GatewayError(500, "internal_error", "The gateway failed unexpectedly; see its log.",
                           type="server_error")
        record.fail(err.status, err.code)
        await gw.submit(record)
        return err.response(headers)
    finally:
        gw.submit(record)  # once only: a no-op when already submitted, the row of a cancelled request otherwise


async def forward(request: web.BaseRequest, gw: Gateway, call: Call, route: Route, record: RequestRecord,
                  body: dict, headers: dict) -> web.StreamResponse:
    payload = orjson.dumps(body)
    if record.tap is not None:
        record.tap.sent_upstream(payload)
    upstream, resp = await route.open(gw.session, call.endpoint, payload, record.trace)
    del payload  # orjson's 4 KiB buffer, sent: a stream that lasts hours does not keep it
    call.upstream = upstream.base_url
    gw.open_upstreams.add(resp)
    try:
        if gw.hooks.response_headers:
            headers = {**await plugin_headers(gw.hooks, call), **headers}
        if resp.status in PASS_THROUGH_STATUSES:
            return await pass_through(gw, resp, record, headers)
        if resp.status >= 300:
            raise UpstreamFailure(f"{upstream.base_url} answered HTTP {resp.status}")
        if call.stream:
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                raise UpstreamFailure(f"{upstream.base_url} did not answer with an event stream",
                                      code="upstream_bad_response")
            return await relay_stream(request, gw, call, route, record, resp, headers)
        return await json_answer(gw, call, record, resp, headers)
    finally:
        gw.open_upstreams.discard(resp)
        upstream.in_flight -= 1
        if resp.content.is_eof():
            resp.release()  # back to the pool for the next request
        else:
            resp.close()  # cut short: hang up so the model server stops generating


async def pass_through(gw: Gateway, resp: aiohttp.ClientResponse, record: RequestRecord,
                       headers: dict) -> web.Response:
    """Upstream 400/422: the model server rejected the request; same status, same body."""
    raw = await _read_upstream(resp)
    record.first_byte()
    record.fail(resp.status, _error_code(raw))
    if record.tap is not None:
        record.tap.answer(raw, raw)
    await gw.submit(record)  # the row is on disk before the response ends
    return web.Response(status=resp.status, body=raw, headers={
        **headers, "Content-Type": resp.headers.get("Content-Type", "application/json")})


async def json_answer(gw: Gateway, call: Call, record: RequestRecord, resp: aiohttp.ClientResponse,
                      headers: dict) -> web.Response:
    raw = await _read_upstream(resp)
    record.first_byte()
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamFailure("the upstream's answer is not JSON", code="upstream_bad_response") from None
    if not isinstance(answer, dict):
        raise UpstreamFailure("the upstream's answer is not a JSON object", code="upstream_bad_response")
    usage = answer.get("usage")
    if isinstance(usage, dict):
        record.usage = Usage.from_upstream(usage)
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[-1], dict):
        record.finish_reason = choices[-1].get("finish_reason")
    out = await transformed_response(gw.hooks, call, answer)
    if record.tap is not None:
        record.tap.answer(raw, out)
    await gw.submit(record)
    return web.Response(body=out, content_type="application/json", headers=headers)


async def _read_upstream(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise UpstreamFailure(f"the upstream failed while sending its answer: {type(exc).__name__}",
                              code="upstream_error") from None


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
