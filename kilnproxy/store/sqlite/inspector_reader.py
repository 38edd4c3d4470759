"""``SQLiteReader``: the inspector's own connection to the SQLite ledger's file, which fills the inspector's tables.

It reads (WAL: readers never hold up the ledger's group commits) and writes
nothing but the inspector's tables (``kilnproxy.store.inspector_tables``,
created with the ledger's table by ``kilnproxy.store.sqlite.schema``): they are
brought up to every row committed in the read's own transaction
(``read_filled``), ``FILL_ROWS`` rows at a time. It is one of the ledger's
``file_users`` (closed and opened again with the ledger's connections).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path
from typing import Any, Iterable

import aiosqlite

log = logging.getLogger("kilnproxy.inspector")

FILL_ROWS = 5_000  # rows copied into the inspector's tables per transaction: the ledger's commits wait no longer
FILL_WAIT_MS = 500  # how long a fill waits for the file's write lock (the ledger holds it a moment a commit)
READ_WAIT_MS = 10_000  # the reader's busy timeout otherwise


class SQLiteReader:
    """A connection of its own to the SQLite ledger; writes nothing but the inspector's tables
    (``read_filled``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.db: aiosqlite.Connection | None = None
        self._paused = asyncio.Lock()  # held by a read, or while paused
        self._fill_error = ""  # why the inspector's tables could not be filled at the last read

    async def open(self) -> None:
        self.db = await aiosqlite.connect(self.path, timeout=READ_WAIT_MS / 1000, isolation_level=None)
        await self.db.execute("PRAGMA query_only = 1")
        self.db.row_factory = sqlite3.Row

    async def close(self) -> None:
        if self.db is not None:
            await self.db.close()
            self.db = None

    async def pause(self) -> None:
        """Close the connection, reads waiting until ``resume``: the ledger opens the file anew
        (``SQLiteLedger.file_users``)."""
        await self._paused.acquire()
        await self.close()

    async def resume(self) -> None:
        try:
            await self.open()
        finally:
            self._paused.release()

    async def fetch(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        async with self._paused:  # one read at a time, as on the connection's one thread anyway
            async with self.db.execute(sql, tuple(params)) as cur:
                return [dict(r) for r in await cur.fetchall()]

    async def read_filled(self, sql: str, params: Iterable[Any],
                          shared: tuple[str, list[Any]]) -> list[dict[str, Any]]:
        """The rows of a query of the inspector's own tables: they are first brought up to every row
        committed, then read, in one transaction (the rows the query sees are those of one moment).
        A long way behind (the first read after an upgrade, or after a long time), they are filled
        ``FILL_ROWS`` rows at a time, a transaction each, so that the ledger's commits never wait long.
        When they cannot be written now (another program holds the file's write lock, a full disk, a
        read-only file), the ``shared`` query answers instead, from the usage table alone: the same
        rows, found without the inspector's tables (slower on a large table), rather than no answer."""
        async with self._paused:
            db = self.db
            await db.execute("PRAGMA query_only = 0")
            await db.execute(f"PRAGMA busy_timeout = {FILL_WAIT_MS}")
            try:
                while True:
                    await db.execute("BEGIN IMMEDIATE")
                    try:
                        if await self._fill(db):
                            async with db.execute(sql, tuple(params)) as cur:
                                rows = [dict(r) for r in await cur.fetchall()]
                            await db.execute("COMMIT")
                            return rows
                        await db.execute("COMMIT")
                    except BaseException:
                        if db.in_transaction:
                            await db.execute("ROLLBACK")
                        raise
            except sqlite3.OperationalError as exc:
                if str(exc) != self._fill_error:  # said once, not at each read
                    log.warning("inspector: its own tables cannot be filled now (%s); reading the usage table "
                                "without them", exc)
                self._fill_error = str(exc)
            else:
                self._fill_error = ""
            finally:
                await db.execute(f"PRAGMA busy_timeout = {READ_WAIT_MS}")
                await db.execute("PRAGMA query_only = 1")
            async with db.execute(shared[0], tuple(shared[1])) as cur:
                return [dict(r) for r in await cur.fetchall()]

    @staticmethod
    async def _fill(db: aiosqlite.Connection) -> bool:
        """Copy up to ``FILL_ROWS`` rows' time, model and rowid into the inspector's tables; True once they
        hold every row. Where it stopped is kept as a rowid and that row's id: if that row is gone (rows
        deleted from the top of the table, whose rowids new rows may take again), they are filled anew."""
        (up_to, up_to_id), = await db.execute_fetchall(
            "SELECT COALESCE((SELECT up_to FROM inspector_filled), 0), (SELECT up_to_id FROM inspector_filled)")
        if up_to and not await db.execute_fetchall("SELECT 1 FROM usage_events WHERE rowid = ? AND id = ?",
                                                   (up_to, up_to_id)):
            await db.execute("DELETE FROM inspector_times")
            await db.execute("DELETE FROM inspector_models")
            up_to = 0
        last = await db.execute_fetchall("SELECT rowid, id FROM usage_events WHERE rowid > ? AND rowid <= ? "
                                         "ORDER BY rowid DESC LIMIT 1", (up_to, up_to + FILL_ROWS))
        if not last:
            return not await db.execute_fetchall("SELECT 1 FROM usage_events WHERE rowid > ? LIMIT 1", (up_to,))
        end, end_id = last[0]
        await db.execute("INSERT OR IGNORE INTO inspector_times (created_at, rid) SELECT created_at, rowid "
                         "FROM usage_events WHERE rowid > ? AND rowid <= ?", (up_to, end))
        await db.execute("INSERT OR IGNORE INTO inspector_models (model, created_at, rid) SELECT model, created_at, "
                         "rowid FROM usage_events WHERE rowid > ? AND rowid <= ? AND model IS NOT NULL", (up_to, end))
        await db.execute("INSERT OR REPLACE INTO inspector_filled (id, up_to, up_to_id) VALUES (1, ?, ?)",
                         (end, end_id))
        return not await db.execute_fetchall("SELECT 1 FROM usage_events WHERE rowid > ? LIMIT 1", (end,))
