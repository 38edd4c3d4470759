"""Replica liveness on the shared store: heartbeats, and reaping the holds of dead replicas.

Every ``interval`` (a third of ``replica_timeout_seconds``, at most 5 s) a
replica upserts its ``kiln_replicas`` row in one statement that also reads
every org's spending (so step 1's credit check sees the other replicas'
charges). Then it runs ``kiln_reap``: the holds of replicas silent for the
timeout become ``replica_lost`` rows (several replicas (docs/reference.md)).

A replica reaps only once it has itself been in touch with the database for
a whole timeout: right after an outage every replica's heartbeat is stale,
and the first one back must not take the others, still reconnecting, for dead.
A reap that PostgreSQL ends for a deadlock (with a settlement, or another
replica's reap) or a lock held past the lock timeout (an org's row locked by
another session) is tried again at the next beat: one log line, not the
store down, nor a traceback.

While the store is down the beat is tried every ``RETRY_SECONDS``, on new
connections (the old ones may keep a session's state, such as read-only); the
store is up again once the beat passes and, if rows are spooled, the first
batch of them is settled: a database that answers but still refuses rows (a
lock, read-only) keeps it down rather than make it flap. Then the rest of the
spool is flushed, by a task of its own: thousands of rows spooled through an
outage take seconds to settle, and a heartbeat that waited for them would make
its replica look dead to the others (its requests in flight reaped).
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from ...tasks import cancelled, woken

log = logging.getLogger("kilnproxy.replicas")

RETRY_SECONDS = 0.5

BEAT = """
WITH beat AS (
    INSERT INTO kiln_replicas (id) VALUES ($1) ON CONFLICT (id) DO UPDATE SET seen_at = now()
)
SELECT org, spent FROM kiln_orgs
"""


class Heartbeat:
    def __init__(self, store):  # the PostgresStore whose liveness this keeps
        self.store = store
        self.interval = min(store.timeout / 3, 5.0)
        self.in_touch_since: float | None = None  # loop time of the first beat since the last failure
        self.reaped = 0
        self.reap_failed: str | None = None  # why the last reap failed (deadlock, lock), said once
        self._task: asyncio.Task | None = None
        self._flush: asyncio.Task | None = None
        self._poke = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kilnproxy-heartbeat")

    async def stop(self) -> None:
        self._task = await cancelled(self._task)
        self._flush = await cancelled(self._flush)  # what it settled is settled; the rest stays spooled

    def poke(self) -> None:
        """The store just became unreachable: try again soon rather than at the next interval."""
        self._poke.set()

    async def beat(self) -> None:
        """One heartbeat; marks the store up or down. Never raises for a store that is down."""
        store = self.store
        if not store.available:
            await store.expire_connections()  # after a failure, none of them is to be trusted
        rows = await store.attempt("fetch", BEAT, store.replica)
        if rows is None:
            return
        if self.in_touch_since is None:
            self.in_touch_since = asyncio.get_running_loop().time()
        store.load_spent(rows)
        if not store.available and store.spooled and not await store.flush_spool(batches=1):
            return  # the database answers, but does not take rows yet
        store.reached()

    async def reap(self) -> None:
        store, lost_before = self.store, self.reaped
        try:
            reaped = await store.run("fetch", "SELECT * FROM kiln_reap($1)", store.timeout)
        except (asyncpg.DeadlockDetectedError, asyncpg.LockNotAvailableError) as exc:
            if self.reap_failed != type(exc).__name__:
                self.reap_failed = type(exc).__name__
                log.warning("reaping the requests of silent replicas failed (%s: %s); tried again at each "
                            "heartbeat", type(exc).__name__, str(exc).splitlines()[0])
            return
        except (*store.UNREACHABLE, asyncpg.PostgresError) as exc:
            if not store.lost(exc):
                raise
            return
        if self.reap_failed is not None:
            self.reap_failed = None
            log.warning("reaping the requests of silent replicas passes again")
        for org, spent, lost in reaped:
            store.credits.spent[org] = spent
            self.reaped += lost
            log.warning("%d requests of org %s were in flight on a replica silent for %g s: recorded as"
                        " replica_lost", lost, org, store.timeout)
        if lost_before != self.reaped:
            await store.tell_reaped()

    async def _flush_spool(self) -> None:
        try:
            await self.store.flush_spool()
        except Exception:  # a bug: the next beat tries again
            log.exception("flushing the spool failed")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await woken(self._poke, self.interval if self.store.available else RETRY_SECONDS)
            self._poke.clear()
            self.store.journal.check()
            try:
                await self.beat()
                if not self.store.available:
                    continue
                if self.store.spooled and (self._flush is None or self._flush.done()):
                    self._flush = asyncio.create_task(self._flush_spool(), name="kilnproxy-spool-flush")
                if self.in_touch_since is not None and loop.time() - self.in_touch_since >= self.store.timeout:
                    await self.reap()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the heartbeat: the replica would be taken for dead
                log.exception("heartbeat failed")
