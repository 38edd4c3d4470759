"""The live feed across replicas (PostgreSQL): the rows other replicas commit, into this one's hub.

Each settlement of a replica whose inspector is on sends, in its own
transaction, ``NOTIFY kiln_rows`` with its rows' generation ids (``"<replica>
<id> <id> ..."``, split to stay under PostgreSQL's 8000-byte payload limit;
``PostgresStore.tell_rows``). PostgreSQL delivers a notification at its
transaction's commit and only if it commits, to every listening session, in
commit order. ``ReplicaFeed`` listens on a connection of its own, skips its
own replica's notices (those rows reach the hub from the ledger's writer), and
reads the others' rows by id (primary-key lookups through the store's pool),
at most ``MAX_IDS`` per query; ids that come while a read runs wait for the
next one, so a burst costs few queries. Nothing is read while no page listens.

Why ids and not "rows past the last rowid seen": ``rowid`` is an identity
drawn at insert, not at commit, so of two replicas' settlements the one with
the smaller rowids may commit last and a reader past the larger would skip
it for good; a row that replaces a ``replica_lost`` row keeps its rowid.

Notifications are lost only while the listening connection is down. So the
connection is checked every ``PING_SECONDS`` (a query with a deadline: a
half-open TCP connection is noticed too); after a loss it reconnects, and
every subscriber is told ``reset``, which makes the page reload its list
from the store, where every committed row is. A read that fails does the
same. Rows reaped as ``replica_lost`` (``"<replica> *"``, sent after the reap)
also ask every page, this replica's included, to reload.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..store.inspector_tables import SELECT_COLUMNS
from ..store.postgres.settlement import ROWS_CHANNEL
from ..tasks import cancelled, woken
from .hub import LiveHub

log = logging.getLogger("kilnproxy.inspector")

PING_SECONDS = 5.0
CONNECT_TIMEOUT = 5.0
RETRY_SECONDS = 1.0
MAX_IDS = 500  # ids per read
MAX_PENDING = 10_000  # beyond this the feed gives up on the backlog and tells pages to reload
READ_ROWS = f"SELECT {SELECT_COLUMNS} FROM usage_events WHERE id = ANY(?::text[])"


class ReplicaFeed:
    def __init__(self, store: Any, hub: LiveHub):
        self.store = store  # the PostgresStore: its url, its replica id, its pool (``fetch``)
        self.hub = hub
        self.pending: list[str] = []
        self._wake = asyncio.Event()
        self._conn = None
        self._failing = False
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Listening before the gateway serves: a page never subscribes before the feed hears."""
        await self._listen()
        self._task = asyncio.create_task(self._run(), name="kilnproxy-inspector-replica-feed")

    async def stop(self) -> None:
        self._task = await cancelled(self._task)
        await self._disconnect()

    def notice(self, _conn, _pid, _channel, payload: str) -> None:
        """asyncpg's listener callback: queue the ids another replica committed."""
        replica, _, ids = payload.partition(" ")
        if ids == "*":
            self.hub.reset()
        elif replica != self.store.replica and self.hub.subscribers:
            self.pending.extend(ids.split())
            if len(self.pending) > MAX_PENDING:
                self.pending.clear()
                self.hub.reset()
            self._wake.set()

    async def _run(self) -> None:
        while True:
            if self._conn is None and not await self._listen():
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if not await woken(self._wake, PING_SECONDS):
                await self._ping()
                continue
            self._wake.clear()
            while self.pending:
                ids, self.pending = self.pending[:MAX_IDS], self.pending[MAX_IDS:]
                await self._publish(ids)

    async def _publish(self, ids: list[str]) -> None:
        if not self.hub.subscribers:
            return
        try:
            rows = await self.store.fetch(READ_ROWS, (ids,))
        except Exception as exc:  # the store out of reach: the pages reload once they can
            log.warning("inspector: cannot read the rows other replicas committed: %s", exc)
            self.pending.clear()
            self.hub.reset()
            return
        order = {generation_id: i for i, generation_id in enumerate(ids)}
        self.hub.publish([(row, None) for row in sorted(rows, key=lambda r: order[r["id"]])])

    async def _listen(self) -> bool:
        import asyncpg  # only with PostgreSQL configured

        try:
            self._conn = await asyncpg.connect(self.store.url, timeout=CONNECT_TIMEOUT, server_settings={
                "application_name": f"kilnproxy inspector {self.store.replica}"})
            await self._conn.add_listener(ROWS_CHANNEL, self.notice)
            self._conn.add_termination_listener(self._lost)
        except Exception as exc:
            if not self._failing:
                log.warning("inspector: cannot listen for the rows of other replicas (retrying): %s", exc)
            self._failing = True
            await self._disconnect()
            return False
        self._failing = False
        self.hub.reset()  # rows committed while no one listened: the pages reload their lists
        return True

    async def _ping(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            await conn.fetchval("SELECT 1", timeout=CONNECT_TIMEOUT)
        except Exception as exc:
            log.warning("inspector: lost the connection that listens for other replicas' rows: %s", exc)
            await self._disconnect()

    def _lost(self, _conn) -> None:
        self._conn = None
        self._wake.set()

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), CONNECT_TIMEOUT)
            except Exception:
                conn.terminate()
