"""The operator's side of a gateway: ``GET /metrics``, ``POST /admin/reload``,
and the wiring of metrics, access log, health checks, reload and graceful
shutdown into the app (``install``).

Both endpoints are for the operator, not for API keys. ``[admin]`` says who
may call them: a request with ``Authorization: Bearer <[admin] token>``, and
(``allow_loopback = true``, the default) a local request as
``kilnproxy.access.local_request`` defines it (loopback peer, loopback
``Host``, no foreign ``Origin``), the inspector's rule. Refused: 401
``invalid_admin_token`` when a token is configured, else 403 ``forbidden``.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from ..access import bearer_token, local_request, token_matches
from ..errors import GatewayError, forbidden
from ..proxy.gateway import GATEWAY
from ..proxy.endpoints.json_routes import expect_handler
from .tracing import install as tracing
from .accesslog import AccessLog
from .batch_metrics import BatchCollector
from .health import HealthChecker
from .load_poll import LoadWatch
from .lifecycle import Shutdown
from .metrics import ReloadStats, RequestStats, build_registry
from .reload import Reloader

REGISTRY = web.AppKey("metrics_registry", object)
RELOADER = web.AppKey("reloader", Reloader)
HEALTH = web.AppKey("health_checker", HealthChecker)
LOADS = web.AppKey("load_watch", LoadWatch)
SHUTDOWN = web.AppKey("shutdown", Shutdown)


def install(app: web.Application) -> None:
    """Add the operations features to a gateway app built by ``create_app``."""
    gw = app[GATEWAY]
    config = gw.config
    health = HealthChecker(gw)
    reloads = ReloadStats()
    stats = None
    if config.metrics.enabled:
        stats = RequestStats()
        app[REGISTRY] = build_registry(gw, stats, reloads, health.failures)
        app[REGISTRY].register(BatchCollector(app))
        app.router.add_get("/metrics", metrics, expect_handler=expect_handler)
    reloader = Reloader(gw, reloads, health, stats.observe if stats is not None else None)
    gw.row_observers = reloader.observers_for(config)
    app[RELOADER] = reloader
    app[HEALTH] = health
    app[LOADS] = LoadWatch(gw)
    app[SHUTDOWN] = shutdown = Shutdown(gw)
    app.middlewares.append(shutdown.middleware)
    gw.ledger.journal_when(shutdown.alone)  # the row journal: for a request served alone
    app.on_shutdown.append(shutdown.drain)
    app.cleanup_ctx.append(_operations_ctx)
    app.router.add_post("/admin/reload", reload_config, expect_handler=expect_handler)
    tracing.install(app)  # [tracing]: spans of the completion requests


async def _operations_ctx(app: web.Application):
    """Runs after the gateway has started and stops before it stops (cleanup_ctx order)."""
    app[HEALTH].start()
    app[LOADS].start()  # the servers' own loads (load_poll): one task per upstream origin
    yield
    await app[LOADS].stop()
    await app[HEALTH].stop()
    for observer in app[GATEWAY].row_observers:
        if isinstance(observer, AccessLog):
            observer.flush()


def check_admin(request: web.Request) -> None:
    admin = request.app[GATEWAY].config.admin
    if token_matches(bearer_token(request.headers.get("Authorization")), (admin.token_sha256,)):
        return
    if admin.allow_loopback and local_request(request):
        return
    if admin.token_sha256 is not None:
        raise GatewayError(401, "invalid_admin_token",
                           "Send 'Authorization: Bearer <token>' with the [admin] token of the gateway's config.",
                           type="authentication_error")
    raise forbidden("Admin endpoints answer local clients only (a loopback address and Host, no other "
                    "site's Origin); set [admin] token to allow others.")


async def metrics(request: web.Request) -> web.Response:
    """Prometheus' text format (0.0.4), or OpenMetrics when the scraper's ``Accept`` asks for it."""
    check_admin(request)
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encode(request.app[REGISTRY]), headers={"Content-Type": content_type})


async def reload_config(request: web.Request) -> web.Response:
    """Re-read the config file: 200 ``{"reloaded": true, "summary"}``, or 422 ``config_invalid``
    naming the problem (the running config stays in force)."""
    check_admin(request)
    ok, message = await request.app[RELOADER].reload_latest()
    if not ok:
        raise GatewayError(422, "config_invalid", message, type="invalid_request_error")
    return web.json_response({"reloaded": True, "summary": message})
