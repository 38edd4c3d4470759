"""Fallbacks across catalog models, and the request's deadline before its answer begins.

``open_upstream`` reaches an upstream for a request that has passed the
request rules: the requested model's upstreams first (``Route.open``), then
each of its ``fallbacks`` in order, while nothing has reached the client.
A model cannot take the request when every upstream is marked down, refused,
timed out, missed its ``first_byte_timeout``, answered bytes that are not HTTP,
answered 429 or 5xx, or kept every slot busy past its ``queue_timeout``. A fallback is skipped when the
key may not use it, it does not serve the endpoint, or the request's hold,
re-placed at its prices, does not fit the org's credits or the key's limit.
A fallback's own fallbacks are not followed. A Responses follow-up
(``previous_response_id``) that an upstream answers 404 goes on to the model's
next upstream, since each server keeps its own responses; a 404 is no reason
to fall back to another model. When no model of the chain can
take the request, the client gets what the last one tried answered.

From a fallback on, ``call.model``, ``call.upstream_model`` and
``call.pricing`` name the fallback (the answer's ``model``, the row's
``model`` and its cost); the row's ``requested_model`` keeps the model asked
for. When no model of the chain serves, they name the model asked for again. ``rewrite_request`` plugins ran once, for the requested model; the
fallback's upstream gets the same body with its own ``upstream_model``.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, NamedTuple

from ..config import KeyConfig
from ..errors import GatewayError, UpstreamFailure, plugin_failed
from ..call import Call, set_model
from ..plugins.manager import BUILT_IN
from ..store.limits import Hold
from .upstream.affinity import affinity_key
from .upstream.fair_queue import Claim
from .upstream.deadlines import RequestTimedOut, deadline_of, request_deadline_passed
from .relay.event_json import write
from .gateway import Gateway
from .request_record import RequestRecord
from .upstream.routes import Route, Upstream, cannot_take
from .upstream.responses import UpstreamResponse


# A Responses follow-up (``previous_response_id``) answered 404 by an upstream that does not hold the
# response it follows (each server keeps its own): another upstream of the model may hold it.
NOT_HELD = 404


class Opened(NamedTuple):
    route: Route  # the model that serves
    upstream: Upstream
    resp: UpstreamResponse
    first: bytes | None  # a stream's first bytes, when read to meet first_byte_timeout
    deadline: float | None  # loop time when request_timeout ends the answer


def open_upstream(gw: Gateway, call: Call, key: KeyConfig, route: Route, record: RequestRecord,
                  body: dict, headers: dict[str, str] | None = None, hold_of=Hold) -> Awaitable[Opened]:
    """The first model of the chain that takes the request, with its upstream's response (to await).
    Raises what the last model tried answered (``GatewayError`` or ``UpstreamFailure``)."""
    claim = gw.claim_of(key)  # its place in the queues for upstream slots, the same on every model of the chain
    if not route.model.fallbacks:  # a chain of one: its model's answer or failure is the request's
        return _open_model(gw, call, route, record, body, headers, claim)
    return _open_chain(gw, call, key, route, record, body, headers, hold_of, claim)


async def _open_chain(gw: Gateway, call: Call, key: KeyConfig, route: Route, record: RequestRecord,
                      body: dict, headers: dict[str, str] | None, hold_of, claim: Claim) -> Opened:
    chain = [route] + [gw.routes.get(f) for f in route.model.fallbacks]
    requested = call.model, call.upstream_model, call.pricing
    problem: Exception | None = None
    for i, model in enumerate(chain):
        last = i == len(chain) - 1
        if i > 0:
            if model is None or not await _switch_to(gw, call, key, record, model, body, hold_of):
                continue
            key_pair = (route.id, model.id)
            gw.fallback_counts[key_pair] = gw.fallback_counts.get(key_pair, 0) + 1
        try:
            opened = await _open_model(gw, call, model, record, body, headers, claim)
        except RequestTimedOut:
            raise  # the request's own time is up: no fallback
        except (GatewayError, UpstreamFailure) as exc:
            problem = exc
            continue
        if cannot_take(opened.resp.status) and not last and _any_left(gw, call, key, chain[i + 1:]):
            opened.upstream.release()
            opened.resp.close()
            record.sent = False
            problem = UpstreamFailure(f"{opened.upstream.base_url} answered HTTP {opened.resp.status}")
            continue
        return opened
    set_model(call, *requested)  # none served: the row names the model asked for
    raise problem


async def _open_model(gw: Gateway, call: Call, route: Route, record: RequestRecord, body: dict,
                      headers: dict[str, str] | None, claim: Claim) -> Opened:
    model = route.model
    try:
        payload = write(body)  # orjson's bytes; the json module's for a lone surrogate escape the client sent
    except TypeError as exc:  # only a plugin shown the body can have put something there
        raise _body_spoilt(gw, exc) from exc
    if record.tap is not None:
        record.tap.sent_upstream(payload)
    loop = gw.loop
    deadline = deadline_of(record.admitted, model.request_timeout)
    queue_deadline = loop.time() + model.queue_timeout
    if deadline is not None:
        queue_deadline = min(queue_deadline, deadline)
    elsewhere = NOT_HELD if call.endpoint == "responses" and body.get("previous_response_id") else None
    # cache_aware: the affinity key of the body in hand (the dict the request path parsed; SPEC 13)
    key = None if route.rendezvous is None else affinity_key(call.endpoint, body)
    if deadline is None:
        upstream, resp, first = await route.open(gw.upstream_client, call.endpoint, payload, call.stream, queue_deadline,
                                                 headers, record.trace, elsewhere, record, key, claim)
        return Opened(route, upstream, resp, first, None)
    if deadline <= loop.time():  # passed already (a fallback's, by the time it is tried): no slot, no send
        raise request_deadline_passed(route.id, model.request_timeout)
    try:
        async with asyncio.timeout_at(deadline):
            upstream, resp, first = await route.open(gw.upstream_client, call.endpoint, payload, call.stream,
                                                     queue_deadline, headers, record.trace, elsewhere, record, key,
                                                     claim)
    except TimeoutError:
        raise request_deadline_passed(route.id, model.request_timeout) from None
    return Opened(route, upstream, resp, first, deadline)


def _body_spoilt(gw: Gateway, exc: TypeError) -> GatewayError:
    """``plugin_error`` naming the plugins (not the built-in ones) whose hooks were shown the request body."""
    impls = [i for i in gw.hooks.check_request + gw.hooks.rewrite_request if i.plugin not in BUILT_IN]
    names = ", ".join(dict.fromkeys(i.plugin for i in impls)) or "?"
    hooks = " or ".join(dict.fromkeys(i.hook for i in impls)) or "rewrite_request"
    return plugin_failed(names, hooks, TypeError(f"the body is no longer JSON: {exc}"))


def _usable(route: Route, key: KeyConfig, endpoint: str) -> bool:
    return (key.models is None or route.id in key.models) and route.serves(endpoint)


def _any_left(gw: Gateway, call: Call, key: KeyConfig, rest: list[Route | None]) -> bool:
    return any(r is not None and _usable(r, key, call.endpoint) for r in rest)


async def _switch_to(gw: Gateway, call: Call, key: KeyConfig, record: RequestRecord, route: Route,
                     body: dict, hold_of) -> bool:
    """Make ``route`` the request's model, its hold re-placed at its prices; False: skip it."""
    if not _usable(route, key, call.endpoint):
        return False
    before = call.model, call.upstream_model, call.pricing
    set_model(call, route.id, route.model.upstream_model,
              route.pricing if record.batch_id is None else route.pricing.for_batch)
    old = record.hold
    rehold = getattr(gw.admission, "rehold", None)
    if old is not None and rehold is not None:
        new = hold_of(call, record.created_at, body, route.model.context_window)  # the API's own hold
        new.key_limit, new.key_since, new.per_minute = old.key_limit, old.key_since, old.per_minute
        try:
            await rehold(old, new)
        except GatewayError:  # the org's credits or the key's limit do not fit the fallback's hold
            set_model(call, *before)
            return False
        record.hold = new  # released with the row, at the fallback's amount
    body["model"] = route.model.upstream_model
    return True
