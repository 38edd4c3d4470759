"""``Pinned``: a connection of the store's own, kept by one task for its statements.

The admitter and the ledger's writer (``kilnproxy.store.batches``) each send
one statement at a time, one per request at low load: borrowing a connection
from asyncpg's pool and giving it back around each one cost more of the
gateway's CPU than the statement itself (per round trip: a task for
``acquire``'s timeout, one for ``wait_for``, one for ``release``'s
``shield``; measured 73 µs of CPU against 33 µs for the same ``SELECT 1`` on
a kept connection). So each has a connection of its own, besides the pool,
and sends its statement on it directly, under one deadline and no extra task.
The statements stay prepared on that connection (asyncpg's statement cache):
one Bind/Execute/Sync per round trip.

A connection that failed to answer (one of ``UNREACHABLE``, a deadline, a
cancellation) is never used again: it is terminated, and the next statement
opens another. So is one the server closed while it was idle (a restart,
``pg_terminate_backend``, an idle timeout): as with the pool's, the next
statement goes on a new connection rather than fail. ``expire()`` (the
heartbeat, after an outage: none of the connections of before is to be
trusted) replaces it at the next statement too. A statement that PostgreSQL
refused (a deadlock, a constraint) leaves the connection as it was.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg


class Pinned:
    def __init__(self, store: Any):  # the PostgresStore: its ``connect()``, deadlines and errors
        self.store = store
        self.conn: asyncpg.Connection | None = None
        self._expired = False

    async def run(self, method: str, sql: str, *args):
        """``conn.<method>(sql, *args)`` on the kept connection (opened first if there is none),
        as ``PostgresStore.run``: all of it bounded by ``2 * STATEMENT_TIMEOUT``, the statement by
        ``STATEMENT_TIMEOUT``; raises one of ``UNREACHABLE`` past them. Not for concurrent use."""
        store = self.store
        if self._expired or self.conn is not None and self.conn.is_closed():
            self.drop()
        try:
            async with asyncio.timeout(2 * store.STATEMENT_TIMEOUT):
                if self.conn is None:
                    self.conn = await store.connect()
                return await getattr(self.conn, method)(sql, *args, timeout=store.STATEMENT_TIMEOUT)
        except asyncpg.PostgresError as exc:
            if isinstance(exc, store.UNREACHABLE):  # e.g. the server shutting down: a PostgresError too
                self.drop()
            raise
        except BaseException:
            self.drop()
            raise

    def expire(self) -> None:
        """Use a new connection from the next statement on."""
        self._expired = True

    def drop(self) -> None:
        """Terminate the kept connection, if any."""
        conn, self.conn, self._expired = self.conn, None, False
        if conn is not None:
            conn.terminate()

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                await conn.close(timeout=self.store.STATEMENT_TIMEOUT)
            except (*self.store.UNREACHABLE, asyncpg.PostgresError):
                conn.terminate()
