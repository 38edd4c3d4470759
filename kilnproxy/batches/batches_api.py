"""``/v1/batches``: create, get, list (newest first, ``limit`` and ``after``), cancel.

A batch is created ``validating`` (answered 200 at once); its runner checks the input and runs the
lines (``kilnproxy.batches.job``). The body's ``input_file_id`` must name a file of the key's org of
purpose ``batch`` (another org's: 404, as if it did not exist), ``endpoint`` one of ``ENDPOINTS``,
``completion_window`` ``24h``; other fields are ignored. A batch is its org's: another org's key gets
404 ``batch_not_found``. A cancel of a batch that has ended, or is ending, changes nothing.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from ..errors import bad_request
from ..proxy.endpoints.reads import authorized_key, json_response
from ..proxy.request_body import read_body
from ..proxy.tenancy.changes import answer_store_trouble
from .objects import (ENDPOINTS, WINDOWS, batch_not_found, batch_object, check_metadata, file_not_found,
                      list_page, page_query)
from .service import BATCHES


async def create(request: web.Request) -> web.Response:
    key = authorized_key(request)
    svc = request.app[BATCHES]
    body = await _json_object(request, svc.config.server)
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise bad_request("`input_file_id` must be the id of a file uploaded with purpose=batch.",
                          param="input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"`endpoint` must be one of {', '.join(ENDPOINTS)}.", param="endpoint")
    window = body.get("completion_window")
    if window not in WINDOWS:
        raise bad_request(f"`completion_window` must be one of {', '.join(WINDOWS)}.", param="completion_window")
    metadata = check_metadata(body.get("metadata"))
    with answer_store_trouble():
        found = await svc.files.get(key.org, file_id)
        if found is None:
            raise file_not_found(file_id)
        if found["purpose"] != "batch":
            raise bad_request(f"File `{file_id}` has purpose {found['purpose']!r}; a batch's input has purpose "
                              "\"batch\".", param="input_file_id")
        row = await svc.batches.create(key.org, key.id, endpoint, file_id, WINDOWS[window], metadata)
    if svc.runner is not None:
        svc.runner.wake()
    return json_response(batch_object(row))


async def _json_object(request: web.Request, server) -> dict:
    raw = await read_body(request, server)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


async def get_batch(request: web.Request) -> web.Response:
    key = authorized_key(request)
    batch_id = request.match_info["batch_id"]
    with answer_store_trouble():
        row = await request.app[BATCHES].batches.get(key.org, batch_id)
    if row is None:
        raise batch_not_found(batch_id)
    return json_response(batch_object(row))


async def list_batches(request: web.Request) -> web.Response:
    key = authorized_key(request)
    limit, after = page_query(request.query, 20, 100)
    with answer_store_trouble():
        rows = await request.app[BATCHES].batches.list(key.org, limit + 1, after)
    return json_response(list_page([batch_object(r) for r in rows], limit))


async def cancel(request: web.Request) -> web.Response:
    key = authorized_key(request)
    svc = request.app[BATCHES]
    batch_id = request.match_info["batch_id"]
    with answer_store_trouble():
        row = await svc.batches.cancel(key.org, batch_id)
    if row is None:
        raise batch_not_found(batch_id)
    if svc.runner is not None:
        svc.runner.wake()
    return json_response(batch_object(row))


def add_routes(app: web.Application, expect_handler) -> None:
    app.router.add_post("/v1/batches", create, expect_handler=expect_handler)
    app.router.add_get("/v1/batches", list_batches, expect_handler=expect_handler)
    app.router.add_get("/v1/batches/{batch_id}", get_batch, expect_handler=expect_handler)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel, expect_handler=expect_handler)
