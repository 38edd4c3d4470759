"""POST /v1/completions and /v1/chat/completions: their part of the request's path (``request_path``).

After admission: ``stream`` and the chat parameters checked (steps 6-7), then
upstream (``fallbacks.open_upstream``: slots, deadlines, fallbacks) -> the JSON answer here, or the line-by-line
stream (``stream``).
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Callable

import aiohttp
import orjson
from aiohttp import web

from ..errors import UpstreamFailure
from ..plugins.call import Call
from ..plugins.manager import plugin_headers, transformed_response
from ..usage import Usage
from . import rules
from .deadlines import DeadlinePassed, watch
from .fallbacks import open_upstream
from .gateway import GATEWAY, Gateway
from .request_path import Api, handle
from .request_record import RequestRecord
from .stream import relay_stream
from .upstream import Route

PASS_THROUGH_STATUSES = (400, 422)


def _checks(body: dict, call: Call, route: Route) -> None:
    rules.check_stream(body, call)  # step 6
    rules.check_chat_params(body, call, route)  # step 7


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, request.app[GATEWAY], "completions", COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, request.app[GATEWAY], "chat/completions", COMPLETIONS)


def hot_routes(gw: Gateway) -> dict[tuple[str, str], Callable]:
    """The endpoints of this module for the server's own route table (``fastpath``)."""
    return {("POST", "/v1/completions"): partial(handle, gw=gw, endpoint="completions", api=COMPLETIONS),
            ("POST", "/v1/chat/completions"): partial(handle, gw=gw, endpoint="chat/completions", api=COMPLETIONS)}


async def forward(request: web.BaseRequest, gw: Gateway, call: Call, key, route: Route, record: RequestRecord,
                  body: dict, headers: dict) -> web.StreamResponse:
    route, upstream, resp, first, deadline = await open_upstream(gw, call, key, route, record, body)
    call.upstream = upstream.base_url
    gw.open_upstreams.add(resp)
    timer = watch(resp, deadline)
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
            return await relay_stream(request, gw, call, route, record, resp, headers, first)
        return await json_answer(gw, call, record, resp, headers)
    finally:
        if timer is not None:
            timer.cancel()
        gw.open_upstreams.discard(resp)
        upstream.release()
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
    except DeadlinePassed as exc:
        raise exc.error() from None
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


COMPLETIONS = Api(forward=forward, checks=_checks)
