"""The two databases of runtime tenancy behind one small interface, and the SQLite file's schema.

``TenancyStore`` (``kilnproxy.store.tenancy.orgs_keys``) writes each query once, with
``?`` placeholders; ``SQLiteDb`` runs it as is on the gateway's SQLite file,
``PostgresDb`` numbers the placeholders (``$1, $2, ...``) for asyncpg. Both
answer rows as plain dicts and open transactions the same way:

* ``fetch`` / ``fetchrow`` / ``fetchval`` outside a transaction;
* ``async with db.transaction() as tx`` for a change: SQLite ``BEGIN
  IMMEDIATE`` (the file's one writer from the first statement), PostgreSQL
  READ COMMITTED; ``db.transaction(snapshot=True)`` for reads that must see
  one moment (SQLite's deferred ``BEGIN`` in WAL, PostgreSQL REPEATABLE READ
  READ ONLY).
* ``tx.changed(version)``: what the database does once a change is made, in
  its transaction. PostgreSQL sends ``NOTIFY kiln_tenancy, '<version>'``,
  delivered at commit to every listening replica; SQLite has no such thing
  (its readers read the version counter).

The SQLite schema is versioned by the file's ``PRAGMA user_version``:
``SQLITE_MIGRATIONS[n]`` takes the file from version ``n`` to ``n + 1``. Its
first entry is the tenancy tables, which the file of an existing gateway (its
``usage_events`` only, user_version 0) takes at start-up; its second, the orgs' and
keys' ``priority`` and ``weight`` (``TENANCY_SHARES``, PostgreSQL's version 12); its third, a key's
``role`` (``KEY_ROLE``, the same text as PostgreSQL's version 14). ``migrate_sqlite``
takes a *synchronous* ``sqlite3`` connection: the ledger calls it from the
thread where it prepares the file (``asyncio.to_thread``), after creating
``usage_events``; an aiosqlite connection is never used for it.

PostgreSQL's tables are the same, created by the migration that follows
``usage_events`` in ``kilnproxy.store.postgres.schema.MIGRATIONS`` (run at start-up by
the first replica, under its advisory lock).
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import aiosqlite

from ...errors import StorageError

NOTIFY_CHANNEL = "kiln_tenancy"
LOCK_WAIT_SECONDS = 5.0  # how long a change waits for the SQLite file's other writer (the ledger, a command)

# The tables of runtime tenancy, one text for both stores: SQLite reads BIGINT and DOUBLE PRECISION
# with the affinities of INTEGER and REAL. (``kiln_audit.id`` is the change counter's value, never a rowid.)
TENANCY_TABLES = """
CREATE TABLE kiln_runtime_orgs (
    id TEXT PRIMARY KEY,
    max_in_flight INTEGER CHECK (max_in_flight > 0),
    disabled INTEGER NOT NULL DEFAULT 0,
    requests_per_minute BIGINT CHECK (requests_per_minute > 0),
    tokens_per_minute BIGINT CHECK (tokens_per_minute > 0),
    created_at TEXT NOT NULL
);

CREATE TABLE kiln_keys (
    id TEXT PRIMARY KEY,
    sha256 TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    name TEXT NOT NULL,
    org TEXT NOT NULL,
    models TEXT,
    "limit" DOUBLE PRECISION CHECK ("limit" >= 0),
    limit_reset TEXT CHECK (limit_reset IN ('daily', 'weekly', 'monthly')),
    expires_at TEXT,
    disabled INTEGER NOT NULL DEFAULT 0,
    revoked_at TEXT,
    requests_per_minute BIGINT CHECK (requests_per_minute > 0),
    tokens_per_minute BIGINT CHECK (tokens_per_minute > 0),
    created_at TEXT NOT NULL
);
CREATE INDEX kiln_keys_org ON kiln_keys (org);

CREATE TABLE kiln_grants (
    id TEXT PRIMARY KEY,
    org TEXT NOT NULL,
    amount DOUBLE PRECISION NOT NULL,
    reference TEXT NOT NULL,
    created_at TEXT NOT NULL,
    UNIQUE (org, reference)
);

