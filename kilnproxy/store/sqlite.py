"""``SQLiteLedger``: the usage ledger of one gateway process, one SQLite row per request
(the ``Ledger`` contract of ``kilnproxy.store.ledger``), written by group commit in WAL mode:
on the event loop's thread when the file is free (``loop_commits``), else by the writer thread."""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
from operator import itemgetter
from pathlib import Path
from typing import Any, Iterable

import aiosqlite

from ..errors import StorageError
from ..usage import COLUMNS
from .batches import Batches, GroupCommitted
from .checkpoint import Checkpointer
from .ledger import CommitListener
from .loop_commits import LoopCommits

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
    disconnected INTEGER NOT NULL DEFAULT 0,
    requested_model TEXT
);
CREATE INDEX IF NOT EXISTS usage_events_org_created ON usage_events (org, created_at);
CREATE INDEX IF NOT EXISTS usage_events_created ON usage_events (created_at);
"""

# Columns added since the first release: a file made before gets them when it is opened, filled in
# from the row's other columns (``requested_model``: rows from before fallbacks existed were served by
# the model asked for).
ADDED_COLUMNS = (  # (name, how it is added, what an older row holds in it)
    ("requested_model", "ALTER TABLE usage_events ADD COLUMN requested_model TEXT", "model"),
)

# A new file's page size. Each commit appends every page it changed (the table's last leaf and one leaf
# per index) to the WAL: 1 KiB pages make a one-row commit append about a third of what 4 KiB pages do
# (bench/ledger_layout.py). SQLite fixes the size when a file is created; existing files keep theirs.
NEW_FILE_PAGE_SIZE = 1024

LOCK_WAIT_SECONDS = 2.0  # how long to wait for another program's lock on the file

INSERT = f"INSERT OR REPLACE INTO usage_events ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
ROWS_PER_INSERT = 64  # rows in one INSERT statement; every size up to it stays in sqlite3's statement cache


@functools.lru_cache(maxsize=None)
def _insert_rows(n: int) -> str:
    return INSERT + f", ({', '.join('?' * len(COLUMNS))})" * (n - 1)


_values = itemgetter(*COLUMNS)  # row dict -> tuple in column order


class SQLiteLedger(GroupCommitted):
    """Rows are committed on the loop's thread (``self.here``) on a plain ``sqlite3`` connection,
    handed to the writer thread (``self.rows``, aiosqlite) whenever that could wait or fsync."""

    RETRY_SECONDS = 0.2

    def __init__(self, path: Path, on_commit: CommitListener | None = None,
                 checkpointer: Checkpointer | None = None):
        self.path = Path(path)
        self.on_commit = on_commit
        self.checkpointer = checkpointer or Checkpointer(self.path)
        self._db: aiosqlite.Connection | None = None
        self._loop_db: sqlite3.Connection | None = None
        self.rows = Batches(self._commit, "kilnproxy-ledger-writer", self._committed)
        self.here = LoopCommits(self._insert_here, self.rows, super()._committed,
                                self.checkpointer.loop_must_hand_off)
        self.commit_failures = 0
        self._last_here = False  # whether the last commit was the loop's (else the writer's)

    async def open(self) -> None:
        try:
            # Checked with plain sqlite3 first: aiosqlite's thread outlives a failed connect.
            await asyncio.to_thread(prepare_file, self.path)
            self._loop_db = await asyncio.to_thread(connect_for_the_loop, self.path)
            # autocommit: one INSERT of many rows is one transaction and one trip to the db thread
            self._db = await aiosqlite.connect(self.path, timeout=LOCK_WAIT_SECONDS, isolation_level=None)
            for pragma in ("synchronous=NORMAL", "wal_autocheckpoint=0"):  # checkpoints: the Checkpointer's job
                # fetchall: a statement left unfinished holds a read snapshot, and no checkpoint could end
                await self._db.execute_fetchall(f"PRAGMA {pragma}")
        except (sqlite3.Error, OSError) as exc:
            await self._close_connections()
            raise cannot_open(self.path, exc) from None
        self._db.row_factory = sqlite3.Row
        await self.checkpointer.start()
        self.rows.start()

    def submit(self, row: dict[str, Any], tag: Any = None) -> asyncio.Future:
        """Queue ``row`` for this loop iteration's commit; the future resolves once it is durable."""
        return self.here.add(row, tag)

    def queue_depth(self) -> int:
        return self.here.queue_depth() + self.rows.queue_depth()

    @property
    def commits(self) -> int:
        return self.here.commits + self.rows.batches

    @property
    def last_commit_seconds(self) -> float:
        return self.here.last_commit_seconds if self._last_here else self.rows.last_batch_seconds

    def stats(self) -> dict[str, float]:
        """``GroupCommitted.stats`` over both threads' commits, and the rows the loop handed to the writer."""
        return {"queue_depth": self.queue_depth(), "commits": self.commits,
                "rows_committed": self.here.rows_committed + self.rows.items_done,
                "commit_failures": self.commit_failures, "last_commit_seconds": self.last_commit_seconds,
                "rows_handed_to_writer": self.here.rows_handed_off}

    def _insert_here(self, rows: list[dict[str, Any]]) -> None:
        """One transaction on the loop's connection; raises (rolled back) if it cannot commit now."""
        self._last_here = True
        try:
            _insert_sync(self._loop_db, [_values(r) for r in rows])
        except BaseException:
            if self._loop_db.in_transaction:
                self._loop_db.execute("ROLLBACK")
            raise

    def _committed(self, batch: list[tuple[dict[str, Any], Any]]) -> None:
        """After the writer's commits (the loop's call ``GroupCommitted._committed``: their checkpoint
        check is made before each, ``Checkpointer.loop_must_hand_off``)."""
        self.checkpointer.committed()
        super()._committed(batch)

    async def _commit(self, rows: list[dict[str, Any]]) -> None:
        """Insert ``rows`` in one transaction, retried until it succeeds: no row is dropped."""
        self._last_here = False
        if self.checkpointer.over_bound():
            await self._restart_wal()
        params = [_values(r) for r in rows]
        while True:
            try:
                await self._insert(params)
                return
            except sqlite3.OperationalError as exc:  # locked, disk full, I/O error: wait and retry
                log.error("usage ledger commit of %d rows failed, retrying: %s", len(rows), exc)
            except (sqlite3.Error, OverflowError) as exc:  # a value SQLite cannot bind: store it as text
                log.error("usage ledger commit of %d rows failed, storing odd values as text: %s", len(rows), exc)
                params = [tuple(map(_storable, p)) for p in params]
            self.commit_failures += 1
            try:
                await self._db.rollback()
            except sqlite3.Error:
                pass
            await asyncio.sleep(self.RETRY_SECONDS)

    async def _restart_wal(self) -> None:
        try:
            async with self._db.execute("PRAGMA wal_checkpoint(RESTART)") as cur:
                busy, _, _ = await cur.fetchone()
            self.checkpointer.restarts += 1 - busy
        except sqlite3.Error as exc:  # readers in the way: the commit goes on, the next batch tries again
            log.warning("usage ledger: WAL checkpoint at its size bound failed: %s", exc)

    async def _insert(self, values: list[tuple]) -> None:
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
        self.here.flush()
        await self.rows.close()
        if self._db is not None:
            await self.checkpointer.stop()
        await self._close_connections()

    async def _close_connections(self) -> None:
        if self._loop_db is not None:  # in a thread: the last connection closed checkpoints the WAL
            await asyncio.to_thread(self._loop_db.close)
            self._loop_db = None
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


