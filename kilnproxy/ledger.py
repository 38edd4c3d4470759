"""The usage ledger: one SQLite row per request, written by group commit.

``Ledger`` is the interface the request path uses; ``SQLiteLedger`` is the
store shipped today (a PostgreSQL one can slot in behind the same methods).

The request path calls ``submit(row)``, which never blocks and never raises:
the row goes on a queue and a future is returned. One writer task takes
everything queued, inserts it in one transaction and resolves the futures.
The request awaits its future before the response ends, so a response a client
saw end always has its row on disk (WAL, ``synchronous=NORMAL``: a committed
transaction survives the gateway being killed; only a power cut could lose the
last ones). A failed commit is retried with the same rows; none is dropped.

The ledger is a store, not a plugin: ``record_usage`` plugins are told of each
row after its commit (``on_commit``), off the request's path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
from operator import itemgetter
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Protocol

import aiosqlite

from .errors import StorageError
from .record import COLUMNS

log = logging.getLogger("kilnproxy.ledger")

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_events (
    id TEXT PRIMARY KEY,
    created_at TEXT NOT NULL,
    org TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT,
    endpoint TEXT NOT NULL,
    stream INTEGER NOT NULL,
    status INTEGER NOT NULL,
    error_code TEXT,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    total_tokens INTEGER NOT NULL DEFAULT 0,
    cost REAL NOT NULL DEFAULT 0,
    duration_ms REAL,
    ttft_ms REAL,
    finish_reason TEXT,
    disconnected INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS usage_events_org_created ON usage_events (org, created_at);
CREATE INDEX IF NOT EXISTS usage_events_created ON usage_events (created_at);
"""

INSERT = f"INSERT OR REPLACE INTO usage_events ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
ROWS_PER_INSERT = 64  # rows in one INSERT statement; every size up to it stays in sqlite3's statement cache


@functools.lru_cache(maxsize=None)
def _insert_rows(n: int) -> str:
    return INSERT + f", ({', '.join('?' * len(COLUMNS))})" * (n - 1)


_values = itemgetter(*COLUMNS)  # row dict -> tuple in column order

CommitListener = Callable[[list[tuple[dict[str, Any], Any]]], None]


class Ledger(Protocol):
    async def open(self) -> None: ...
    async def close(self) -> None: ...
    def submit(self, row: dict[str, Any], tag: Any = None) -> "asyncio.Future[None]": ...
    async def spent_by_org(self) -> dict[str, float]: ...
    async def get(self, generation_id: str) -> dict[str, Any] | None: ...
    def queue_depth(self) -> int: ...


class SQLiteLedger:
    RETRY_SECONDS = 0.2

    def __init__(self, path: Path, on_commit: CommitListener | None = None):
        self.path = Path(path)
        self.on_commit = on_commit
        self._db: aiosqlite.Connection | None = None
        self._pending: list[tuple[dict[str, Any], asyncio.Future, Any]] = []
        self._wake = asyncio.Event()
        self._writer: asyncio.Task | None = None
        self._closing = False
        self.commits = 0
        self.last_commit_seconds = 0.0

    async def open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # autocommit: one INSERT of many rows is one transaction and one trip to the db thread
            self._db = await aiosqlite.connect(self.path, timeout=2.0, isolation_level=None)
            await self._db.execute("PRAGMA journal_mode=WAL")
            await self._db.execute("PRAGMA synchronous=NORMAL")
            await self._db.executescript(SCHEMA)
            # Prove we can write now, rather than lose rows later.
            await self._db.execute("BEGIN IMMEDIATE")
            await self._db.execute("ROLLBACK")
        except (sqlite3.Error, OSError) as exc:
            if self._db is not None:
                await self._db.close()
                self._db = None
            raise StorageError(f"cannot open the usage database {str(self.path)!r} for writing: {exc}"
                               " (check [storage] path, its permissions, and that no other program"
                               " holds a lock on it)") from None
        self._db.row_factory = sqlite3.Row
        self._writer = asyncio.create_task(self._write_loop(), name="kilnproxy-ledger-writer")

    def submit(self, row: dict[str, Any], tag: Any = None) -> "asyncio.Future[None]":
        """Queue ``row``; the future resolves once it is committed. ``tag`` is handed
        back to ``on_commit`` with the row."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((row, future, tag))
        self._wake.set()
        return future

    def queue_depth(self) -> int:
        return len(self._pending)

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                if self._closing:
                    return
                continue
            batch, self._pending = self._pending, []
            rows = [row for row, _, _ in batch]
            started = loop.time()
            while True:
                try:
                    await self._insert(rows)
                    break
                except sqlite3.Error as exc:
                    log.error("usage ledger commit of %d rows failed, retrying: %s", len(rows), exc)
                    try:
                        await self._db.rollback()
                    except sqlite3.Error:
                        pass
                    await asyncio.sleep(self.RETRY_SECONDS)
            self.commits += 1
            self.last_commit_seconds = loop.time() - started
            for _, future, _ in batch:
                if not future.done():
                    future.set_result(None)
            if self.on_commit is not None:
                self.on_commit([(row, tag) for row, _, tag in batch])
            if self._pending:
                self._wake.set()

    async def _insert(self, rows: list[dict[str, Any]]) -> None:
        values = [_values(r) for r in rows]
        if len(values) <= ROWS_PER_INSERT:
            await self._db.execute(_insert_rows(len(values)), [v for row in values for v in row])
            return
        await self._db.execute("BEGIN")
        for start in range(0, len(values), ROWS_PER_INSERT):
            part = values[start:start + ROWS_PER_INSERT]
            await self._db.execute(_insert_rows(len(part)), [v for row in part for v in row])
        await self._db.execute("COMMIT")

    async def close(self) -> None:
        """Commit everything queued, then close the database."""
        if self._writer is not None:
            self._closing = True
            self._wake.set()
            await self._writer
            self._writer = None
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def spent_by_org(self) -> dict[str, float]:
        async with self._db.execute("SELECT org, SUM(cost) FROM usage_events GROUP BY org") as cur:
            return {org: total or 0.0 for org, total in await cur.fetchall()}

    async def get(self, generation_id: str) -> dict[str, Any] | None:
        async with self._db.execute("SELECT * FROM usage_events WHERE id = ?", (generation_id,)) as cur:
            row = await cur.fetchone()
        return dict(row) if row is not None else None


def read_rows(path: Path, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
    """Read the ledger from another process (the ``usage`` command), read-only."""
    if not Path(path).exists():
        raise StorageError(f"no usage database at {str(path)!r} (check [storage] path)")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        db.row_factory = sqlite3.Row
        return db.execute(sql, tuple(params)).fetchall()
    except sqlite3.Error as exc:
        raise StorageError(f"cannot read the usage database {str(path)!r}: {exc}") from None
    finally:
        db.close()
