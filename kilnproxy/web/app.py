"""``create_app(config)``: the aiohttp application of one gateway.

The ``Gateway`` (upstream session, ledger, plugins) is opened and closed in
``cleanup_ctx``. A ``GatewayError`` raised by any handler becomes its JSON
error; an unexpected exception becomes a 500 JSON error (and a logged
traceback), never an HTML page.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from aiohttp import web

from ..batches import install as batches
from ..config import Config
from ..errors import GatewayError
from ..inspector import fallback_headers, setup_inspector
from ..ops import admin, org_api, spend_api, tenancy_api
from ..plugins.manager import build_plugin_manager
from ..proxy.endpoints import api_routes
from ..proxy.endpoints import reads as read_endpoints
from ..proxy.endpoints.completions import chat_completions, completions, hot_routes
from ..proxy.discovery import Discovery
from ..proxy.gateway import GATEWAY, Gateway
from ..proxy.endpoints.json_routes import add_fallback, expect_handler
from .fastpath import HOT_ROUTES

log = logging.getLogger("kilnproxy")


def create_app(config: Config, extra_plugins: Iterable[Any] = ()) -> web.Application:
    """Build the app; plugins are loaded (and checked) here, the database opened on start-up.
    ``extra_plugins``: plugin objects registered after the config's (for tests)."""
    gateway = Gateway(config, build_plugin_manager(config, extra_plugins))
    app = web.Application(middlewares=[json_errors], client_max_size=config.server.max_request_bytes)
    app[GATEWAY] = gateway
    # answered by the server's own route table (kilnproxy.web.fastpath)
    app[HOT_ROUTES] = {**hot_routes(gateway), **api_routes.hot_routes(gateway)}
    app.cleanup_ctx.append(_gateway_ctx)
    # also here: a path with a query string or an escape, or an Expect header, comes through the router
    app.router.add_post("/v1/completions", completions, expect_handler=expect_handler)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_handler)
    api_routes.add_routes(app, expect_handler)  # embeddings, responses, messages (and count_tokens)
    app.router.add_get("/v1/models", read_endpoints.list_models, expect_handler=expect_handler)
    app.router.add_get("/v1/models/{model_id:.+}", read_endpoints.get_model, expect_handler=expect_handler)
    app.router.add_get("/v1/credits", read_endpoints.credits, expect_handler=expect_handler)
    app.router.add_get("/v1/key", read_endpoints.own_key, expect_handler=expect_handler)
    app.router.add_get("/v1/generations/{generation_id}", read_endpoints.generation, expect_handler=expect_handler)
    app.router.add_get("/healthz", read_endpoints.healthz, expect_handler=expect_handler)
    admin.install(app)  # /metrics, /admin/reload, access log, health checks, graceful shutdown
    tenancy_api.add_routes(app)  # /admin/v1: orgs, keys, grants and their events
    batches.install(app, expect_handler)  # /v1/files, /v1/batches and the runner of batches
    spend_api.add_routes(app)  # /admin/v1/usage: spend by day, model, key and org
    org_api.add_routes(app)  # /v1/org: an org's own admin keys, its keys, spend and events
    setup_inspector(app, gateway)
    add_fallback(app)  # last: JSON 404/405 for whatever no route above serves
    return app


async def _gateway_ctx(app: web.Application):
    gateway = app[GATEWAY]
    await gateway.start()
    discovery = Discovery(gateway)
    try:
        await discovery.start()  # the upstreams' own models are served from the first request on
    except BaseException:
        await gateway.stop()
        raise
    yield
    await discovery.stop()
    await gateway.stop()


@web.middleware
async def json_errors(request: web.Request, handler):
    """Errors as JSON; under ``/ui`` with the inspector page's security headers, as its own answers
    have (looked up on errors only: an answer that succeeds costs nothing more)."""
    try:
        return await handler(request)
    except GatewayError as err:
        return err.response(fallback_headers(request.path))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = "not_found" if exc.status == 404 else "method_not_allowed" if exc.status == 405 else "invalid_request"
        headers = {**_allow(exc), **(fallback_headers(request.path) or {})}
        return GatewayError(exc.status, code, exc.reason, headers=headers).response()
    except (ConnectionResetError, web.RequestPayloadError) as exc:
        raise exc
    except Exception:
        if request.writer.output_size:  # a stream had begun: let aiohttp close the connection
            raise
        log.exception("unexpected error on %s %s", request.method, request.path)
        return GatewayError(500, "internal_error", "The gateway failed unexpectedly; see its log.",
                            type="server_error").response(fallback_headers(request.path))


def _allow(exc: web.HTTPException) -> dict:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}
