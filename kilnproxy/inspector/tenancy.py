"""The inspector's "Orgs & keys" page, its JSON side: balances, keys, and three changes.

Under ``/ui/api/``, behind the inspector's access rule (``InspectorAPI.access``);
the changes need the token in the ``Authorization`` header (never ``?token=``,
which only the live feed's ``EventSource`` needs), so a link cannot make one.

* ``GET /ui/api/orgs``: ``{"data": [org]}``, both sources, by id;
* ``GET /ui/api/keys[?org=]``: ``{"data": [key]}``, each key with ``last_used``
  (the ``created_at`` of its newest usage row, null if none);
* ``POST /ui/api/keys``: ``{"org", "name", "models"?, "limit"?, "limit_reset"?,
  "expires_at"?, "role"?}`` → 201 ``{"key": "<secret>", "data": key}``: the one answer
  that ever holds the secret;
* ``DELETE /ui/api/keys/{id}``: revoke → 200 key;
* ``GET /ui/api/orgs/{id}/grants``: ``{"data": [grant]}``, oldest first;
* ``POST /ui/api/orgs/{id}/grants``: ``{"amount", "reference"}`` → 201 grant,
  or 200 and the first grant for a reference already used.

The objects, the checks and their order are the admin API's (``/admin/v1``,
``kilnproxy.proxy.tenancy.changes``): 400 ``invalid_request`` naming the
field, or the query parameter a route does not take (the reads take ``token``,
and the keys ``org``; the changes none), 404 ``not_found``, 409
``managed_by_config`` for a config key; a refused request changes nothing; a
change is in force on this replica (``Tenants.refresh``) before its answer, and
on the others within a second.
Audit events name the actor ``inspector``. 503 ``store_unavailable`` when the
database is out of reach.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..proxy.endpoints.json_routes import expect_handler
from ..proxy.request_body import read_body
from ..proxy.tenancy.changes import TenancyChanges, answer_store_trouble, query
from ..proxy.tenancy.views import gateway_view
from ..store.tenancy.validation import parse_body

ACTOR = "inspector"
READ_PARAMS = ("token",)  # the inspector's ``?token=``, which reads may carry
LAST_USED = "SELECT MAX(created_at) AS t FROM usage_events WHERE key_id = ?"  # the (key_id, created_at) index


class TenancyPage:
    def __init__(self, api: Any):
        self.api = api  # the InspectorAPI: its access rule and its gateway
        self.gateway = api.gateway

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/ui/api/orgs", self.orgs, expect_handler=expect_handler),
            web.get("/ui/api/orgs/{org_id}/grants", self.grants, expect_handler=expect_handler),
            web.post("/ui/api/orgs/{org_id}/grants", self.grant, expect_handler=expect_handler),
            web.get("/ui/api/keys", self.keys, expect_handler=expect_handler),
            web.post("/ui/api/keys", self.create_key, expect_handler=expect_handler),
            web.delete("/ui/api/keys/{key_id}", self.revoke_key, expect_handler=expect_handler),
        ]

    def changes(self) -> TenancyChanges:
        gw = self.gateway
        return TenancyChanges(gateway_view(gw), ACTOR, after_change=gw.tenants.refresh)

    # -- reads --

    async def orgs(self, request: web.Request) -> web.Response:
        self.api.access(request)
        query(request, *READ_PARAMS)
        with answer_store_trouble():
            return _json({"data": await self.changes().view.orgs()})

    async def keys(self, request: web.Request) -> web.Response:
        self.api.access(request)
        org = query(request, "org", *READ_PARAMS).get("org") or None
        with answer_store_trouble():
            keys = await self.changes().keys(org)
            for key in keys:
                key["last_used"] = await self._last_used(key["id"])
        return _json({"data": keys})

    async def grants(self, request: web.Request) -> web.Response:
        self.api.access(request)
        query(request, *READ_PARAMS)
        with answer_store_trouble():
            return _json({"data": await self.changes().grants(request.match_info["org_id"])})

    async def _last_used(self, key_id: str) -> str | None:
        rows = await self.gateway.tenancy.db.fetch(LAST_USED, key_id)
        return rows[0]["t"] if rows else None

    # -- changes --

    async def create_key(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        with answer_store_trouble():
            secret, key = await self.changes().create_key(body)
        return _json({"key": secret, "data": key}, 201)

    async def revoke_key(self, request: web.Request) -> web.Response:
        self.api.access(request, header_only=True)
        query(request)
        with answer_store_trouble():
            return _json(await self.changes().revoke_key(request.match_info["key_id"]))

    async def grant(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        with answer_store_trouble():
            grant, created = await self.changes().add_grant(request.match_info["org_id"], body)
        return _json(grant, 201 if created else 200)

    async def _body(self, request: web.Request) -> Any:
        self.api.access(request, header_only=True)
        query(request)
        return parse_body(await read_body(request, self.gateway.config.server))  # as the admin API reads it


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")
