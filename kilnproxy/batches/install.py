"""The Batch API in a gateway's app: its routes, its store opened and closed with the gateway, its
runner started once the server listens (the runner sends lines to that address) and stopped first
at a shutdown.

``LISTENING``: the app key of the ``Listening`` the server (``kilnproxy.web.server.start_app``) tells
the address it listens on.
"""

from __future__ import annotations

import asyncio
import ipaddress

from aiohttp import web

from ..proxy.gateway import GATEWAY
from . import batches_api, files_api
from .runner import BatchRunner
from .service import BATCHES, BatchService

class Listening:
    """Where the server listens, once it does."""

    def __init__(self) -> None:
        self.address: tuple[str, int] | None = None
        self.known = asyncio.Event()

    def tell(self, host: str, port: int) -> None:
        self.address = host, port
        self.known.set()


LISTENING = web.AppKey("listening", Listening)


def install(app: web.Application, expect_handler) -> None:
    app[BATCHES] = BatchService(app[GATEWAY])
    app[LISTENING] = Listening()
    files_api.add_routes(app, expect_handler)
    batches_api.add_routes(app, expect_handler)
    app.cleanup_ctx.append(_batches_ctx)
    app.on_shutdown.insert(0, _stop_taking_lines)  # before the drain waits for the requests in flight


def loopback_url(host: str, port: int) -> str:
    """The URL this process reaches its own listener at (a wildcard address: its loopback)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"http://{host}:{port}"
    if address.is_unspecified:
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    return f"http://[{address}]:{port}" if address.version == 6 else f"http://{address}:{port}"


async def _batches_ctx(app: web.Application):
    svc = app[BATCHES]
    await svc.open()
    starter = asyncio.create_task(_start_runner(app, svc), name="kilnproxy-batch-runner-start")
    try:
        yield
    finally:
        starter.cancel()
        await asyncio.gather(starter, return_exceptions=True)
        if svc.runner is not None:
            await svc.runner.stop()
        await svc.close()


async def _start_runner(app: web.Application, svc: BatchService) -> None:
    listening = app[LISTENING]
    await listening.known.wait()
    host, port = listening.address
    svc.runner = BatchRunner(svc, loopback_url(host, port))
    svc.runner.start()


async def _stop_taking_lines(app: web.Application) -> None:
    svc = app[BATCHES]
    if svc.runner is not None:
        svc.runner.stop_taking_lines()
