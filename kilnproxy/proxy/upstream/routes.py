"""Reaching a model's upstreams: routing, slots, failover and marking down (docs/reference.md).

``Route`` holds what the request path needs to know of one catalog model.
``Route.candidates(key)`` is a request's order of the upstreams not marked
down, by the model's ``routing`` (SPEC 13): ``least_busy``, the least loaded
first (an upstream's load: ``SlotPool.load_at``, this process's requests or the
server's own count as last read, over its cap); ``round_robin``, in turn;
``cache_aware``, the order of the request's affinity key
(``kilnproxy.proxy.upstream.affinity``: the key's rendezvous order, those
below the load bound first), or ``least_busy`` for a request without a key
(embeddings, token counts). The policy is bound once per route.
``Route.open(...)`` takes a slot on the first upstream in that order with a
free one (waiting up to the model's ``queue_timeout`` when every slot is
busy, ``kilnproxy.proxy.upstream.slots``), sends the body with the gateway's
``UpstreamClient`` (``kilnproxy.proxy.upstream.client``) and returns the
``UpstreamResponse`` once its status line and headers have arrived (and,
with a ``first_byte_timeout``, a stream's first bytes). An upstream that
refuses the connection, times out, misses its first byte, answers bytes that
are not HTTP (a status line httptools refuses: ``upstream_bad_response``), or
answers 429 or 5xx before sending anything is skipped and the next one tried;
refusals, timeouts, answers that are not HTTP and 502/503/504 count toward
marking it down. Nothing has reached the client yet, so this is safe. Every
other status, and the last upstream's 429 or 5xx, comes back to the caller as
it is; when no upstream is left, the last one's failure is raised.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from typing import Mapping

import aiohttp
import orjson

from ...config import ModelConfig, ServerConfig
from ...config_types import default_batch_reserve
from ...errors import GatewayError, UpstreamFailure, no_backend_available
from .affinity import Rendezvous, choose
from .deadlines import first_byte_missed
from .client import RequestTarget, UpstreamClient
from .connections import UpstreamBadResponse
from .responses import UpstreamResponse
from ..request_observers import RequestTrace
from ..request_record import RequestRecord
from .fair_queue import INTERACTIVE, Claim
from .slots import NoUpstreamUp, SlotPool, UpstreamBusy, anyone_waiting, take_slot, upstream_busy

# Statuses that say the server, not the request, is in trouble: skip to the next replica and count
# toward marking it down. A plain 500 is often caused by the request itself (llama.cpp answers 500
# for a grammar that dead-ends), so it fails that request only and says nothing of the server's health.
SERVER_DOWN_STATUSES = frozenset((502, 503, 504))



def cannot_take(status: int) -> bool:
    """An answer that says this server cannot take the request now: another one may."""
    return status == 429 or status >= 500


ENDPOINT_PATHS = {"completions": "/completions", "chat/completions": "/chat/completions",
                  "embeddings": "/embeddings", "responses": "/responses", "messages": "/messages",
                  "messages/count_tokens": "/messages/count_tokens"}


class Upstream:
    """One replica: a base URL and its health."""

    __slots__ = ("base_url", "urls", "in_flight", "failures", "failures_total", "down_until", "checked_down_until",
                 "max_failures", "down_seconds", "slots")

    def __init__(self, base_url: str, max_failures: int, down_seconds: float, slots: SlotPool | None = None):
        self.base_url = base_url
        self.slots = slots or SlotPool(base_url, None)  # shared by every model that lists the URL
        self.urls = {ep: base_url + path for ep, path in ENDPOINT_PATHS.items()}
        self.in_flight = 0
        self.failures = 0
        self.failures_total = 0  # every failure ever, for /metrics
        self.down_until = 0.0  # the later of the requests' marking-down and the health checks'
        self.checked_down_until = 0.0  # a failed health check's: only a check that succeeds lifts it
        self.max_failures = max_failures
        self.down_seconds = down_seconds

    def is_up(self, now: float) -> bool:
        return self.down_until <= now

    def failed(self) -> None:
        self.failures += 1
        self.failures_total += 1
        if self.failures >= self.max_failures:
            self.down_until = max(time.monotonic() + self.down_seconds, self.checked_down_until)
            if self.slots.waiters:
                self.slots.marked_down()

    def succeeded(self) -> None:
        """A request's answer: the requests' failures are forgotten (not a failed health check's mark)."""
        self.failures = 0
        if self.down_until:  # it was marked down: the requests waiting for its model's other upstreams may come
            checked = self.checked_down_until
            self.down_until = checked if checked > time.monotonic() else 0.0
            if not self.down_until and anyone_waiting():
                self.slots.came_up()

    def check_passed(self) -> None:
        """A health check succeeded: up, whatever marked it down."""
        self.checked_down_until = 0.0
        self.succeeded()

    def release(self) -> None:
        """The request sent here has ended: its slot is free again."""
        self.in_flight -= 1
        self.slots.give_back()

    def mark_down(self, until: float) -> None:
        """An active health check failed: down until ``until`` (monotonic) or the next check that succeeds."""
        self.checked_down_until = max(self.checked_down_until, until)
        self.down_until = max(self.down_until, until)
        if self.slots.waiters:
            self.slots.marked_down()


class Route:
    """A catalog model and the upstreams that serve it."""

    def __init__(self, model: ModelConfig, server: ServerConfig, pools: dict[str, SlotPool] | None = None):
        self.model = model
        self.id = model.id
        self.pricing = model.pricing
        self.reject_chat_params = frozenset(model.reject_chat_params)
        self.endpoints = frozenset(model.endpoints)
        pools = {} if pools is None else pools
        self.upstreams = [Upstream(u, server.upstream_max_failures, server.upstream_down_seconds,
                                   pools.setdefault(u, SlotPool(u, model.max_in_flight_of(i),
                                                                model.batch_reserve_of(i))))
                          for i, u in enumerate(model.upstreams)]
        self.headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if model.upstream_api_key_env:
            token = os.environ.get(model.upstream_api_key_env)
            if token:
                self.headers["Authorization"] = f"Bearer {token}"
        self._turn = 0
        self._usable = self.usable  # bound once: passed to every wait for a slot
        self.routing = model.routing
        self.slack = model.cache_aware_slack
        self.rendezvous = Rendezvous(model.upstreams) if model.routing == "cache_aware" else None
        # the policy, bound once (see ``candidates``): (key) -> the upstreams up, in the order they are tried
        self.candidates = self._single if len(self.upstreams) == 1 else {
            "cache_aware": self._cache_aware, "round_robin": self._round_robin}.get(model.routing, self._least_busy)
        self._targets: dict[tuple[str, str], RequestTarget] = {}  # (base URL, endpoint) -> its request head
        # Byte patterns for rewriting `model` in streamed chunks without parsing them.
        self.model_bytes = b'"model":' + orjson.dumps(model.id)
        self.upstream_model_bytes = b'"model":' + orjson.dumps(model.upstream_model)

    def serves(self, endpoint: str) -> bool:
        return endpoint in self.endpoints

    def candidates(self, key: int | None = None) -> list[Upstream]:
        """Upstreams not marked down, in the order a request is to try them (its routing's; ``key``:
        its affinity key, ``cache_aware`` only). Loads count every model's requests to the same URL
        (its slots), and the server's own count when read lately. (Each route binds one of the methods
        below in its place at construction.)"""
        raise NotImplementedError

    def _single(self, key: int | None = None) -> list[Upstream]:
        """The one upstream, when it is up."""
        ups = self.upstreams
        return ups if ups[0].is_up(time.monotonic()) else []

    def _least_busy(self, key: int | None = None) -> list[Upstream]:
        """The least loaded first (ties taken in turn)."""
        now = time.monotonic()
        ups = self.upstreams
        self._turn = (self._turn + 1) % len(ups)
        rotated = ups[self._turn:] + ups[:self._turn]
        return sorted((u for u in rotated if u.is_up(now)), key=lambda u: u.slots.share_at(now))

    def _round_robin(self, key: int | None = None) -> list[Upstream]:
        """In turn: the next upstream up, then the others after it."""
        now = time.monotonic()
        ups = self.upstreams
        self._turn = (self._turn + 1) % len(ups)
        return [u for u in ups[self._turn:] + ups[:self._turn] if u.is_up(now)]

    def _cache_aware(self, key: int | None = None) -> list[Upstream]:
        """The key's order: those below the load bound, then the others (``affinity.choose``); no key:
        least busy."""
        if key is None:
            return self._least_busy(key)
        now = time.monotonic()
        ups = self.upstreams
        up = [u.is_up(now) for u in ups]
        loads = [u.slots.load_at(now) for u in ups]
        return [ups[i] for i in choose(self.rendezvous.order(key), up, loads, self.slack)]

    def usable(self, pool: SlotPool) -> bool:
        """Whether a request of this model waiting for a slot of ``pool`` may still be sent there."""
        now = time.monotonic()
        return any(u.slots is pool and u.is_up(now) for u in self.upstreams)

    async def open(self, client: UpstreamClient, endpoint: str, body: bytes, stream: bool = False,
                   queue_deadline: float | None = None, headers: Mapping[str, str] | None = None,
                   trace: RequestTrace | None = None, elsewhere: int | None = None, record: RequestRecord | None = None,
                   key: int | None = None, claim: Claim = INTERACTIVE) -> tuple[Upstream, UpstreamResponse, bytes | None]:
        """Send ``body`` (with ``headers`` besides the route's own, which win) on a slot of one of the
        upstreams; returns the upstream, its response and, when the model has a ``first_byte_timeout``
        and the answer is a stream, its first bytes (else None). The caller must release the response
        and call ``upstream.release()``. ``trace`` (tracing on): told of each attempt, it gives the
        headers that carry the trace. ``elsewhere``: a status that, like a 429 or 5xx, sends the request on
        to another upstream of the model (a Responses follow-up's 404: this one does not hold the response).
        ``record`` (a ``RequestRecord``): its ``sent`` is true while the body is with an upstream whose
        answer is awaited or returned (not one given up on). ``key``: the request's affinity key
        (``cache_aware``), the same for each attempt, so a failed one moves on along the key's order. ``claim``:
        the request's org, weight and priority, its place in a queue for slots (``fair_queue``)."""
        tried: list[Upstream] = []
        problem: Exception | None = None
        while True:
            candidates = [u for u in self.candidates(key) if u not in tried] if tried else self.candidates(key)
            if not candidates:
                raise problem or no_backend_available(self.id)
            pool = candidates[0].slots if len(candidates) == 1 else None
            if pool is not None and pool.refusal is None and pool.open_to(claim):  # what take_slot does first, in line
                pool.take()
            else:
                try:
                    pool = await take_slot([u.slots for u in candidates], queue_deadline, self._usable, claim)
                except UpstreamBusy:
                    raise problem or upstream_busy(self.id, self.model.queue_timeout) from None
                except NoUpstreamUp:  # each marked down while it waited: no_backend_available, unless one is back
                    continue
            # (one of the candidates, or an upstream found up again while the request waited)
            upstream = self.upstreams[0] if len(self.upstreams) == 1 else next(
                u for u in self.upstreams if u.slots is pool)
            tried.append(upstream)
            upstream.in_flight += 1
            extra = headers if trace is None else trace.attempt(upstream.base_url, headers or {})
            if record is not None:
                record.sent = True
            try:
                target = self._target(upstream, endpoint)
                if self.model.first_byte_timeout is None:
                    resp, first = await client.post(target, extra, body), None
                else:
                    resp, first = await self._attempt(client, target, body, stream, extra)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, GatewayError) as exc:
                upstream.failed()  # before the slot is given back: a waiter is not handed a server now down
                upstream.release()
                if record is not None:
                    record.sent = False  # given up on: the next upstream, if any, is sent it again
                if trace is not None:
                    trace.attempt_done(None, type(exc).__name__)
                problem = exc if isinstance(exc, GatewayError) else UpstreamFailure(
                    f"{upstream.base_url}: {_describe(exc)}", code=_failure_code(exc))
                continue
            except BaseException:
                upstream.release()
                raise
            if trace is not None:
                trace.attempt_done(resp.status)
            status = resp.status
            if status in SERVER_DOWN_STATUSES:
                upstream.failed()
            elif status < 500:
                upstream.succeeded()
            if not (cannot_take(status) or status == elsewhere) or not any(u not in tried for u in self.candidates(key)):
                return upstream, resp, first
            upstream.release()
            resp.close()
            if record is not None:
                record.sent = False
            problem = UpstreamFailure(f"{upstream.base_url} answered HTTP {status}")

    async def send(self, client: UpstreamClient, endpoint: str, body: bytes,
                   headers: Mapping[str, str] | None = None) -> tuple[Upstream, UpstreamResponse]:
        """``body`` to the least busy upstream not marked down (whatever the routing), taking none of its slots: a request that
        uses none of a server's generation slots (``max_in_flight``), such as a token count, is not held
        up by them, nor counted in them. The next upstream is tried when one cannot be reached; the caller
        releases the response (there is no slot to give back). Raises 503 ``no_backend_available`` or the
        last ``UpstreamFailure``."""
        problem: UpstreamFailure | None = None
        for upstream in self._single() if len(self.upstreams) == 1 else self._least_busy():
            try:
                return upstream, await client.post(self._target(upstream, endpoint), headers, body)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                problem = UpstreamFailure(f"{upstream.base_url}: {_describe(exc)}", code=_failure_code(exc))
        raise problem or no_backend_available(self.id)

    def _target(self, upstream: Upstream, endpoint: str) -> RequestTarget:
        """The request head for ``endpoint`` on ``upstream``, built at its first use."""
        key = (upstream.base_url, endpoint)
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = RequestTarget(upstream.urls[endpoint], self.headers)
        return target

    async def _attempt(self, client: UpstreamClient, target: RequestTarget, body: bytes, stream: bool,
                       headers: Mapping[str, str] | None) -> tuple[UpstreamResponse, bytes | None]:
        """A POST within the model's ``first_byte_timeout`` (and a stream's first bytes read in it)."""
        seconds = self.model.first_byte_timeout
        deadline = asyncio.timeout(seconds)
        try:
            async with deadline:
                resp = await client.post(target, headers, body)
                try:
                    if stream and resp.status == 200:
                        return resp, await resp.content.readany()
                except BaseException:
                    resp.close()
                    raise
                return resp, None
        except TimeoutError:
            if deadline.expired():
                raise first_byte_missed(self.id, seconds) from None
            raise


