"""The upstream servers' own loads, read in the background (SPEC 13's ``load_poll``), bound to the slot pools.

``LoadWatch`` starts with the gateway (``kilnproxy.ops.admin``'s cleanup
context, after the health checks), reads the routes, and watches each
upstream URL whose model has ``load_poll > 0`` with a
``kilnproxy.proxy.upstream.load_readers.LoadPoller`` (one per interval; a
model with a single upstream has no choice to make, so it reads nothing; an
origin listed by models with different intervals is read at the smallest:
one task per origin). Each URL's slot pool is given its origin's state
(``SlotPool.polled``), so a request reads the last load with no call and no
lookup; a pool whose URL is not read gets None. It watches again whenever
the routes are replaced (``Gateway.routes_replaced``: a reload, model
discovery), and stops every task at shutdown.
"""

from __future__ import annotations

import math

from ..proxy.gateway import Gateway
from ..proxy.upstream.load_readers import LoadPoller, origin_of
from ..proxy.upstream.slots import SlotPool


class LoadWatch:
    def __init__(self, gw: Gateway):
        self.gw = gw
        self.pollers: dict[float, LoadPoller] = {}  # load_poll seconds -> its poller
        self._started = False

    def start(self) -> None:
        self._started = True
        self.gw.route_listeners.append(self.rewatch)
        self.rewatch()

    async def stop(self) -> None:
        if self.rewatch in self.gw.route_listeners:
            self.gw.route_listeners.remove(self.rewatch)
        self._started = False
        pollers, self.pollers = list(self.pollers.values()), {}
        for poller in pollers:
            await poller.close()
        for pool in self._pools().values():
            for p in pool:
                p.polled = None

    def _pools(self) -> dict[str, list[SlotPool]]:
        pools: dict[str, list[SlotPool]] = {}
        for route in self.gw.routes.values():
            for upstream in route.upstreams:
                same = pools.setdefault(upstream.base_url, [])
                if all(p is not upstream.slots for p in same):
                    same.append(upstream.slots)
        return pools

    def rewatch(self) -> None:
        """Watch the URLs of the current routes (and no others); bind each pool to its origin's reads."""
        if not self._started:
            return
        interval: dict[str, float] = {}  # origin -> the smallest load_poll of the models listing it
        headers: dict[str, dict[str, str]] = {}  # URL -> what its reads send (the upstream's Authorization)
        urls: dict[str, str] = {}  # URL -> its origin
        for route in self.gw.routes.values():
            seconds = route.model.load_poll
            if seconds <= 0 or len(route.upstreams) < 2:  # one upstream: no choice that a load could change
                continue
            auth = {k: v for k, v in route.headers.items() if k == "Authorization"}
            for upstream in route.upstreams:
                url = upstream.base_url
                origin = urls[url] = origin_of(url)
                interval[origin] = min(interval.get(origin, math.inf), seconds)
                if auth:
                    headers.setdefault(url, auth)
        by_interval: dict[float, list[str]] = {}
        for url, origin in urls.items():
            by_interval.setdefault(interval[origin], []).append(url)
        for seconds in by_interval:
            if seconds not in self.pollers:
                self.pollers[seconds] = LoadPoller(seconds)
        for seconds, poller in self.pollers.items():  # a poller no URL needs now reads nothing (closed at stop)
            poller.watch(by_interval.get(seconds, ()), headers)
        for url, pools in self._pools().items():
            origin = urls.get(url)
            state = None if origin is None else self.pollers[interval[origin]].state_of(url)
            for pool in pools:
                pool.polled = state
