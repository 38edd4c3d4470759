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

ENDPOINT_PATHS = {"completions": "/completions", "chat/completions": "/chat/completions"}


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

    async def open(self, session: aiohttp.ClientSession, endpoint: str, body: bytes, trace=None,
                   ) -> tuple[Upstream, aiohttp.ClientResponse]:
        """Send ``body``; the caller must release the response and ``upstream.in_flight``.
        ``trace`` (tracing on): told of each attempt, it gives the headers that carry the trace."""
        candidates = self.candidates()
        if not candidates:
            raise no_backend_available(self.id)
        last_problem = "no upstream answered"
        for i, upstream in enumerate(candidates):
            last = i == len(candidates) - 1
            upstream.in_flight += 1
            headers = self.headers if trace is None else trace.attempt(upstream.base_url, self.headers)
            try:
                # a BytesPayload: aiohttp then skips its search of the payload registry
                resp = await session.post(upstream.urls[endpoint], data=BytesPayload(body), headers=headers)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                upstream.in_flight -= 1
                upstream.failed()
                last_problem = f"{upstream.base_url}: {_describe(exc)}"
                if trace is not None:
                    trace.attempt_done(None, type(exc).__name__)
                continue
            except BaseException:
                upstream.in_flight -= 1
                raise
            if trace is not None:
                trace.attempt_done(resp.status)
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


def routes_from(models: tuple[ModelConfig, ...], server: ServerConfig) -> Mapping[str, Route]:
    return {m.id: Route(m, server) for m in models}


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
