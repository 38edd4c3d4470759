"""The org API, under ``/v1/org``: an org's own admin keys manage its keys and read its spend (docs/reference.md).

| method, path                  | body -> answer                                                       |
|-------------------------------|----------------------------------------------------------------------|
| GET /v1/org                   | the org object                                                       |
| GET /v1/org/keys              | {"data": [key]}, the org's keys, both sources                        |
| POST /v1/org/keys             | {"name", "models"?, "limit"?, "limit_reset"?, "expires_at"?, "role"?} |
|                               | -> 201 {"key": secret, "data": key}                                  |
| PATCH /v1/org/keys/{id}       | any of name, models, limit, limit_reset, expires_at, disabled, role  |
| DELETE /v1/org/keys/{id}      | revoke -> 200 key                                                    |
| GET /v1/org/usage             | spend (``kilnproxy.ops.spend_api``), the org's only                  |
| GET /v1/org/events[?limit=&before=] | {"data": [event]}, the org's, newest first                     |

This is the operator's admin API (``kilnproxy.ops.tenancy_api``) scoped to one
org: the same handlers, the same changes and views
(``kilnproxy.proxy.tenancy.changes``), given ``TenancyChanges`` of the caller's org
whose events name the actor ``key:<key id>``. Only the access rule is its own
(``org_admin``): the key itself, sent as ``Authorization: Bearer`` (no cookie, so
no other site's page can act for it), whatever its org's credits:

1. an unknown, revoked or expired key: 401 ``invalid_api_key``; a disabled key, or
   a key of a disabled org: 403 ``forbidden``;
2. read again from the store, so that a key revoked, disabled or demoted by any
   replica this very second is refused here too: the same answers, and 403
   ``forbidden`` for a key whose role is not ``admin``.

Then the changes' order: 400 ``invalid_request`` naming the field (an ``org``
or a per-minute limit in a body is an unknown field, an ``org`` query
parameter an unknown parameter), 404 ``not_found`` for a key of another org as
for a key that does not exist, 409 ``managed_by_config`` for a config key, 409
``conflict`` for a change that would leave the org no active admin key. Any
other path under ``/v1/org`` is 404, a method a route does not take 405 (the
app's fallback route).
"""

from __future__ import annotations

from aiohttp import web

from ..errors import GatewayError, forbidden
from ..proxy.endpoints.json_routes import expect_handler
from ..proxy.endpoints.reads import json_response
from ..proxy.gateway import GATEWAY
from ..proxy.tenancy.auth import check_enabled, key_disabled
from ..proxy.tenancy.changes import TenancyChanges, answer_store_trouble, query
from ..proxy.tenancy.views import gateway_view
from . import tenancy_api
from .spend_api import spend_answer
from .tenancy_api import served


def unknown_key() -> GatewayError:
    return GatewayError(401, "invalid_api_key", "Invalid API key. The org API takes an admin key of the org, "
                        "sent as 'Authorization: Bearer <key>'.", type="authentication_error")


async def org_admin(request: web.Request) -> TenancyChanges:
    """The org API's access rule (the module's steps 1 and 2): the changes of the caller's org, by it."""
    gw = request.app[GATEWAY]
    try:
        key = gw.keys.authenticate(request.headers.get("Authorization"))
    except GatewayError:
        raise unknown_key() from None
    check_enabled(key, gw.disabled_orgs)
    view = gateway_view(gw)
    row = await view.key_row(key.id)
    if row is None or row.get("revoked") or row["org"] != key.org:
        raise unknown_key()
    if row["disabled"]:
        raise key_disabled()
    if row["role"] != "admin":
        raise forbidden("This key is a member of its org: the org API takes one of its org's admin keys.")
    return TenancyChanges(view, f"key:{key.id}", gw.tenants.refresh, org=key.org)


async def own_org(request: web.Request, changes: TenancyChanges) -> web.Response:
    query(request)
    return json_response(await changes.org(changes.scope))


async def usage(request: web.Request) -> web.Response:
    """``GET /v1/org/usage``: the operator's spend answer (``spend_api.spend_answer``), of this org only."""
    with answer_store_trouble():
        changes = await org_admin(request)
    return await spend_answer(request, request.app[GATEWAY], changes.scope)


def add_routes(app: web.Application) -> None:
    """Add the ``/v1/org`` routes to a gateway's app (``create_app`` does)."""
    for method, path, handler in (
            ("GET", "/v1/org", served(org_admin, own_org)),
            ("GET", "/v1/org/keys", served(org_admin, tenancy_api.list_keys)),
            ("POST", "/v1/org/keys", served(org_admin, tenancy_api.create_key)),
            ("PATCH", "/v1/org/keys/{key_id}", served(org_admin, tenancy_api.update_key)),
            ("DELETE", "/v1/org/keys/{key_id}", served(org_admin, tenancy_api.revoke_key)),
            ("GET", "/v1/org/usage", usage),
            ("GET", "/v1/org/events", served(org_admin, tenancy_api.list_events))):
        app.router.add_route(method, path, handler, expect_handler=expect_handler)
