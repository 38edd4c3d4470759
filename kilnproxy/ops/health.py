"""Active health checks of the upstreams (``[health]``), next to the passive marking-down.

Every ``interval`` seconds each distinct upstream server is asked ``GET <path>``
(``path`` is taken from the server's root: ``http://host:8000/v1`` with
``path = "/health"`` asks ``http://host:8000/health``). Any HTTP answer below
500 within ``timeout`` means the server is up (a 404 or 401 still proves it
is serving); a refused connection, a timeout or a 5xx marks it down at once,
for every model it serves, until a later check succeeds. A success marks it up
and clears the failures the request path counted (``Upstream.check_passed``), so
a replica that comes back is used again without waiting for
``upstream_down_seconds``.

The routes are read afresh every round, so a reload's new upstreams are
checked from the next round on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import aiohttp

from ..proxy.gateway import Gateway
from ..proxy.upstream.routes import Upstream
from ..tasks import cancelled, woken

log = logging.getLogger("kilnproxy")


def check_url(base_url: str, path: str) -> str:
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}{path}"


class HealthChecker:
    def __init__(self, gw: Gateway):
        self.gw = gw
        self.failures: dict[str, int] = {}  # base URL -> failed checks, for /metrics
        self._down: set[str] = set()        # base URLs the last check found down (to log changes only)
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kilnproxy-health-checks")

    async def stop(self) -> None:
        self._task = await cancelled(self._task)

    async def _run(self) -> None:
        while True:
            interval = self.gw.config.health.interval
            if interval > 0:
                try:
                    await self.check_all()
                except Exception:  # a bug here must not end the checks for good
                    log.exception("health checks failed")
            self._wake.clear()
            await woken(self._wake, interval or None)  # a reload that turns checks on wakes us (``wake``)

    def wake(self) -> None:
        self._wake.set()

    async def check_all(self) -> None:
        by_url: dict[str, list[Upstream]] = {}
        headers: dict[str, dict] = {}
        for route in list(self.gw.routes.values()):
            for upstream in route.upstreams:
                by_url.setdefault(upstream.base_url, []).append(upstream)
                headers.setdefault(upstream.base_url, {k: v for k, v in route.headers.items()
                                                       if k == "Authorization"})
        await asyncio.gather(*(self._check(url, ups, headers[url]) for url, ups in by_url.items()))

    async def _check(self, base_url: str, upstreams: list[Upstream], headers: dict) -> None:
        cfg = self.gw.config.health
        problem = await self._probe(check_url(base_url, cfg.path), headers, cfg.timeout)
        if problem is None:
            for u in upstreams:
                u.check_passed()
            if base_url in self._down:
                self._down.discard(base_url)
                log.info("upstream %s is up again", base_url)
            return
        self.failures[base_url] = self.failures.get(base_url, 0) + 1
        until = time.monotonic() + 2 * (cfg.interval + cfg.timeout)  # renewed by every failing check
        for u in upstreams:
            u.mark_down(until)
        if base_url not in self._down:
            self._down.add(base_url)
            log.warning("upstream %s is down: health check %s: %s", base_url, cfg.path, problem)

    async def _probe(self, url: str, headers: dict, timeout: float) -> str | None:
        """``None`` when the server answered below 500, else what went wrong."""
        session = self.gw.session
        try:
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
                                   allow_redirects=False) as resp:
                if resp.status >= 500:
                    return f"HTTP {resp.status}"
                return None
        except asyncio.TimeoutError:
            return f"no answer within {timeout:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
