"""The inspector's HTTP side: access rule, the page's files, the JSON API and the live SSE feed.

Access (``access()``), checked before every handler here, with the rule of
``kilnproxy.access`` that ``/metrics`` and ``/admin/*`` use too:

* no ``[inspector] token``: local requests only (loopback peer, loopback
  ``Host``, no foreign ``Origin``), so that a web page elsewhere cannot read
  the API through DNS rebinding; anything else gets 403;
* a token: the API needs ``Authorization: Bearer <token>`` (or ``?token=``, for
  ``EventSource``, which cannot send headers), from any address, loopback
  included; the page's own files hold no data and are served to anyone;
* the ``[admin]`` token, when set, opens the inspector like its own token: an
  operator with it can use the inspector from another machine;
* a change (the "Orgs & keys" page's POST and DELETE, ``.tenancy``) takes the
  token from the ``Authorization`` header only.

See docs/inspector.md for the API.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import mimetypes
import os
import time
from pathlib import Path
from typing import Awaitable, Callable

import orjson
from aiohttp import web

from ..access import bearer_token, local_request, token_digest, token_matches
from ..errors import GatewayError
from ..proxy.gateway import Gateway
from ..proxy.endpoints.json_routes import expect_handler
from ..proxy.stream_writer import SSE_HEADERS, close_after_body
from .batches import BatchesPage
from .capture import describe, fixture_of
from .hub import CLOSED, RESET, LiveHub, event_frame
from .queries import MAX_LIMIT, InspectorStore, QueryError, digits
from .tenancy import TenancyPage
from .upstreams import upstreams_view

STATIC = Path(__file__).parent / "static"
KEEPALIVE_SECONDS = 15.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# On every answer under /ui (and /portal). The page runs only its own files: no inline script or style (an injected
# one would not run), no frame around it (it has buttons that revoke keys), nothing sniffed.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",  # the page's address may hold ?token=
}
NO_STORE = {"Cache-Control": "no-store"}  # the API's answers hold prompts, completions, a new key's secret
PAGES = ("/ui", "/portal")  # the inspector's, the org admins' portal's (``.portal``)


def fallback_headers(path: str) -> dict[str, str] | None:
    """The headers of an error answer the app gives outside the routes here (``secured``): a path
    under ``/ui`` or ``/portal`` that none serves (404), a method none takes (405), a body over the
    limit (413), a bug (500). None for a path under neither."""
    for page in PAGES:
        if path == page or path.startswith(page + "/"):
            return {**SECURITY_HEADERS, **NO_STORE}
    return None


class InspectorAPI:
    def __init__(self, gateway: Gateway, store: InspectorStore, hub: LiveHub):
        self.gateway = gateway
        self.config = gateway.config.inspector
        self.store = store
        self.hub = hub
        self.files = load_static(STATIC)
        self.token_sha256 = token_digest(self.config.token.encode()) if self.config.token is not None else None

    def routes(self) -> list[web.RouteDef]:
        routes = [
            web.get("/ui", self.redirect, expect_handler=expect_handler),
            web.get("/ui/", self.index, expect_handler=expect_handler),
            web.get("/ui/static/{name:.+}", self.static, expect_handler=expect_handler),
            web.get("/ui/api/meta", self.meta, expect_handler=expect_handler),
            web.get("/ui/api/requests", self.requests, expect_handler=expect_handler),
            web.get("/ui/api/requests/{generation_id}", self.request_detail, expect_handler=expect_handler),
            web.get("/ui/api/requests/{generation_id}/fixture", self.fixture, expect_handler=expect_handler),
            web.get("/ui/api/usage", self.usage, expect_handler=expect_handler),
            web.get("/ui/api/upstreams", self.upstreams, expect_handler=expect_handler),
            web.get("/ui/api/events", self.events, expect_handler=expect_handler),
            *TenancyPage(self).routes(),
            *BatchesPage(self).routes(),
        ]
        return [web.RouteDef(r.method, r.path, secured(r.handler), r.kwargs) for r in routes]

    # -- access -------------------------------------------------------------------

    def access(self, request: web.Request, *, data: bool = True, header_only: bool = False) -> None:
        """Let the request through or raise 403 ``forbidden`` / 401 ``invalid_token``.
        ``data=False``: the page's own files, which hold no data; ``header_only``: a change, whose
        token must come in the ``Authorization`` header."""
        admin_sha256 = self.gateway.config.admin.token_sha256  # read per request: [admin] reloads
        if self.token_sha256 is None and local_request(request):
            return
        if self.token_sha256 is None and admin_sha256 is None:
            raise GatewayError(403, "forbidden", "The inspector answers local clients only; set "
                               "[inspector] token (or [admin] token) to open it to others.", type="forbidden")
        if not data:
            return
        given = bearer_token(request.headers.get("Authorization"))
        if given is None and not header_only:
            given = request.query.get("token", "").encode("utf-8", "surrogateescape") or None
        if not token_matches(given, (self.token_sha256, admin_sha256)):
            raise GatewayError(401, "invalid_token", "The inspector needs its token or the [admin] token: "
                               "`Authorization: Bearer <token>` or `?token=<token>`.", type="invalid_request_error")

    # -- the page -------------------------------------------------------------------

    async def redirect(self, request: web.Request) -> web.Response:
        self.access(request, data=False)
        raise web.HTTPFound("/ui/" + (f"?{request.query_string}" if request.query_string else ""))

    async def index(self, request: web.Request) -> web.Response:
        return await self._file(request, "index.html")

    async def static(self, request: web.Request) -> web.Response:
        return await self._file(request, request.match_info["name"])

    async def _file(self, request: web.Request, name: str) -> web.Response:
        self.access(request, data=False)
        found = self.files.get(name)
        if found is None:
            raise GatewayError(404, "not_found", f"No inspector file {name!r}.")
        body, content_type, etag = found
        headers = {"Content-Type": content_type, "Cache-Control": "no-cache", "ETag": etag}
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers=headers)
        return web.Response(body=body, headers=headers)

    # -- the JSON API ---------------------------------------------------------------

    async def meta(self, request: web.Request) -> web.Response:
        self.access(request)
        config = self.gateway.config
        runtime = self.gateway.tenants.snapshot.orgs if self.gateway.tenants is not None else {}
        return _json({"orgs": [o.id for o in config.orgs] + sorted(runtime), "models": [m.id for m in config.models],
                      "capture": self.gateway.capture is not None,
                      "capture_requests": self.config.capture_requests,
                      "capture_bytes": self.config.capture_bytes})

    async def requests(self, request: web.Request) -> web.Response:
        self.access(request)
        q = request.query
        limit = _limit(q.get("limit", "50"))
        try:
            rows, cursor = await self.store.page(limit, org=q.get("org"), model=q.get("model"),
                                                 status=q.get("status"), before=q.get("before"))
        except QueryError as exc:
            raise GatewayError(400, "invalid_request", str(exc), param=exc.param) from None
        return _json({"data": [self.hub.row_json(r) for r in rows], "next": cursor})

    async def request_detail(self, request: web.Request) -> web.Response:
        self.access(request)
        generation_id = request.match_info["generation_id"]
        row = await self.store.get(generation_id)
        capture = self.gateway.capture
        tap = capture.get(generation_id) if capture is not None else None
        if row is None and tap is None:
            raise GatewayError(404, "not_found", f"No request {generation_id!r} in the ledger.")
        tracer = self.gateway.tracer  # [tracing] on: ``link`` is the request's trace, with trace_url set
        # Off the event loop: a capture of half a million tiny events takes a quarter of a second to read.
        described = await asyncio.to_thread(describe, tap.snapshot(), row) if tap is not None else None
        return _json({"id": generation_id, "row": row, "in_flight": row is None, "capture": described,
                      "trace": tracer.link(generation_id) if tracer is not None else None})

    async def fixture(self, request: web.Request) -> web.Response:
        """The capture's exchange with the upstream as a fixture file (docs/fixtures.md), to download."""
        self.access(request)
        generation_id = request.match_info["generation_id"]
        capture = self.gateway.capture
        tap = capture.get(generation_id) if capture is not None else None
        row = await self.store.get(generation_id) if tap is not None else None
        secrets = tuple(os.environ[m.upstream_api_key_env] for m in self.gateway.config.models
                        if m.upstream_api_key_env and os.environ.get(m.upstream_api_key_env))
        fixture = fixture_of(tap, row, secrets) if row is not None else None
        if fixture is None:
            raise GatewayError(404, "not_found", f"No fixture for {generation_id!r}: it must be captured whole, "
                               "ended, and have had an answer from the upstream.")
        return web.Response(body=fixture.dumps(), content_type="application/json", headers={
            "Content-Disposition": f'attachment; filename="{generation_id}.json"'})

    async def usage(self, request: web.Request) -> web.Response:
        self.access(request)
        q = request.query
        try:
            out = await self.store.usage(q.get("bucket", "minute"), q.get("since"), q.get("until"),
                                         org=q.get("org"), model=q.get("model"))
        except QueryError as exc:
            raise GatewayError(400, "invalid_request", str(exc), param=exc.param) from None
        return _json(out)

    async def upstreams(self, request: web.Request) -> web.Response:
        """Each model's upstreams: prompt-cache hit rate and load (``kilnproxy.inspector.upstreams``)."""
        self.access(request)
        return _json(upstreams_view(self.gateway, time.monotonic()))

    # -- live -----------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.StreamResponse:
        """SSE: ``{"type": "hello"}``, then ``{"type": "request", "row": ...}`` per committed row
        (and, with capture on, ``{"type": "started", "row": ...}`` as each request begins);
        ``{"type": "reset"}`` when this client fell behind and should reload its list."""
        self.access(request)
        sub = self.hub.subscribe()
        response = web.StreamResponse(headers={**SSE_HEADERS, **SECURITY_HEADERS})
        close_after_body(request, response)
        try:
            await response.prepare(request)
            await response.write(event_frame({"type": "hello", "capture": self.gateway.capture is not None}))
            while True:
                try:
                    async with asyncio.timeout(KEEPALIVE_SECONDS):
                        item = await sub.next()
                except TimeoutError:
                    await response.write(b": keepalive\n\n")
                    continue
                if item is CLOSED:
                    break
                await response.write(event_frame({"type": "reset"}) if item is RESET else item)
            await response.write_eof()
            return response
        except ConnectionResetError:
            return response
        finally:
            self.hub.unsubscribe(sub)


