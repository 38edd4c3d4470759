"""The admin API of runtime orgs, keys and credit grants, under ``/admin/v1`` (docs/reference.md).

| method, path                         | body -> answer                                             |
|--------------------------------------|------------------------------------------------------------|
| POST /admin/v1/orgs                  | {"id", "max_in_flight"?, ...} -> 201 org                   |
| GET /admin/v1/orgs, .../orgs/{id}    | {"data": [org]}, org                                       |
| PATCH /admin/v1/orgs/{id}            | {"max_in_flight"?, "disabled"?, ...} -> 200 org            |
| POST /admin/v1/orgs/{id}/grants      | {"amount", "reference"} -> 201 grant; 200 + the first grant |
|                                      | for a reference already used                               |
| GET /admin/v1/orgs/{id}/grants       | {"data": [grant]}, oldest first                            |
| POST /admin/v1/keys                  | {"org", "name", ...} -> 201 {"key": secret, "data": key}   |
| GET /admin/v1/keys[?org=], .../{id}  | {"data": [key]}, key                                       |
| PATCH /admin/v1/keys/{id}            | any of name, models, limit, ... -> 200 key                 |
| DELETE /admin/v1/keys/{id}           | revoke -> 200 key                                          |
| GET /admin/v1/events[?org=&limit=&before=] | {"data": [event]}, newest first                      |

Every route is behind the access rule of ``/admin/reload`` (``admin.check_admin``),
checked before the body is read. The key routes and the events are also the org
API's (``kilnproxy.ops.org_api``): the same handlers, given changes scoped to
one org instead (``served(who, handler)``: ``who`` decides who asks). The rules of a change (400, then 404, then
409; nothing changed by a refused request; the change in force on this
replica before the answer) are ``kilnproxy.proxy.tenancy.changes``'; the objects
are ``kilnproxy.proxy.tenancy.views``'. A query parameter a route does not take
is refused like an unknown body field. The database out of reach: 503
``store_unavailable``. Events name the actor ``admin-api``.
"""

from __future__ import annotations

import functools
from typing import Awaitable, Callable

from aiohttp import web

from ..proxy.gateway import GATEWAY
from ..proxy.endpoints.json_routes import expect_handler
from ..proxy.endpoints.reads import json_response
from ..proxy.request_body import read_body
from ..proxy.tenancy.changes import TenancyChanges, answer_store_trouble, query
from ..proxy.tenancy.views import gateway_view
from ..store.tenancy.validation import invalid, parse_body
from .admin import check_admin

ACTOR = "admin-api"
MAX_EVENTS = 1000  # events in one page

Handler = Callable[[web.Request, TenancyChanges], Awaitable[web.Response]]
Asker = Callable[[web.Request], Awaitable[TenancyChanges]]


def served(who: Asker, handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``who(request)`` (the access rule: refuses, or answers the changes the caller may make), then
    ``handler(request, changes)``, the store's outages answered 503."""

    @functools.wraps(handler)
    async def route(request: web.Request) -> web.Response:
        with answer_store_trouble():
            return await handler(request, await who(request))

    return route


async def operator(request: web.Request) -> TenancyChanges:
    """The operator's access rule (``check_admin``), then changes of every org, by ``admin-api``."""
    check_admin(request)
    gw = request.app[GATEWAY]
    return TenancyChanges(gateway_view(gw), ACTOR, gw.tenants.refresh)


def admin_route(handler: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
    return served(operator, handler)


def whole_number(params: dict[str, str], name: str, default: int | None, low: int, high: int) -> int | None:
    """The query parameter ``name`` as an int from ``low`` to ``high`` (ASCII digits only), ``default``
    when absent, or 400 naming it."""
    if name not in params:
        return default
    text = params[name]
    if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
        raise invalid(f"`{name}` must be a whole number from {low} to {high}.", name)
    return int(text)


async def body(request: web.Request) -> object:
    """The request's JSON body, read and decoded as the completions endpoints' are (408, 413
    ``request_too_large``, 415 ``unsupported_content_encoding``), then parsed (400)."""
    return parse_body(await read_body(request, request.app[GATEWAY].config.server))


# -- orgs -------------------------------------------------------------------------------------------

@admin_route
async def create_org(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response(await changes.create_org(await body(request)), status=201)


@admin_route
async def list_orgs(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response({"data": await changes.view.orgs()})


@admin_route
async def get_org(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response(await changes.org(request.match_info["org_id"]))


@admin_route
async def update_org(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response(await changes.update_org(request.match_info["org_id"], await body(request)))


@admin_route
async def add_grant(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    grant, created = await changes.add_grant(request.match_info["org_id"], await body(request))
    return json_response(grant, status=201 if created else 200)


@admin_route
async def list_grants(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response({"data": await changes.grants(request.match_info["org_id"])})


# -- keys (the org API's too: ``changes`` may be one org's) ---------------------------------------------

async def create_key(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    secret, key = await changes.create_key(await body(request))
    return json_response({"key": secret, "data": key}, status=201)


async def list_keys(request: web.Request, changes: TenancyChanges) -> web.Response:
    params = query(request, *changes.filters)
    return json_response({"data": await changes.keys(params.get("org"))})


async def get_key(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response(await changes.key(request.match_info["key_id"]))


async def update_key(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response(await changes.update_key(request.match_info["key_id"], await body(request)))


async def revoke_key(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response(await changes.revoke_key(request.match_info["key_id"]))


# -- events -----------------------------------------------------------------------------------------

async def list_events(request: web.Request, changes: TenancyChanges) -> web.Response:
    """Newest first: at most ``limit`` (100), ids below ``before`` (the last id of the previous page)."""
    params = query(request, *changes.filters, "limit", "before")
    limit = whole_number(params, "limit", 100, 1, MAX_EVENTS)
    before = whole_number(params, "before", None, 1, 2**62)
    return json_response({"data": await changes.events(params.get("org"), limit=limit, before=before)})


def add_routes(app: web.Application) -> None:
    """Add the ``/admin/v1`` routes to a gateway's app (``create_app`` does)."""
    for method, path, handler in (
            ("POST", "/admin/v1/orgs", create_org),
            ("GET", "/admin/v1/orgs", list_orgs),
            ("GET", "/admin/v1/orgs/{org_id}", get_org),
            ("PATCH", "/admin/v1/orgs/{org_id}", update_org),
            ("POST", "/admin/v1/orgs/{org_id}/grants", add_grant),
            ("GET", "/admin/v1/orgs/{org_id}/grants", list_grants),
            ("POST", "/admin/v1/keys", admin_route(create_key)),
            ("GET", "/admin/v1/keys", admin_route(list_keys)),
            ("GET", "/admin/v1/keys/{key_id}", admin_route(get_key)),
            ("PATCH", "/admin/v1/keys/{key_id}", admin_route(update_key)),
            ("DELETE", "/admin/v1/keys/{key_id}", admin_route(revoke_key)),
            ("GET", "/admin/v1/events", admin_route(list_events))):
        app.router.add_route(method, path, handler, expect_handler=expect_handler)