CREATE TABLE kiln_audit (
    id BIGINT PRIMARY KEY,
    at TEXT NOT NULL,
    kind TEXT NOT NULL,
    org TEXT NOT NULL,
    subject TEXT NOT NULL,
    actor TEXT,
    detail TEXT NOT NULL
);
CREATE INDEX kiln_audit_org ON kiln_audit (org, id);

CREATE TABLE kiln_version (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL
);
INSERT INTO kiln_version (id, version) VALUES (1, 0);

CREATE INDEX usage_events_key_created ON usage_events (key_id, created_at);
"""

# SPEC 14: an org's and a key's ``priority`` and ``weight`` (a key's NULL: its org's), one text for both
# stores (SQLite's second version, PostgreSQL's version 12).
TENANCY_SHARES = """
ALTER TABLE kiln_runtime_orgs ADD COLUMN priority TEXT NOT NULL DEFAULT 'interactive'
    CHECK (priority IN ('interactive', 'batch'));
ALTER TABLE kiln_runtime_orgs ADD COLUMN weight DOUBLE PRECISION NOT NULL DEFAULT 1.0 CHECK (weight > 0);
ALTER TABLE kiln_keys ADD COLUMN priority TEXT CHECK (priority IN ('interactive', 'batch'));
ALTER TABLE kiln_keys ADD COLUMN weight DOUBLE PRECISION CHECK (weight > 0);
"""

_SQLITE_V1 = TENANCY_TABLES

# A key's role (``admin``: it may also call the org API, ``/v1/org``); PostgreSQL's ``v14``.
KEY_ROLE = """
ALTER TABLE kiln_keys ADD COLUMN role TEXT NOT NULL DEFAULT 'member' CHECK (role IN ('admin', 'member'));
CREATE INDEX kiln_keys_org_role ON kiln_keys (org, role);
"""

SQLITE_MIGRATIONS: tuple[str, ...] = (_SQLITE_V1, TENANCY_SHARES, KEY_ROLE)


def migrate_sqlite(conn: sqlite3.Connection) -> int:
    """Bring the SQLite file of ``conn`` (a plain, synchronous ``sqlite3`` connection, its
    ``usage_events`` table already made) to the last schema version; returns the version found.

    One ``BEGIN IMMEDIATE`` transaction: two processes opening the file at once (a gateway and a
    command) queue on it, and the second finds nothing to do. A file of a newer kilnproxy is refused.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'usage_events'").fetchone():
            raise StorageError("the usage database has no usage_events table: open it with the ledger first")
        found = conn.execute("PRAGMA user_version").fetchone()[0]
        if found > len(SQLITE_MIGRATIONS):
            raise StorageError(f"the usage database's schema is version {found}, newer than this kilnproxy "
                               f"knows ({len(SQLITE_MIGRATIONS)}): upgrade kilnproxy")
        for version in range(found, len(SQLITE_MIGRATIONS)):
            # statement by statement: executescript would commit the transaction first
            for statement in SQLITE_MIGRATIONS[version].split(";"):
                if statement.strip():
                    conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {len(SQLITE_MIGRATIONS)}")
        conn.execute("COMMIT")
        return found
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class _Rows:
    """``fetchrow`` and ``fetchval`` from ``fetch``: a dict per row, the first row, its first value."""

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def fetchrow(self, sql: str, *args: Any) -> dict[str, Any] | None:
        rows = await self.fetch(sql, *args)
        return rows[0] if rows else None

    async def fetchval(self, sql: str, *args: Any) -> Any:
        row = await self.fetchrow(sql, *args)
        return next(iter(row.values())) if row else None


