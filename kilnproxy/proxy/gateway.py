"""``Gateway``: everything one running gateway holds, built once at start-up.

It owns the upstream client (and an aiohttp session for health checks,
discovery and plugins), the ledger, the in-flight counts, credits, routes and
hooks, and it is what ``startup``/``shutdown`` plugins receive.
The request path reaches it as ``request.app[GATEWAY]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Mapping, Protocol

import aiohttp
import pluggy
from aiohttp import web

from ..config import Config, KeyConfig
from ..errors import PluginError
from ..call import Call, seal
from ..plugins.manager import Hooks, being_cancelled, call_maybe_async
from ..store.ledger import Ledger
from ..store.limits import Admission, Credits, LocalAdmission
from ..store.sqlite.ledger import SQLiteLedger
from ..store.tenancy.orgs_keys import TenancyStore
from ..store.tenancy.sql import PostgresDb, SQLiteDb
from .tenancy.auth import KeyRing
from .tenancy.batch_credential import BatchCredential
from .request_observers import RequestTrace, Tap
from .request_record import RequestRecord
from .tenancy.key_ring import DEFAULT_SHARE, Tenants, org_shares
from .upstream.routes import Route, client_session, routes_from
from .upstream.client import UpstreamClient
from .upstream.fair_queue import Claim
from .upstream.responses import UpstreamResponse
from .upstream.token_counts import UpstreamTokens

log = logging.getLogger("kilnproxy")


# What the gateway is handed by the parts above the proxy, and calls (each ``None`` or empty when its part is
# off); what a request's record carries for them (its tap, its trace) is in ``request_observers``.

class Capture(Protocol):
    """``Gateway.capture``: the inspector's capture (``[inspector] capture``), a ``Tap`` for each request."""

    def tap(self, record: RequestRecord, body: dict) -> Tap:
        """The request's tap, given the client's body as parsed (before any rule or plugin touched it)."""


class Tracer(Protocol):
    """``Gateway.tracer``: the tracing (``[tracing]``)."""

    def begin(self, headers: Mapping[str, str], endpoint: str, call: Call) -> RequestTrace:
        """The request's trace, a child of the client's ``traceparent`` when it sent a valid one."""

    def link(self, generation_id: str) -> dict | None:
        """A recent request's trace id and URL, for the inspector (None when it is not known)."""


class RowObserver(Protocol):
    """An entry of ``Gateway.row_observers`` (the metrics, the access log): told of each request's row
    where it is built, with its record. What it raises is logged; it must not block."""

    def __call__(self, row: dict, record: RequestRecord) -> None: ...


class CommitListener(Protocol):
    """An entry of ``Gateway.commit_listeners`` (the inspector's live feed): told of each batch of rows the
    store committed, as ``(row, call)`` pairs, on the store's commit; it must not block or raise."""

    def __call__(self, rows: list[tuple[dict, Call]]) -> None: ...