def _failure_code(exc: BaseException) -> str:
    """An upstream that answered bytes that are not HTTP reached a server that is broken, not one out
    of reach: ``upstream_bad_response``; every other failure before the answer is ``upstream_unreachable``."""
    return "upstream_bad_response" if isinstance(exc, UpstreamBadResponse) else "upstream_unreachable"


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
    pools: dict[str, SlotPool] = {}  # models listing the same upstream URL share its slots
    reserves = {u: r for m in models for i, u in enumerate(m.upstreams) if (r := m.batch_reserve_given(i)) is not None}
    for m in models:  # the cap is the URL's, whichever model gives it (config refuses two different caps)
        for i, u in enumerate(m.upstreams):
            if (limit := m.max_in_flight_of(i)) is not None:  # batch_reserve too: the one given, else the default
                pools.setdefault(u, SlotPool(u, limit, reserves.get(u, default_batch_reserve(limit))))
    for m in models:
        if not m.discover:
            routes[m.id] = Route(m, server, pools)
            continue
        listed = (discovered or {}).get(m.id, ())
        if m.alias is not None:
            routes[m.alias] = Route(replace(m, id=m.alias, upstream_model=listed[0] if listed else m.upstream_model,
                                            discover=False, alias=None), server, pools)
        for name in listed:
            routes.setdefault(m.id + name, Route(replace(m, id=m.id + name, upstream_model=name, discover=False,
                                                         alias=None), server, pools))
    return routes