def _insert_sync(db: sqlite3.Connection, values: list[tuple]) -> None:
    """``values`` in one transaction on an autocommit ``sqlite3`` connection."""
    if len(values) <= ROWS_PER_INSERT:
        db.execute(_insert_rows(len(values)), [v for row in values for v in row])
        return
    db.execute("BEGIN IMMEDIATE")
    for start in range(0, len(values), ROWS_PER_INSERT):
        part = values[start:start + ROWS_PER_INSERT]
        db.execute(_insert_rows(len(part)), [v for row in part for v in row])
    db.execute("COMMIT")


def connect_for_the_loop(path: Path) -> sqlite3.Connection:
    """The connection the loop's thread commits on: never waits for a lock (busy_timeout 0),
    never fsyncs at a commit (WAL, ``synchronous=NORMAL``), never checkpoints."""
    db = sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=False)
    try:
        for pragma in ("synchronous=NORMAL", "wal_autocheckpoint=0"):
            db.execute(f"PRAGMA {pragma}").fetchall()
    except BaseException:
        db.close()
        raise
    return db


def _storable(value: Any) -> Any:
    if type(value) is int:
        return value if -2**63 <= value < 2**63 else str(value)
    return value if value is None or isinstance(value, (float, str)) else str(value)


def prepare_file(path: Path) -> None:
    """Create the table in WAL mode and prove the file can be written now, rather than lose rows later
    (the ledger at start-up; the commands that write the file, before a gateway ever ran on it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=LOCK_WAIT_SECONDS, isolation_level=None)
    try:
        db.execute(f"PRAGMA page_size={NEW_FILE_PAGE_SIZE}")  # a no-op on a file that has pages already
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)
        add_missing_columns(db)
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")
    finally:
        db.close()


def check_writable(path: Path) -> None:
    """``prepare_file``, a failure raised as the one line a gateway's start-up gives (``cannot_open``)."""
    try:
        prepare_file(path)
    except (sqlite3.Error, OSError) as exc:
        raise cannot_open(path, exc) from None


def cannot_open(path: Path, exc: BaseException) -> StorageError:
    """The one line saying that the ledger at ``path`` cannot be opened for writing, and why."""
    return StorageError(f"cannot open the usage database {str(path)!r} for writing: {exc}"
                        " (check [storage] path, its permissions, and that no other program holds a lock on it)")


def add_missing_columns(db: sqlite3.Connection) -> None:
    """Bring a ledger (or spool) file made by an older kilnproxy to the current columns."""
    present = {r[1] for r in db.execute("PRAGMA table_info(usage_events)")}
    for name, add, filled_from in ADDED_COLUMNS:
        if name not in present:
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.execute(add)
                db.execute(f"UPDATE usage_events SET {name} = {filled_from}")


def read_rows(path: Path, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
    """Read the ledger from another process (the ``usage`` command), read-only. A file that is
    missing, a directory or no readable SQLite database is a ``StorageError``."""
    if not Path(path).exists():
        raise StorageError(f"no usage database at {str(path)!r} (check [storage] path)")
    if Path(path).is_dir():
        raise StorageError(f"{str(path)!r} is a directory, not a usage database (check [storage] path)")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        raise StorageError(f"cannot open the usage database {str(path)!r}: {exc}") from None
    try:
        db.row_factory = sqlite3.Row
        return db.execute(sql, tuple(params)).fetchall()
    except sqlite3.Error as exc:
        raise StorageError(f"cannot read the usage database {str(path)!r}: {exc}") from None
    finally:
        db.close()
