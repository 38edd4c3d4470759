"""POST /v1/embeddings, /v1/responses, /v1/messages and /v1/messages/count_tokens.

The same path as a completion (``request_path.handle``): key, account, body,
model (and the endpoints it serves), slot and hold, plugins, upstream, one
usage row whatever way the request ends. What differs:

* the checks: embeddings' ``input`` (``embedding_input``); a Responses request
  may not ask for ``background`` (its answer is read from an endpoint the
  gateway does not serve);
* the hold: embeddings hold their input only; the Responses API's
  completion part is ``max_output_tokens``, Anthropic's ``max_tokens``;
* usage is read from each format's own usage object (``Usage.of_endpoint``);
* streams keep their framing and go through ``framed_relay``;
* ``/v1/messages`` takes its key from ``x-api-key`` too, forwards the
  ``anthropic-version`` and ``anthropic-beta`` headers, and answers every
  error in Anthropic's form (``anthropic_errors``);
* ``/v1/messages/count_tokens`` is forwarded unmetered: no hold, no row, and no
  upstream slot (``max_in_flight`` counts generations; a count waits for none).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable

from aiohttp import web

from ...config import KeyConfig
from ...errors import GatewayError, UpstreamFailure, bad_request
from ...call import Call
from ...store.limits import Hold, output_bound
from ...usage import Usage, cap_counts, input_count
from .. import request_path, rules
from ..relay.anthropic_errors import anthropic_error_response
from ..tenancy.auth import either_header
from .embedding_input import check_embeddings
from ..relay.event_json import write
from ..forward import read_upstream
from ..framed_writer import relay_framed
from ..gateway import GATEWAY, Gateway
from ..request_record import RequestRecord
from ..upstream.routes import Route

FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta")
PATHS = {"/v1/embeddings": "embeddings", "/v1/responses": "responses", "/v1/messages": "messages",
         "/v1/messages/count_tokens": "messages/count_tokens"}

log = logging.getLogger("kilnproxy")


def add_routes(app: web.Application, expect_handler) -> None:
    """The router's routes: what the server's own table (``hot_routes``) does not take comes here (a query
    string, an escaped path, an ``Expect`` header)."""
    for path, endpoint in PATHS.items():
        app.router.add_post(path, partial(_route, endpoint=endpoint), expect_handler=expect_handler)


def hot_routes(gw: Gateway) -> dict[tuple[str, str], Callable]:
    """The endpoints of this module for the server's own route table (``fastpath``), as completions'."""
    return {("POST", path): partial(handle, gw=gw, endpoint=endpoint) for path, endpoint in PATHS.items()}


async def _route(request: web.Request, endpoint: str) -> web.StreamResponse:
    return await handle(request, request.app[GATEWAY], endpoint)


def _authorization(request: web.BaseRequest, endpoint: str) -> str | None:
    """A bearer, or on Anthropic's endpoints the ``x-api-key`` its SDK sends (as a bearer)."""
    if endpoint.startswith("messages"):
        return either_header(request.headers)
    return request.headers.get("Authorization")


def _error(err: GatewayError | UpstreamFailure, headers: dict | None = None, endpoint: str = "") -> web.Response:
    if endpoint.startswith("messages"):
        return anthropic_error_response(err, headers)
    return err.response(headers)


def _checks(body: dict, call: Call, route: Route) -> None:
    if call.endpoint == "embeddings":
        check_embeddings(body)
        return
    rules.check_stream(body, call)
    if call.endpoint == "responses" and body.get("background") not in (None, False):
        # answered at once, its answer read later from GET /v1/responses/{id}: neither served nor metered here
        raise bad_request("`background` responses are not supported: the gateway does not serve GET "
                          "/v1/responses/{id}, where their answer is read.", param="background",
                          code="unsupported_parameter")


async def handle(request: web.BaseRequest, gw: Gateway, endpoint: str) -> web.StreamResponse:
    if endpoint == "messages/count_tokens":
        try:
            key = gw.keys.authenticate(_authorization(request, endpoint))
        except GatewayError as err:
            return _error(err, None, endpoint)
        return await count_tokens(request, gw, key)
    api = ANTHROPIC if endpoint == "messages" else OPENAI
    return await request_path.handle(request, gw, endpoint, api)


