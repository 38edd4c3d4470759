"""Spend over HTTP: ``GET /admin/v1/usage`` (the operator's) and the answer ``/v1/org/usage`` gives
(an org's own admins), the usage rows summed by day, model, key and org (docs/reference.md).

``spend_answer(request, gw, org)`` is the one answer of both: ``org`` None is the operator's (every
org, or the one its ``org`` parameter names; ``group_by`` may hold ``org``); a string is that org's
alone, and ``org`` as a parameter or a group is refused. The query and its figures are
``kilnproxy.store.spend``'s. Parameters: ``from``, ``to`` (ISO-8601 dates or times, UTC; ``from``
inclusive, ``to`` exclusive; default ``to`` now, ``from`` 30 days before), ``group_by`` (a
comma-separated list of ``day``, ``model``, ``key`` and, for the operator, ``org``). A parameter that
is not valid, or one the route does not take: 400 ``invalid_request`` naming it. The answer is
``{"data": [row]}``, or CSV when ``Accept`` names ``text/csv``. The database out of reach: 503
``store_unavailable``.
"""

from __future__ import annotations

from dataclasses import replace

from aiohttp import web

from ..proxy.endpoints.json_routes import expect_handler
from ..proxy.endpoints.reads import json_response
from ..proxy.gateway import GATEWAY, Gateway
from ..proxy.tenancy.changes import answer_store_trouble, query
from ..store.spend import BadSpendQuery, answer_rows, csv_bytes, parse_spend, statement
from ..store.tenancy.validation import invalid
from .admin import check_admin

PARAMETERS = ("org", "from", "to", "group_by")  # an org's own query refuses ``org`` by name (parse_spend)
CSV_TYPE = "text/csv; charset=utf-8"


async def spend_answer(request: web.Request, gw: Gateway, org: str | None) -> web.Response:
    """The spend of ``org`` (None: the operator's query, any org) for the request's parameters, as
    JSON or (``Accept: text/csv``) CSV; 400 ``invalid_request`` naming a parameter that is not valid."""
    params = query(request, *PARAMETERS)
    try:
        spend = parse_spend(params, org_scoped=org is not None)
    except BadSpendQuery as exc:
        raise invalid(str(exc), exc.param) from None
    if org is not None:
        spend = replace(spend, org=org)
    sql, args = statement(spend)
    with answer_store_trouble():
        rows = answer_rows(spend, await gw.ledger.fetch(sql, args))
    if wants_csv(request.headers.get("Accept", "")):
        return web.Response(body=csv_bytes(spend, rows), headers={"Content-Type": CSV_TYPE})
    return json_response({"data": rows})


def wants_csv(accept: str) -> bool:
    """Whether ``Accept`` names ``text/csv`` (with a q above 0)."""
    for part in accept.split(","):
        media, *options = (piece.strip() for piece in part.split(";"))
        if media.lower() == "text/csv":
            return not any(o.replace(" ", "").lower() in ("q=0", "q=0.0", "q=0.00", "q=0.000") for o in options)
    return False


async def operator_usage(request: web.Request) -> web.Response:
    """``GET /admin/v1/usage``, behind the access rule of the other ``/admin/v1`` routes."""
    check_admin(request)
    return await spend_answer(request, request.app[GATEWAY], None)


def add_routes(app: web.Application) -> None:
    """Add ``GET /admin/v1/usage`` to a gateway's app (``create_app`` does)."""
    app.router.add_route("GET", "/admin/v1/usage", operator_usage, expect_handler=expect_handler)
