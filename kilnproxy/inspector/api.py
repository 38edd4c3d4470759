"""The inspector's HTTP side: access rule, the page's files, the JSON API and the live SSE feed.

Access (``access()``), checked before every handler here:

* no ``[inspector] token``: loopback clients only, and only under a loopback
  ``Host`` (``localhost``, ``127.x``, ``[::1]``) so that a web page elsewhere
  cannot read the API through DNS rebinding; anything else gets 403;
* a token: the API needs ``Authorization: Bearer <token>`` (or ``?token=``, for
  ``EventSource``, which cannot send headers), from any address, loopback
  included; the page's own files hold no data and are served to anyone.

See docs/inspector.md for the API.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import mimetypes
import os
from pathlib import Path

import orjson
from aiohttp import web

from ..errors import GatewayError
from ..gateway import Gateway
from ..stream import SSE_HEADERS
from .capture import describe, fixture_of
from .hub import CLOSED, RESET, LiveHub, event_frame
from .store import MAX_LIMIT, InspectorStore, QueryError

STATIC = Path(__file__).parent / "static"
KEEPALIVE_SECONDS = 15.0


class InspectorAPI:
    def __init__(self, gateway: Gateway, store: InspectorStore, hub: LiveHub):
        self.gateway = gateway
        self.config = gateway.config.inspector
        self.store = store
        self.hub = hub
        self.files = load_static(STATIC)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/ui", self.redirect),
            web.get("/ui/", self.index),
            web.get("/ui/static/{name:.+}", self.static),
            web.get("/ui/api/meta", self.meta),
            web.get("/ui/api/requests", self.requests),
            web.get("/ui/api/requests/{generation_id}", self.request_detail),
            web.get("/ui/api/requests/{generation_id}/fixture", self.fixture),
            web.get("/ui/api/usage", self.usage),
            web.get("/ui/api/events", self.events),
        ]

    # -- access -------------------------------------------------------------------

    def access(self, request: web.Request, *, data: bool = True) -> None:
        token = self.config.token
        if token is None:
            if not (_loopback_peer(request.remote) and _loopback_host(request.host)):
                raise GatewayError(403, "forbidden", "The inspector answers loopback clients only; set "
                                   "[inspector] token to open it to others.", type="forbidden")
            return
        if not data:
            return
        given = request.headers.get("Authorization", "")
        given = given[7:] if given[:7].lower() == "bearer " else request.query.get("token", "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise GatewayError(401, "invalid_token", "The inspector needs its token: "
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
        return _json({"orgs": [o.id for o in config.orgs], "models": [m.id for m in config.models],
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
        return _json({"id": generation_id, "row": row, "in_flight": row is None,
                      "capture": describe(tap, row) if tap is not None else None})

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

    # -- live -----------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.StreamResponse:
        """SSE: ``{"type": "hello"}``, then ``{"type": "request", "row": ...}`` per committed row
        (and, with capture on, ``{"type": "started", "row": ...}`` as each request begins);
        ``{"type": "reset"}`` when this client fell behind and should reload its list."""
        self.access(request)
        sub = self.hub.subscribe()
        response = web.StreamResponse(headers=SSE_HEADERS)
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
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise GatewayError(400, "invalid_request", f"limit must be an integer from 1 to {MAX_LIMIT}.",
                           param="limit")
    return int(raw)


def _json(payload: dict) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def _loopback_peer(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


def _loopback_host(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