def secured(handler: Handler) -> Handler:
    """``handler`` with ``SECURITY_HEADERS`` on its answers, refusals included, and ``Cache-Control:
    no-store`` on those that set no ``Cache-Control`` of their own (the page's files revalidate)."""
    @functools.wraps(handler)
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            response = await handler(request)
        except GatewayError as err:
            return err.response({**SECURITY_HEADERS, **NO_STORE})
        except web.HTTPRedirection as redirect:
            redirect.headers.update(SECURITY_HEADERS)
            raise
        if not response.prepared:  # the live feed has sent its own
            response.headers.update(SECURITY_HEADERS)
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    return answer


def load_static(folder: Path) -> dict[str, tuple[bytes, str, str]]:
    """Every file of the page, read once at start-up: requests never touch the file system."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            content_type = mimetypes.guess_type(path.name)[0] or "text/plain"
            if content_type.startswith("text/") or content_type.endswith("javascript"):
                content_type += "; charset=utf-8"
            body = path.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
            files[path.relative_to(folder).as_posix()] = (body, content_type, etag)
    return files


def _limit(raw: str) -> int:
    if not digits(raw) or not 1 <= int(raw) <= MAX_LIMIT:
        raise GatewayError(400, "invalid_request", f"limit must be an integer from 1 to {MAX_LIMIT}.",
                           param="limit")
    return int(raw)


def _json(payload: dict) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