def api_hold(call: Call, created_at: str, body: dict, context_window: int | None) -> Hold:
    """The most the request can cost: embeddings produce no tokens, and each input of a batch may fill
    the context window; the Responses API caps its output with ``max_output_tokens``, and a follow-up of
    a stored response or conversation may fill the window with its prompt; Anthropic's ``max_tokens`` is
    read as a completion's is."""
    if call.endpoint == "embeddings":  # the window bounds each input of a batch
        return Hold(call, created_at, body, context_window, 0, input_count(body))
    if call.endpoint == "responses":
        limit = body.get("max_output_tokens")
        completion = output_bound(limit if type(limit) is int and limit >= 0 else None, context_window)
        # a follow-up's prompt is the stored conversation the server prepends: up to the whole window
        stored = context_window if body.get("previous_response_id") or body.get("conversation") else None
        return Hold(call, created_at, body, context_window, completion, prompt=stored or None)
    return Hold(call, created_at, body, context_window)


def _upstream_headers(request: web.BaseRequest) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


async def _relay(request: web.BaseRequest, gw: Gateway, call: Call, route: Route, record: RequestRecord,
                 resp, headers: dict, first: bytes | None) -> web.StreamResponse:
    return await relay_framed(request, gw, call, record, resp, headers, first)


def read_answer(call: Call, record: RequestRecord, answer: dict) -> None:
    """Usage from the endpoint's own usage object; the Responses API's ``status`` or Anthropic's
    ``stop_reason`` as the finish reason; a ``failed`` response's ``error.code`` (else ``upstream_error``)
    as the error code, as its stream's ``response.failed`` gives it. The usage object's counts are capped
    as the row's are."""
    usage = answer.get("usage")
    if isinstance(usage, dict):
        cap_counts(usage)
        record.usage = Usage.of_endpoint(call.endpoint, usage)
    reason = answer.get("stop_reason") if call.endpoint == "messages" else answer.get("status")
    if call.endpoint != "embeddings" and isinstance(reason, str):
        record.finish_reason = reason
    if call.endpoint == "responses" and reason == "failed":
        error = answer.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        record.error_code = code if isinstance(code, str) else "upstream_error"


async def count_tokens(request: web.BaseRequest, gw: Gateway, key: KeyConfig) -> web.Response:
    """Anthropic's token count, forwarded for a valid key and a model that serves messages; no row."""
    endpoint = "messages/count_tokens"
    try:
        rules.check_account(key, gw.disabled_orgs, gw.credits, gw.config.maintenance)
        body = await rules.read_json_body(request, gw.config.server)
        route = rules.check_model(body, key, gw.routes)
        rules.check_endpoint(route, "messages")
        body["model"] = route.model.upstream_model
        # no generation slot: counting tokens takes none of the server's, and must not wait for them
        upstream, resp = await route.send(gw.upstream_client, endpoint, write(body),
                                          headers=_upstream_headers(request))
        try:
            raw = await read_upstream(resp)
        finally:
            resp.release()
        if resp.status >= 300 and resp.status not in (400, 422):
            raise UpstreamFailure(f"{upstream.base_url} answered HTTP {resp.status} on /{endpoint}")
        return web.Response(status=resp.status, body=raw,
                            content_type=resp.headers.get("Content-Type", "application/json").split(";")[0])
    except (GatewayError, UpstreamFailure) as err:
        return _error(err, getattr(err, "headers", None), endpoint)


OPENAI = request_path.Api(checks=_checks, relay=_relay, read_answer=read_answer, hold=api_hold)
ANTHROPIC = request_path.Api(checks=_checks, relay=_relay, read_answer=read_answer, hold=api_hold,
                             authorization=partial(_authorization, endpoint="messages"),
                             error=partial(_error, endpoint="messages"), upstream_headers=_upstream_headers)