class SQLiteDb(_Rows):
    """The gateway's SQLite file, on a connection of its own (not the ledger writer's: a change must
    never run inside, or be committed by, a batch of usage rows). One operation at a time: a reader on
    this connection never sees a change before its commit."""

    dialect = "sqlite"

    def __init__(self, path: Path):
        self.path = Path(path)
        self._conn: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        """Connect to the file, taking the schema's migrations first."""
        try:
            await asyncio.to_thread(_migrate_file, self.path)
            self._conn = await aiosqlite.connect(self.path, timeout=LOCK_WAIT_SECONDS, isolation_level=None)
            # FULL: a change answered is on disk even after a power cut (changes are few; grants are money).
            # No checkpoint at a commit of ours: the ledger's Checkpointer copies the WAL in the background.
            for pragma in ("synchronous=FULL", "wal_autocheckpoint=0"):
                await self._conn.execute_fetchall(f"PRAGMA {pragma}")
        except (sqlite3.Error, OSError) as exc:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
            raise StorageError(f"cannot open the database {str(self.path)!r}: {exc}") from None
        self._conn.row_factory = sqlite3.Row

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def pause(self) -> None:
        """Close the connection, operations waiting until ``resume``: the ledger opens the file anew
        (``SQLiteLedger.file_users``)."""
        await self._lock.acquire()
        await self.close()

    async def resume(self) -> None:
        try:
            await self.open()
        finally:
            self._lock.release()

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        async with self._lock:
            return [dict(r) for r in await self._conn.execute_fetchall(sql, args)]

    @asynccontextmanager
    async def transaction(self, snapshot: bool = False) -> AsyncIterator["_SQLiteTx"]:
        async with self._lock:
            await self._conn.execute("BEGIN" if snapshot else "BEGIN IMMEDIATE")
            try:
                yield _SQLiteTx(self._conn)
                await self._conn.execute("COMMIT")
            except BaseException:
                try:
                    await self._conn.execute("ROLLBACK")
                except sqlite3.Error:  # no transaction left to roll back
                    pass
                raise


class _SQLiteTx(_Rows):
    def __init__(self, conn: aiosqlite.Connection):
        self._conn = conn

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._conn.execute_fetchall(sql, args)]

    async def changed(self, version: int) -> None:
        """Nothing to send: SQLite's readers poll the version counter."""


def _migrate_file(path: Path) -> None:
    conn = sqlite3.connect(path, timeout=LOCK_WAIT_SECONDS, isolation_level=None)
    try:
        migrate_sqlite(conn)
    finally:
        conn.close()


@functools.lru_cache(maxsize=256)
def numbered(sql: str) -> str:
    """``?`` placeholders as PostgreSQL's ``$1, $2, ...`` (the queries hold no literal ``?``)."""
    parts = sql.split("?")
    return "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)) + parts[-1]


class PostgresDb(_Rows):
    """PostgreSQL through an asyncpg pool (a gateway's) or one connection (a command's, a test's;
    then one operation at a time). The schema is ``kilnproxy.store.postgres.schema``'s, migrated by its opener.
    ``timeout`` (seconds) bounds each statement and each wait for a pooled connection: past it,
    ``asyncio.TimeoutError``, which the gateway answers as 503 ``store_unavailable``."""

    dialect = "postgresql"

    def __init__(self, pool_or_connection: Any, timeout: float | None = None):
        self._source = pool_or_connection
        self._lock = None if hasattr(pool_or_connection, "acquire") else asyncio.Lock()
        self.timeout = timeout

    async def open(self) -> None:
        """Nothing to do: the pool or connection is the caller's, as is the migration."""

    async def close(self) -> None:
        """Nothing to do: the pool or connection is closed by its owner."""

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[Any]:
        if self._lock is None:
            async with self._source.acquire(timeout=self.timeout) as conn:
                yield conn
        else:
            async with self._lock:
                yield self._source

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        async with self._connection() as conn:
            return [dict(r) for r in await conn.fetch(numbered(sql), *args, timeout=self.timeout)]

    @asynccontextmanager
    async def transaction(self, snapshot: bool = False) -> AsyncIterator["_PostgresTx"]:
        options = {"isolation": "repeatable_read", "readonly": True} if snapshot else {}
        async with self._connection() as conn, conn.transaction(**options):
            yield _PostgresTx(conn, self.timeout)


class _PostgresTx(_Rows):
    def __init__(self, conn: Any, timeout: float | None):
        self._conn = conn
        self._timeout = timeout

    async def fetch(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in await self._conn.fetch(numbered(sql), *args, timeout=self._timeout)]

    async def changed(self, version: int) -> None:
        """Tell every listening replica, at commit (``LISTEN kiln_tenancy``; the payload is the version)."""
        await self._conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, str(version), timeout=self._timeout)
