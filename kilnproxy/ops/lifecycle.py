"""Signals and graceful shutdown.

``serve_until_stopped(running, reloader)`` is what ``python -m kilnproxy``
runs once the gateway listens:

- SIGHUP reloads the config (``kilnproxy.ops.reload``).
- SIGTERM first drains the connections for ``[server] drain_seconds``: the
  gateway answers ``GET /healthz?ready`` with 503 at once, so that a load
  balancer's health check takes it out, and goes on serving whatever still
  reaches it, each response now saying ``Connection: close`` and its
  connection closed right after it. A kept-alive connection is never closed
  while idle then: a balancer may be sending a request on it at that very
  moment, and it does not retry a POST that may have reached the server.
- Then (at once for SIGINT, the interactive stop) the listening socket is
  closed: new connections are held off it for a moment first, then the
  ones waiting in its queue are taken (closing it would reset them, and a
  balancer may have sent a request on one; ``Running.stop_listening``). After a drain, the connections still open are served for up to
  ``LINGER_SECONDS`` more, each closed after its response: a balancer that
  kept one idle through the drain may send a request on it just as the
  listener closes (its next new connection is refused, which takes the
  replica out). The wait ends once no connection is left: a balancer whose
  idle timeout for its connections is shorter than ``LINGER_SECONDS`` closes
  the ones it does not use, so none is closed under a request on its way.
  Then the idle keep-alive connections still open are closed; requests in flight may finish
  for up to ``[server] shutdown_grace_seconds``. Streams still open then are ended
  with an error event (code ``shutting_down``) and ``data: [DONE]``, their
  rows committed like any other; a request still waiting for an upstream slot
  or an upstream's answer is answered 503 ``shutting_down``, and none starts
  another (a slot freed then goes to nobody). Then the ledger commits what is
  queued and the process exits 0.
- A second SIGTERM/SIGINT ends the drain and the grace period at once (same ending, same
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

from ..aiohttp_internals import close_after_response  # the drain's middleware, and tests, call it from here
from ..errors import GatewayError
from ..proxy.stream_writer import ShuttingDown
from ..tasks import woken

log = logging.getLogger("kilnproxy")

END_SECONDS = 5.0  # after the grace period: time for ended streams to write their last events
# after a drain: how long the connections still open are served once nothing listens, longer than a balancer
# keeps one idle (docs/replicas.md: nginx's keepalive_timeout 2s), so that it, not the gateway, closes the idle ones
LINGER_SECONDS = 3.0


class Shutdown:
    """Counts requests in progress (an app middleware), runs the drain and the grace period."""

    def __init__(self, gw) -> None:
        self.gw = gw
        self.active = 0
        self.draining = False
        self.hurry = asyncio.Event()  # set by a second signal: stop waiting
        self._idle: asyncio.Event | None = None

    def alone(self) -> bool:
        """Whether the request asking is the only one in progress."""
        return self.active <= 1

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if self.draining:
            close_after_response(request)
        self.active += 1
        try:
            return await handler(request)
        finally:
            self.active -= 1
            if not self.active and self._idle is not None:
                self._idle.set()

    async def drain_connections(self) -> bool:
        """Before the listening socket closes: not ready, still serving, one response per connection.
        False when ``drain_seconds`` is 0 (no drain: stop listening and close idle connections at once)."""
        seconds = self.gw.config.server.drain_seconds
        self.draining = self.gw.draining = True
        if not seconds:
            return False
        log.info("draining: /healthz?ready answers 503; serving for %g s more, closing each connection "
                 "after its response", seconds)
        await woken(self.hurry, seconds)
        return True

    async def drain(self, app: web.Application) -> None:
        """``on_shutdown``: wait for requests in flight, then end the streams still open."""
        grace = self.gw.config.server.shutdown_grace_seconds
        self._idle = asyncio.Event()
        if self.active:
            log.info("shutting down: waiting up to %g s for %d request(s) in flight", grace, self.active)
        if await self._wait_idle(grace):
            return
        self.gw.refuse_upstream_requests(shutting_down)
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


def shutting_down() -> GatewayError:
    """The answer of a request still waiting for an upstream when the grace period ends."""
    return GatewayError(503, "shutting_down", "The gateway is shutting down; retry the request.",
                        type="service_unavailable", headers={"Retry-After": "1"})


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
    drain = False

    def on_stop_signal(signum: int) -> None:
        nonlocal signals, drain
        signals += 1
        if signals == 1:
            log.info("%s: shutting down gracefully (send it again to stop waiting)", signal.Signals(signum).name)
            drain = signum == signal.SIGTERM
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
        if drain and await shutdown.drain_connections():
            await running.stop_listening()
            log.info("stopped listening; connections still open are served for up to %g s more, "
                     "each closed after its response", LINGER_SECONDS)
            await running.linger(LINGER_SECONDS, shutdown.hurry)
    finally:
        try:
            await running.stop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
