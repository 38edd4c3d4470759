"""Signals and graceful shutdown.

``serve_until_stopped(running, reloader)`` is what ``python -m kilnproxy``
runs once the gateway listens:

- SIGHUP reloads the config (``kilnproxy.ops.reload``).
- SIGTERM or SIGINT stops it gracefully: the listening socket is closed at
  once, idle keep-alive connections too; requests in flight may finish for up
  to ``[server] shutdown_grace_seconds``. Streams still open then are ended
  with an error event (code ``shutting_down``) and ``data: [DONE]``, their
  rows committed like any other; a request still waiting for its upstream is
  answered 502. Then the ledger commits what is queued and the process exits 0.
- A second SIGTERM/SIGINT ends the grace period at once (same ending, same
  rows, no waiting); a third exits on the spot (committed rows are on disk).

The grace period lives in the app's ``on_shutdown`` (``drain``), so
``Running.stop()`` in tests drains the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from aiohttp import web

from ..proxy.stream import ShuttingDown

log = logging.getLogger("kilnproxy")

END_SECONDS = 5.0  # after the grace period: time for ended streams to write their last events


class Shutdown:
    """Counts requests in progress (an app middleware) and runs the grace period."""

    def __init__(self, gw) -> None:
        self.gw = gw
        self.active = 0
        self.hurry = asyncio.Event()  # set by a second signal: stop waiting
        self._idle: asyncio.Event | None = None

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        self.active += 1
        try:
            return await handler(request)
        finally:
            self.active -= 1
            if not self.active and self._idle is not None:
                self._idle.set()

    async def drain(self, app: web.Application) -> None:
        """``on_shutdown``: wait for requests in flight, then end the streams still open."""
        grace = self.gw.config.server.shutdown_grace_seconds
        self._idle = asyncio.Event()
        if self.active:
            log.info("shutting down: waiting up to %g s for %d request(s) in flight", grace, self.active)
        if await self._wait_idle(grace):
            return
        ended = end_streams(self.gw)
        log.warning("shutting down: ending %d stream(s) still open%s", ended,
                    "" if self.hurry.is_set() else f" after {grace:g} s")
        await self._wait_idle(END_SECONDS, hurry=False)

    async def _wait_idle(self, seconds: float, hurry: bool = True) -> bool:
        if not self.active:
            return True
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry:
            waits.append(asyncio.ensure_future(self.hurry.wait()))
        done, pending = await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return not self.active


def end_streams(gw) -> int:
    """End every upstream response being relayed: the relay sees ``ShuttingDown``."""
    responses = list(gw.open_upstreams)
    for resp in responses:
        resp.content.set_exception(ShuttingDown())
    return len(responses)


async def serve_until_stopped(running, shutdown: Shutdown, reload=None, ready=None) -> None:
    """Serve until SIGTERM/SIGINT, then stop ``running`` gracefully (see the module's docstring).
    ``ready()`` is called once the signal handlers are in place (print the banner there: whoever
    waits for it may signal at once). ``running`` is stopped on every way out of here."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_stop_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("%s: shutting down gracefully (send it again to stop waiting)", signal.Signals(signum).name)
            stop.set()
        elif signals == 2:
            log.warning("%s again: ending everything in flight now", signal.Signals(signum).name)
            shutdown.hurry.set()
        else:
            os._exit(1)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal, sig)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, reload)
    try:
        if ready is not None:
            ready()
        await stop.wait()
    finally:
        try:
            await running.stop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
