"""Replica liveness on the shared store: heartbeats, and reaping the holds of dead replicas.

Every ``interval`` (a third of ``replica_timeout_seconds``, at most 5 s) a
replica upserts its ``kiln_replicas`` row in one statement that also reads
every org's spending (so step 1's credit check sees the other replicas'
charges). Then it runs ``kiln_reap``: the holds of replicas silent for the
timeout become ``replica_lost`` rows (several replicas (docs/reference.md)).

A replica reaps only once it has itself been in touch with the database for
a whole timeout: right after an outage every replica's heartbeat is stale,
and the first one back must not take the others, still reconnecting, for dead.

While the database is out of reach the beat is tried every ``RETRY_SECONDS``,
so that the store is marked reachable again soon after it answers; then the
spool is flushed.
"""

from __future__ import annotations

import asyncio
import logging

from ..tasks import cancelled, woken

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
        self._task: asyncio.Task | None = None
        self._poke = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kilnproxy-heartbeat")

    async def stop(self) -> None:
        self._task = await cancelled(self._task)

    def poke(self) -> None:
        """The store just became unreachable: try again soon rather than at the next interval."""
        self._poke.set()

    async def beat(self) -> None:
        """One heartbeat; marks the store reachable or not. Never raises for an unreachable database."""
        store = self.store
        if not store.available:
            await store.expire_connections()  # after a failure, none of them is to be trusted
        rows = await store.attempt("fetch", BEAT, store.replica)
        if rows is None:
            return
        if self.in_touch_since is None:
            self.in_touch_since = asyncio.get_running_loop().time()
        store._load_spent(rows)
        store.reached()

    async def reap(self) -> None:
        store, lost_before = self.store, self.reaped
        for org, spent, lost in await store.attempt("fetch", "SELECT * FROM kiln_reap($1)",
                                                    store.timeout) or ():
            store.credits.spent[org] = spent
            self.reaped += lost
            log.warning("%d requests of org %s were in flight on a replica silent for %g s: recorded as"
                        " replica_lost", lost, org, store.timeout)
        if lost_before != self.reaped:
            await store.tell_reaped()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await woken(self._poke, self.interval if self.store.available else RETRY_SECONDS)
            self._poke.clear()
            try:
                await self.beat()
                if not self.store.available:
                    continue
                if self.store.spooled:
                    await self.store.flush_spool()
                if loop.time() - self.in_touch_since >= self.store.timeout:
                    await self.reap()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the heartbeat: the replica would be taken for dead
                log.exception("heartbeat failed")
