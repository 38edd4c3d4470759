"""Reaching a model's upstreams: balancing, failover and marking down (the response rules (docs/reference.md)).

``Route`` holds what the request path needs to know of one catalog model.
``Route.open(...)`` sends the body to the least busy upstream that is not
marked down and returns the ``aiohttp.ClientResponse`` once its status line
and headers have arrived. An upstream that refuses the connection, times out,
or answers 502/503/504 before sending anything is skipped and the next one
tried, and counts toward marking it down; nothing has reached the client yet,
so this is safe. Every other status comes back to the caller as it is.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from typing import Mapping

import aiohttp
import orjson
from aiohttp.payload import BytesPayload

from ..config import ModelConfig, ServerConfig
from ..errors import UpstreamFailure, no_backend_available

# Statuses that say the server, not the request, is in trouble: skip to the next replica and count
# toward marking it down. A plain 500 is often caused by the request itself (llama.cpp answers 500
# for a grammar that dead-ends), so it fails that request only and says nothing of the server's health.
SERVER_DOWN_STATUSES = frozenset((502, 503, 504))

ENDPOINT_PATHS = {"completions": "/completions", "chat/completions": "/chat/completions",
                  "embeddings": "/embeddings", "responses": "/responses", "messages": "/messages",
                  "messages/count_tokens": "/messages/count_tokens"}


class Upstream:
    """One replica: a base URL and its health."""

    __slots__ = ("base_url", "urls", "in_flight", "failures", "failures_total", "down_until", "max_failures",
                 "down_seconds")

    def __init__(self, base_url: str, max_failures: int, down_seconds: float):
        self.base_url = base_url
        self.urls = {ep: base_url + path for ep, path in ENDPOINT_PATHS.items()}
        self.in_flight = 0
        self.failures = 0
        self.failures_total = 0  # every failure ever, for /metrics
        self.down_until = 0.0
        self.max_failures = max_failures
        self.down_seconds = down_seconds

    def is_up(self, now: float) -> bool:
        return self.down_until <= now

    def failed(self) -> None:
        self.failures += 1
        self.failures_total += 1
        if self.failures >= self.max_failures:
            self.down_until = time.monotonic() + self.down_seconds

    def succeeded(self) -> None:
        self.failures = 0
        self.down_until = 0.0

    def mark_down(self, until: float) -> None:
        """An active health check failed: down until ``until`` (monotonic) or the next success."""
        self.down_until = max(self.down_until, until)


class Route:
    """A catalog model and the upstreams that serve it."""

    def __init__(self, model: ModelConfig, server: ServerConfig):
        self.model = model
        self.id = model.id
        self.pricing = model.pricing
        self.reject_chat_params = frozenset(model.reject_chat_params)
        self.endpoints = frozenset(model.endpoints)
        self.upstreams = [Upstream(u, server.upstream_max_failures, server.upstream_down_seconds)
                          for u in model.upstreams]
        self.headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if model.upstream_api_key_env:
            token = os.environ.get(model.upstream_api_key_env)
            if token:
                self.headers["Authorization"] = f"Bearer {token}"
        self._turn = 0
        # Byte patterns for rewriting `model` in streamed chunks without parsing them.
        self.model_bytes = b'"model":' + orjson.dumps(model.id)
        self.upstream_model_bytes = b'"model":' + orjson.dumps(model.upstream_model)

    def candidates(self) -> list[Upstream]:
        """Upstreams not marked down, the least busy first (ties taken in turn)."""
        now = time.monotonic()
        ups = self.upstreams
        if len(ups) == 1:
            return ups if ups[0].is_up(now) else []
        self._turn = (self._turn + 1) % len(ups)
        rotated = ups[self._turn:] + ups[:self._turn]
        return sorted((u for u in rotated if u.is_up(now)), key=lambda u: u.in_flight)

    async def open(self, session: aiohttp.ClientSession, endpoint: str, body: bytes,
                   headers: Mapping[str, str] | None = None) -> tuple[Upstream, aiohttp.ClientResponse]:
        """Send ``body`` (with ``headers`` besides the route's own); the caller must release the
        response and ``upstream.in_flight``."""
        sent = self.headers if not headers else {**headers, **self.headers}
        candidates = self.candidates()
        if not candidates:
            raise no_backend_available(self.id)
        last_problem = "no upstream answered"
        for i, upstream in enumerate(candidates):
            last = i == len(candidates) - 1
            upstream.in_flight += 1
            try:
                # a BytesPayload: aiohttp then skips its search of the payload registry
                resp = await session.post(upstream.urls[endpoint], data=BytesPayload(body), headers=sent)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                upstream.in_flight -= 1
                upstream.failed()
                last_problem = f"{upstream.base_url}: {_describe(exc)}"
                continue
            except BaseException:
                upstream.in_flight -= 1
                raise
            if resp.status in SERVER_DOWN_STATUSES and not last:
                upstream.in_flight -= 1
                upstream.failed()
                last_problem = f"{upstream.base_url} answered HTTP {resp.status}"
                resp.close()
                continue
            if resp.status in SERVER_DOWN_STATUSES:
                upstream.failed()
            else:
                upstream.succeeded()
            return upstream, resp
        raise UpstreamFailure(last_problem, code="upstream_unreachable")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def routes_from(models: tuple[ModelConfig, ...], server: ServerConfig,
                discovered: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, Route]:
    """The catalog's routes, in the config's order. A ``discover = true`` entry gives one route per
    model its upstreams list (``discovered[entry.id]``, the ids as the upstream spells them), its
    ``id`` as their prefix; its ``alias`` serves the first of them, or ``upstream_model`` when the
    upstreams answered no list."""
    routes: dict[str, Route] = {}
    for m in models:
        if not m.discover:
            routes[m.id] = Route(m, server)
            continue
        listed = (discovered or {}).get(m.id, ())
        if m.alias is not None:
            routes[m.alias] = Route(replace(m, id=m.alias, upstream_model=listed[0] if listed else m.upstream_model,
                                            discover=False, alias=None), server)
        for name in listed:
            routes.setdefault(m.id + name, Route(replace(m, id=m.id + name, upstream_model=name, discover=False,
                                                         alias=None), server))
    return routes


def carry_over(old: dict[str, Route], new: dict[str, Route]) -> dict[str, Route]:
    """Give the new routes the running ``Upstream`` objects of unchanged (model, URL) pairs,
    and the health state of a URL another model already knew."""
    by_pair = {(r.id, u.base_url): u for r in old.values() for u in r.upstreams}
    by_url = {u.base_url: u for r in old.values() for u in r.upstreams}
    for route in new.values():
        for i, fresh in enumerate(route.upstreams):
            known = by_pair.get((route.id, fresh.base_url))
            if known is not None:
                known.max_failures, known.down_seconds = fresh.max_failures, fresh.down_seconds
                route.upstreams[i] = known
            elif (other := by_url.get(fresh.base_url)) is not None:
                fresh.failures, fresh.down_until = other.failures, other.down_until
    return dict(new)


def client_session(server: ServerConfig) -> aiohttp.ClientSession:
    """The one upstream session of a gateway: no total timeout (streams can last
    hours), connect and idle limits from the config, no cap on connections."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=server.upstream_connect_timeout,
                                    sock_read=server.upstream_idle_timeout)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, enable_cleanup_closed=False)
    # No cookie jar: a cookie an upstream sets must never ride along on other clients' requests
    # (and matching cookies costs every request a pass through the jar).
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 skip_auto_headers=("User-Agent",), raise_for_status=False,
                                 cookie_jar=aiohttp.DummyCookieJar())
