"""The request's whole path, the same for every API the gateway meters.

client -> key (``auth``) -> the request rules in order (``rules``: account,
body, model and endpoint, slot and hold) -> the API's own checks -> plugins
check and rewrite -> the API's ``forward`` (upstream, then a JSON answer or a
stream) -> exactly one usage row (``Gateway.submit``), whatever way the request
ends: answered, refused, failed upstream, cut by its client, or a bug.

What differs between APIs (completions, embeddings, the Responses API,
Anthropic Messages) is an ``Api``: where the key is read from, the hold, the
checks after admission, how the upstream's answer is relayed, and the form of
an error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

from ..errors import GatewayError, UpstreamFailure
from ..call import Call, open_call, seal, set_model
from ..plugins.manager import run_request_hooks
from ..store.limits import Hold
from ..store.ledger import store_unavailable
from . import rules
from .forward import forward
from .gateway import Gateway
from .request_record import RequestRecord
from .upstream.responses import UpstreamResponse
from .upstream.routes import Route

GENERATION_HEADER = "X-Neocloud-Generation-Id"
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before any response was sent

log = logging.getLogger("kilnproxy")


def _generation_ids():
    """``gen-`` + the time in ms (12 hex digits) + 48 random bits (12 hex digits): ids sort by
    creation time, so the usage table's key grows at its end rather than at random pages."""
    last, prefix = -1, ""
    while True:  # random bytes read from the OS 4096 ids at a time
        block = os.urandom(6 * 4096).hex()
        for start in range(0, len(block), 12):
            ms = int(time.time() * 1000)
            if ms != last:  # the prefix formatted once a millisecond (a padded hex format costs ~1 µs)
                last, prefix = ms, f"gen-{ms:012x}"
            yield prefix + block[start:start + 12]


new_generation_id = _generation_ids().__next__

Relay = Callable[[web.BaseRequest, Gateway, Call, Route, RequestRecord, UpstreamResponse, dict, bytes | None],
                 Awaitable[web.StreamResponse]]


def bearer(request: web.BaseRequest) -> str | None:
    return request.headers.get("Authorization")


def json_error(err: GatewayError | UpstreamFailure, headers: dict | None = None) -> web.Response:
    return err.response(headers)


def no_headers(request: web.BaseRequest) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Api:
    checks: Callable[[dict, Call, Route], None]  # steps 6-7, once admitted
    relay: Relay  # a streamed answer, from the upstream's response to the client
    read_answer: Callable[[Call, RequestRecord, dict], None]  # usage and finish reason of a JSON answer
    hold: Callable[[Call, str, dict, int | None], Hold] = Hold  # the most the request can cost
    authorization: Callable[[web.BaseRequest], str | None] = bearer  # the ``Authorization`` header to check
    error: Callable[..., web.Response] = json_error  # an error in the API's own form
    upstream_headers: Callable[[web.BaseRequest], dict[str, str]] = no_headers  # the client's, sent on


def refused_while_down(gw: Gateway, org: str, key_id: str, endpoint: str, api: Api) -> web.Response:
    """The store is down (the SQLite ledger has not committed for a while, ``kilnproxy.store.sqlite.ledger``;
    PostgreSQL cannot take statements, ``kilnproxy.store.postgres.store``): 503 ``store_unavailable`` at
    once, before anything else, so that nothing is served that could not be accounted for. Its row
    waits with the others (in memory; on PostgreSQL, then in the spool) and the answer does not wait
    for it; once ``max_waiting_rows`` rows wait, the refusal has no row and no generation id (as a 401)."""
    ledger = gw.ledger
    err = store_unavailable()
    if not ledger.keeps_refused_rows():
        ledger.refused_unrecorded += 1
        return api.error(err)
    ledger.refused += 1
    call = open_call(new_generation_id(), org, key_id, endpoint, gw.plugin_settings)
    record = RequestRecord(call)
    record.fail(err.status, err.code)
    gw.submit(record)  # not awaited: committed with the rows waiting, once the file takes them
    return api.error(err, {GENERATION_HEADER: call.generation_id})


async def handle(request: web.BaseRequest, gw: Gateway, endpoint: str, api: Api) -> web.StreamResponse:
    """The request's whole path (a plain ``BaseRequest`` from the route table, or the app's ``Request``)."""
    line = None
    try:
        key = gw.keys.authenticate(api.authorization(request))  # 401: no org, no row
    except GatewayError as err:
        found = gw.batch_credential.resolve(api.authorization(request), gw.keys.by_id)  # the Batch API's runner
        if found is None:
            return api.error(err)
        key, line = found
    if gw.ledger.refuses_requests:  # the store is down
        return refused_while_down(gw, key.org, key.id, endpoint, api)
    generation_id = new_generation_id() if line is None else line.generation_id
    call = open_call(generation_id, key.org, key.id, endpoint, gw.plugin_settings)  # sealed before plugins
    record = RequestRecord(call)
    if line is not None:
        record.batch_id = line.batch_id
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
        rules.check_endpoint(route, endpoint)
        record.requested_model = route.id
        set_model(call, route.id, route.model.upstream_model,
                  route.pricing if line is None else route.pricing.for_batch)
        hold = api.hold(call, record.created_at, body, route.model.context_window)
        slot = rules.take_slot(gw.admission, hold, gw.limit_for(key.org), key, gw.per_minute.get(key.org))  # step 5
        if trace is None:
            await slot
        else:
            with trace.admission():
                await slot
        record.hold = hold  # released with the row, in Gateway.submit
        record.admitted = gw.loop.time()  # request_timeout counts from here
        api.checks(body, call, route)  # steps 6-7
        seal(call)  # what plugins get is read-only (a refused request's: before record_usage)
        await run_request_hooks(gw.hooks, call, body)  # steps 8-9, with the built-in upstream_body plugin
        return await forward(request, gw, call, key, route, record, body, headers, api)
    except (GatewayError, UpstreamFailure) as err:
        record.fail(err.status, err.code)
        await gw.submit(record)  # the row is on disk before the response ends
        return api.error(err, {**getattr(err, "headers", {}), **headers})
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
        return api.error(err, headers)
    finally:
        gw.submit(record)  # once only: a no-op when already submitted, the row of a cancelled request otherwise
