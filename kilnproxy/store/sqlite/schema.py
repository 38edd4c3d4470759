"""The SQLite ledger's file: its table, made ready and proved writable, and read from another process.

``prepare_file`` creates the table (and the inspector's tables, ``kilnproxy.store.inspector_tables``;
the spend rollup and its triggers, ``spend_rollup``) in WAL mode and brings a file an older kilnproxy
made to the current columns and indexes (its rollup built from its rows); the ledger
calls it at start-up, and so do the commands that write the file (before a gateway ever ran on it).
``connect_for_the_loop`` opens the connection the event loop's thread commits on (``loop_commits``);
``read_rows`` reads the file read-only, from another process (the ``usage`` command).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, Iterable

from ...errors import StorageError
from ..inspector_tables import SQLITE_TABLES as INSPECTOR_TABLES
from .spend_rollup import add_rollup

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
    requested_model TEXT,
    upstream TEXT,
    batch_id TEXT
);
CREATE INDEX IF NOT EXISTS usage_events_org_created ON usage_events (org, created_at);
"""

# Columns added since the first release: a file made before gets them when it is opened, filled in
# from the row's other columns (``requested_model``: rows from before fallbacks existed were served by
# the model asked for; ``upstream``: not known, NULL, which the column holds once added: no row is written;
# ``batch_id``: NULL, no Batch API line ran before it).
ADDED_COLUMNS = (  # (name, how it is added, what an older row holds in it)
    ("requested_model", "ALTER TABLE usage_events ADD COLUMN requested_model TEXT", "model"),
    ("upstream", "ALTER TABLE usage_events ADD COLUMN upstream TEXT", "NULL"),
    ("batch_id", "ALTER TABLE usage_events ADD COLUMN batch_id TEXT", "NULL"),
)

# The table keeps the indexes of the gateway's own reads: the id's (a generation looked up, a row written
# twice), the org's (its usage and credits) and the key's (``tenancy_sql``: its usage in its period). Every
# index is one more b-tree written in every request's commit: the inspector's reads by time and by model go
# through tables of its own, filled when it reads them (``kilnproxy.store.inspector_tables``). The indexes an
# older kilnproxy made for those are dropped when the file is opened.
DROPPED_INDEXES = ("usage_events_created", "usage_events_model_created")

# A new file's page size. Each commit appends every page it changed (the table's last leaf and one leaf
# per index) to the WAL: 1 KiB pages make a one-row commit append about a third of what 4 KiB pages do
# (bench/ledger_layout.py). SQLite fixes the size when a file is created; existing files keep theirs.
NEW_FILE_PAGE_SIZE = 1024

LOCK_WAIT_SECONDS = 2.0  # how long to wait for another program's lock on the file


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


def prepare_file(path: Path, inspector_tables: bool = False) -> None:
    """Create the table in WAL mode and prove the file can be written now, rather than lose rows later
    (the ledger at start-up; the commands that write the file, before a gateway ever ran on it); with
    ``inspector_tables`` (a gateway with the inspector), the inspector's tables and index too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=LOCK_WAIT_SECONDS, isolation_level=None)
    try:
        db.execute(f"PRAGMA page_size={NEW_FILE_PAGE_SIZE}")  # a no-op on a file that has pages already
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(SCHEMA)
        add_missing_columns(db)
        drop_old_indexes(db)
        add_rollup(db)
        if inspector_tables:
            db.executescript(INSPECTOR_TABLES)
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
                if filled_from != "NULL":
                    db.execute(f"UPDATE usage_events SET {name} = {filled_from}")


def drop_old_indexes(db: sqlite3.Connection) -> None:
    """Drop the ``DROPPED_INDEXES`` a file made by an older kilnproxy has (no write when it has none)."""
    present = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    for name in DROPPED_INDEXES:
        if name in present:
            db.execute(f"DROP INDEX IF EXISTS {name}")


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