class Gateway:
    def __init__(self, config: Config, pm: pluggy.PluginManager, ledger: Ledger | None = None,
                 admission: Admission | None = None):
        self.config = config
        self.pm = pm
        self.hooks = Hooks(pm)
        self.routes: dict[str, Route] = dict(routes_from(config.models, config.server))
        self.discovered: dict[str, tuple[str, ...]] = {}  # discover = true entries: their upstreams' models
        self.keys = KeyRing(config.keys)
        self.batch_credential = BatchCredential()  # the Batch API runner's (kilnproxy.batches)
        self.disabled_orgs: frozenset[str] = frozenset()
        self.per_minute: dict[str, tuple[int | None, int | None]] = {}  # org -> (requests, tokens) per minute
        self.org_limits = {o.id: o.max_in_flight or config.limits.max_in_flight_per_org for o in config.orgs}
        # org -> (priority, weight) for the queues of upstream slots (SPEC 14), the orgs with other than the defaults
        self.shares: dict[str, tuple[str, float]] = org_shares(config.orgs)
        self.credits = Credits({o.id: o.credits for o in config.orgs}, {})
        if ledger is None and config.storage.url:
            from ..store.postgres.store import PostgresStore  # asyncpg is imported only when PostgreSQL is configured
            ledger = admission = PostgresStore(config, self.credits, on_commit=self._committed)
        self.ledger: Ledger = ledger or SQLiteLedger(config.db_path, on_commit=self._committed,
                                                   inspector_tables=config.inspector.enabled)
        self.admission: Admission = admission or LocalAdmission(self.credits)
        self._settled = self.admission.settled  # see Admission.settled
        self.session: aiohttp.ClientSession | None = None  # off the request path: health checks, discovery, plugins
        self.upstream_client: UpstreamClient | None = None  # the model requests (kilnproxy.proxy.upstream.client)
        self.tenancy: TenancyStore | None = None  # orgs, keys and grants made at runtime, once started
        self.tenants: Tenants | None = None
        self.started_at = int(time.time())
        # Called with (row, record) once per request, where its row is built (metrics, access log).
        self.row_observers: tuple[RowObserver, ...] = ()
        # Upstream responses being relayed, so a shutdown can end them (kilnproxy.ops.lifecycle).
        self.open_upstreams: set[UpstreamResponse] = set()
        self.capture: Capture | None = None  # the inspector's CaptureRing when [inspector] capture is on
        # kilnproxy.ops.tracing.install's Tracing when [tracing] is on: ``begin`` a request's trace,
        # ``link(generation_id)`` its trace id and URL for the inspector (or None)
        self.tracer: Tracer | None = None
        self.draining = False  # set by a graceful shutdown (kilnproxy.ops.lifecycle): /healthz?ready is 503
        self.commit_listeners: list[CommitListener] = []  # called with each committed batch; must not block or raise
        self.fallback_counts: dict[tuple[str, str], int] = {}  # (requested model, fallback) -> requests sent
        # prompt and cached tokens by (model, upstream), from each row: /metrics and the inspector read them
        self.upstream_tokens = UpstreamTokens()
        # called (no argument) after ``routes`` is replaced (a reload, model discovery): the load reads re-watch
        self.route_listeners: list[Callable[[], None]] = []
        self._usage_queue: asyncio.Queue | None = None
        self._usage_task: asyncio.Task | None = None
        # the event loop it serves on, once started: asyncio.get_running_loop() makes a getpid system call
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- life cycle -----------------------------------------------------------

    async def start(self) -> None:
        """Open the stores and run the ``startup`` hooks. Whatever a ``startup`` raises (``BaseException``
        included, but not the cancellation of this task) stops the gateway and becomes a ``PluginError``."""
        self.loop = asyncio.get_running_loop()
        await self.ledger.open()
        self.credits.load(await self.ledger.spent_by_org())
        await self._open_tenancy()
        self.session = client_session(self.config.server)
        self.upstream_client = UpstreamClient(self.config.server)
        if self.hooks.record_usage:
            self._usage_queue = asyncio.Queue()
            self._usage_task = asyncio.create_task(self._notify_usage(), name="kilnproxy-record-usage")
        for i, impl in enumerate(self.hooks.startup):
            try:
                await call_maybe_async(impl, {"gateway": self})
            except BaseException as exc:
                if being_cancelled(exc):
                    raise
                await self.stop(not_started={later.plugin for later in self.hooks.startup[i:]})
                raise PluginError(impl.plugin, f"startup failed: {type(exc).__name__}: {exc}") from None

    async def _open_tenancy(self) -> None:
        """The runtime orgs and keys, on the ledger's own database (its pool, or the same file)."""
        pool = self.ledger.pool
        if pool is not None:
            db = PostgresDb(pool, timeout=self.ledger.STATEMENT_TIMEOUT)
        else:
            db = SQLiteDb(self.config.db_path)
            await db.open()
            file_users = self.ledger.file_users
            if file_users is not None:  # closed and opened again with the ledger's if its files are deleted
                file_users.append(db)
        self.tenancy = TenancyStore(db)
        self.tenants = Tenants(self, self.tenancy, self.config.storage.url if pool is not None else None)
        try:
            await self.tenants.open()
        except BaseException:
            await self._close_tenancy()
            await self.ledger.close()
            raise

    async def _close_tenancy(self) -> None:
        if self.tenants is not None:
            await self.tenants.close()
        if self.tenancy is not None:
            file_users = self.ledger.file_users
            if file_users is not None and self.tenancy.db in file_users:
                file_users.remove(self.tenancy.db)
            await self.tenancy.db.close()
        self.tenants = self.tenancy = None

    async def stop(self, not_started: frozenset[str] | set[str] = frozenset()) -> None:
        await self._close_tenancy()
        await self.ledger.close()
        if self._usage_task is not None:
            await self._usage_queue.put(None)
            await self._usage_task
            self._usage_task = None
        for impl in self.hooks.shutdown:
            if impl.plugin in not_started:
                continue
            try:
                await call_maybe_async(impl, {"gateway": self})
            except Exception:
                log.exception("plugin %r failed in shutdown", impl.plugin)
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.upstream_client is not None:
            self.upstream_client.close()
            self.upstream_client = None

    def routes_replaced(self) -> None:
        """``routes`` was just replaced: tell the ``route_listeners``."""
        for listener in self.route_listeners:
            listener()

    def refuse_upstream_requests(self, error: Callable[[], Exception]) -> None:
        """The gateway is stopping: requests still waiting for an upstream slot or for an upstream's
        response head, and every request that would send one from now on, get ``error()``."""
        if self.upstream_client is not None:
            self.upstream_client.refuse(error)
        for route in self.routes.values():
            for upstream in route.upstreams:
                upstream.slots.refuse(error)

    def plugin_settings(self, name: str) -> Mapping[str, Any]:
        """The ``[plugins.settings.<name>]`` table (empty when absent)."""
        return self.config.plugins.settings.get(name, {})

    async def spent(self, org: str) -> float:
        """The org's spending as the store has it: with a shared store, every replica's rows."""
        spent = await self.ledger.org_spent(org)
        return self.credits.spent.get(org, 0.0) if spent is None else spent

    def limit_for(self, org: str) -> int:
        return self.org_limits.get(org, self.config.limits.max_in_flight_per_org)

    def claim_of(self, key: KeyConfig) -> Claim:
        """A request's place in the queues for upstream slots (SPEC 14): its org; the key's own ``priority``
        and ``weight``, else its org's. A key whose ``priority`` is ``"batch"`` runs at batch priority: the
        Batch API's runner authenticates its lines as ``dataclasses.replace(key, priority="batch")``."""
        priority, weight = self.shares.get(key.org, DEFAULT_SHARE)
        if key.priority is not None:
            priority = key.priority
        if key.weight is not None:
            weight = key.weight
        return Claim(key.org, weight, priority == "batch")

    # -- usage ------------------------------------------------------------------

    def submit(self, record: RequestRecord) -> asyncio.Future:
        """Queue the request's row (once) and charge its org; safe to call while cancelled."""
        if not record.submitted:
            record.submitted = True
            row = record.row()
            self.credits.charge(row["org"], row["cost"])
            self._settled(record.hold, row)
            record.committed = self.ledger.submit(row, record.call)
            if record.trace is not None:
                record.trace.end(row, record.committed)
            if record.hold is not None:  # after the row is queued: a shared store frees both in one commit
                self.admission.release(record.hold)
                record.hold = None
            upstream = row["upstream"]
            if upstream is not None and record.call.model:
                self.upstream_tokens.count(record.call.model, upstream, row["prompt_tokens"], row["cached_tokens"])
            for observe in self.row_observers:
                try:
                    observe(row, record)
                except Exception:
                    log.exception("row observer %r failed for %s", observe, row["id"])
        return record.committed

    def _committed(self, rows: list[tuple[dict, Call]]) -> None:
        for listener in self.commit_listeners:
            listener(rows)
        if self._usage_queue is not None:
            for row, call in rows:
                self._usage_queue.put_nowait((call, row))

    async def _notify_usage(self) -> None:
        """Each committed row to every ``record_usage`` plugin, in order. Whatever a plugin raises
        (``BaseException`` included) is logged, and the next plugin and the next row still run; only
        the task's own cancellation ends it."""
        while (item := await self._usage_queue.get()) is not None:
            call, row = item
            seal(call)  # a request refused before its request hooks: its call was never sealed
            kwargs = {"call": call, "usage": _ReadOnlyRow(row)}
            for impl in self.hooks.record_usage:
                try:
                    await call_maybe_async(impl, kwargs)
                except BaseException as exc:
                    if being_cancelled(exc):
                        raise
                    log.error("plugin %r failed in record_usage for %s", impl.plugin, row["id"], exc_info=exc)
            self._usage_queue.task_done()

    async def rows_committed(self) -> None:
        """Return once the row of every response ended so far is committed: a lone row's commit follows
        its response (the row journal, ``kilnproxy.store.row_journal``)."""
        journaled = self.ledger.journaled
        if journaled:
            await asyncio.wait(list(journaled.values()))

    async def usage_recorded(self) -> None:
        """Return once the row of every response ended so far has been through ``record_usage``."""
        await self.rows_committed()
        if self._usage_queue is not None:
            await self._usage_queue.join()


GATEWAY = web.AppKey("gateway", Gateway)  # the app's Gateway: ``request.app[GATEWAY]``


class _ReadOnlyRow(dict):
    """A usage row handed to plugins: reading works as for a dict, writing raises."""

    def _readonly(self, *args, **kwargs):
        raise TypeError("the usage row is read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _readonly