def carry_over(old: dict[str, Route], new: dict[str, Route]) -> dict[str, Route]:
    """Give the new routes the running ``Upstream`` objects of unchanged (model, URL) pairs,
    the health state of a URL another model already knew, and each known URL's slots (with
    their queue) at the new ``max_in_flight``."""
    by_pair = {(r.id, u.base_url): u for r in old.values() for u in r.upstreams}
    by_url = {u.base_url: u for r in old.values() for u in r.upstreams}
    for route in new.values():
        for i, fresh in enumerate(route.upstreams):
            if (other := by_url.get(fresh.base_url)) is not None and fresh.slots is not other.slots:
                other.slots.set_limit(fresh.slots.limit, fresh.slots.reserve)
                fresh.slots = other.slots
            known = by_pair.get((route.id, fresh.base_url))
            if known is not None:
                known.max_failures, known.down_seconds = fresh.max_failures, fresh.down_seconds
                known.slots = fresh.slots
                route.upstreams[i] = known
            elif (other := by_url.get(fresh.base_url)) is not None:
                fresh.failures, fresh.down_until = other.failures, other.down_until
                fresh.checked_down_until = other.checked_down_until
    return dict(new)


def client_session(server: ServerConfig) -> aiohttp.ClientSession:
    """The gateway's aiohttp session for what is off the request path (health checks, model
    discovery, plugins): no total timeout, connect and idle limits from the config, no cap on
    connections. Model requests go through ``UpstreamClient``."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=server.upstream_connect_timeout,
                                    sock_read=server.upstream_idle_timeout)
    # Idle pooled connections are closed before the model servers close them (vLLM: 5 s), so a request
    # never goes out on a connection the server is closing at that moment.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, enable_cleanup_closed=False,
                                     keepalive_timeout=server.upstream_keepalive_timeout)
    # No cookie jar: a cookie an upstream sets must never ride along on other clients' requests
    # (and matching cookies costs every request a pass through the jar).
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 skip_auto_headers=("User-Agent",), raise_for_status=False,
                                 cookie_jar=aiohttp.DummyCookieJar())
