"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages): their part of the request's path.

What differs from a completion: the key may come in ``x-api-key`` too; the ``anthropic-version``
and ``anthropic-beta`` headers are forwarded; every error is answered in Anthropic's form
(``anthropic_errors``); the hold's completion part is ``max_tokens``, read as a completion's is;
the usage is the answer's ``usage`` object (``api_steps.read_usage``), the finish reason its
``stop_reason``; a stream keeps its ``event:`` framing (``api_steps.relay``).

``/v1/messages/count_tokens`` is forwarded unmetered (``count_tokens``): no hold, no row, and no
upstream slot (``max_in_flight`` counts generations; a count waits for none).
"""

from __future__ import annotations

from aiohttp import web

from ...call import Call
from ...config import KeyConfig
from ...errors import GatewayError, UpstreamFailure
from .. import rules
from ..forward import read_upstream
from ..gateway import Gateway
from ..relay.anthropic_errors import anthropic_error_response
from ..relay.event_json import write
from ..request_path import Api
from ..request_record import RequestRecord
from ..tenancy.auth import either_header
from ..upstream.routes import Route
from .api_steps import read_usage, relay

FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta")
COUNT_TOKENS = "messages/count_tokens"


def authorization(request: web.BaseRequest) -> str | None:
    """A bearer, or the ``x-api-key`` Anthropic's SDK sends (as a bearer)."""
    return either_header(request.headers)


def upstream_headers(request: web.BaseRequest) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def checks(body: dict, call: Call, route: Route) -> None:
    rules.check_stream(body, call)


def read_answer(call: Call, record: RequestRecord, answer: dict) -> None:
    """Usage, and the ``stop_reason`` as the finish reason."""
    read_usage(call, record, answer)
    reason = answer.get("stop_reason")
    if isinstance(reason, str):
        record.finish_reason = reason


async def count_tokens_route(request: web.BaseRequest, gw: Gateway) -> web.StreamResponse:
    """``/v1/messages/count_tokens``: the key checked, then ``count_tokens``."""
    try:
        key = gw.keys.authenticate(authorization(request))
    except GatewayError as err:
        return anthropic_error_response(err, None)
    return await count_tokens(request, gw, key)


async def count_tokens(request: web.BaseRequest, gw: Gateway, key: KeyConfig) -> web.Response:
    """Anthropic's token count, forwarded for a valid key and a model that serves messages; no row."""
    try:
        rules.check_account(key, gw.disabled_orgs, gw.credits, gw.config.maintenance)
        body = await rules.read_json_body(request, gw.config.server)
        route = rules.check_model(body, key, gw.routes)
        rules.check_endpoint(route, "messages")
        body["model"] = route.model.upstream_model
        # no generation slot: counting tokens takes none of the server's, and must not wait for them
        upstream, resp = await route.send(gw.upstream_client, COUNT_TOKENS, write(body),
                                          headers=upstream_headers(request))
        try:
            raw = await read_upstream(resp)
        finally:
            resp.release()
        if resp.status >= 300 and resp.status not in (400, 422):
            raise UpstreamFailure(f"{upstream.base_url} answered HTTP {resp.status} on /{COUNT_TOKENS}")
        return web.Response(status=resp.status, body=raw,
                            content_type=resp.headers.get("Content-Type", "application/json").split(";")[0])
    except (GatewayError, UpstreamFailure) as err:
        return anthropic_error_response(err, getattr(err, "headers", None))


MESSAGES = Api(checks=checks, relay=relay, read_answer=read_answer, authorization=authorization,
               error=anthropic_error_response, upstream_headers=upstream_headers)
