"""The org admins' portal: the page at ``/portal/`` and its files (docs/portal.md).

The page holds no data and needs no key: it is served to anyone. Signed in, it
reads and changes its org through the org API (``/v1/org``, ``/v1/org/keys``,
``/v1/org/usage``), with the admin key the user typed, kept in the page's
memory and sent as ``Authorization: Bearer``; never a cookie, so no other site
can make a browser act for the admin, and the org API sends no CORS header, so
no other site's script can read an answer either.

Every answer under ``/portal`` (refusals too, through ``fallback_headers``)
carries the inspector's ``SECURITY_HEADERS``: a Content-Security-Policy that
runs only the page's own files (no inline script or style) and lets it talk to
this origin only, no frame around it (it has buttons that revoke keys).

Its files: its own (``portal_static/``), and some of the inspector's, shared so
that every page writes money one way, looks alike and draws with one Chart.js:
``money.js``, ``style.css`` and ``vendor/``. All read once at start-up.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from ..errors import GatewayError
from ..proxy.endpoints.json_routes import expect_handler
from .api import STATIC, load_static, secured

PORTAL = "/portal"
FILES = Path(__file__).parent / "portal_static"
# the inspector's, under /portal/static/ too: one way to write money, one look, one Chart.js
SHARED = ("money.js", "style.css", "vendor/chart.umd.min.js", "vendor/NOTICE")


class PortalPages:
    def __init__(self) -> None:
        shared = load_static(STATIC)
        self.files = {**load_static(FILES), **{name: shared[name] for name in SHARED}}

    def routes(self) -> list[web.RouteDef]:
        routes = [
            web.get(PORTAL, self.redirect, expect_handler=expect_handler),
            web.get(PORTAL + "/", self.index, expect_handler=expect_handler),
            web.get(PORTAL + "/static/{name:.+}", self.static, expect_handler=expect_handler),
        ]
        return [web.RouteDef(r.method, r.path, secured(r.handler), r.kwargs) for r in routes]

    async def redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(PORTAL + "/")  # no query string kept: nothing the page reads comes in its address

    async def index(self, request: web.Request) -> web.Response:
        return self._file(request, "index.html")

    async def static(self, request: web.Request) -> web.Response:
        return self._file(request, request.match_info["name"])

    def _file(self, request: web.Request, name: str) -> web.Response:
        found = self.files.get(name)
        if found is None:
            raise GatewayError(404, "not_found", f"No portal file {name!r}.")
        body, content_type, etag = found
        headers = {"Content-Type": content_type, "Cache-Control": "no-cache", "ETag": etag}
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers=headers)
        return web.Response(body=body, headers=headers)
