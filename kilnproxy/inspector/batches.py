"""The inspector's "Batches" page, its JSON side: every org's batches, newest first.

``GET /ui/api/batches[?org=&limit=]``: ``{"data": [batch]}``, each the Batch API's batch object
(``kilnproxy.batches.objects``) with its ``org`` and ``progress`` (the share of its lines ended, 0 to
1). Behind the inspector's access rule; 503 ``store_unavailable`` when the database is out of reach.
A request's row names its batch in ``batch_id``: the page links one to the other.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..batches.objects import batch_object
from ..batches.service import BATCHES
from ..proxy.endpoints.json_routes import expect_handler
from ..proxy.tenancy.changes import answer_store_trouble

LIMIT = 100


class BatchesPage:
    def __init__(self, api: Any):
        self.api = api  # the InspectorAPI: its access rule

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/ui/api/batches", self.batches, expect_handler=expect_handler)]

    async def batches(self, request: web.Request) -> web.Response:
        self.api.access(request)
        org = request.query.get("org") or None
        with answer_store_trouble():
            rows = await request.app[BATCHES].batches.recent(LIMIT, org)
        return web.Response(body=orjson.dumps({"data": [shown(r) for r in rows]}), content_type="application/json")


def shown(row: dict[str, Any]) -> dict[str, Any]:
    batch = batch_object(row)
    counts = batch["request_counts"]
    ended = counts["completed"] + counts["failed"]
    return {**batch, "org": row["org"], "progress": ended / counts["total"] if counts["total"] else 0.0}
