"""The Batch API's tables, and the SQLite file's connection for them.

One text for both stores (``{blob}``: SQLite's BLOB, PostgreSQL's BYTEA). Times of files and
batches are integer Unix seconds, as the API shows them; ``lease_until`` and ``not_before`` are
Unix seconds with a fraction.

* ``kiln_files``: a file's object; ``complete`` is 0 while its chunks are being written (an upload, an
  output file being made): such a file is never listed or read.
* ``kiln_file_chunks``: a file's bytes, in order of ``seq``, each at most ``CHUNK_BYTES``.
* ``kiln_batches``: a batch's object, its counts, and its lease (``runner``, ``lease_until``).
* ``kiln_batch_lines``: a batch's lines once checked: ``state`` is ``pending`` (to run, not before
  ``not_before``), ``sent`` (sent under ``generation_id``, its outcome not recorded yet), ``done``
  (``ok`` 1: its output line, 0: its error line, in ``result``) or ``expired``.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import aiosqlite

from ...errors import StorageError
from ..tenancy.sql import SQLiteDb

TABLES = """
CREATE TABLE IF NOT EXISTS kiln_files (
    id TEXT PRIMARY KEY,
    org TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    complete INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS kiln_files_org ON kiln_files (org, id);

CREATE TABLE IF NOT EXISTS kiln_file_chunks (
    file_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data {blob} NOT NULL,
    PRIMARY KEY (file_id, seq)
);

CREATE TABLE IF NOT EXISTS kiln_batches (
    id TEXT PRIMARY KEY,
    org TEXT NOT NULL,
    key_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    status TEXT NOT NULL,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    total BIGINT NOT NULL DEFAULT 0,
    completed BIGINT NOT NULL DEFAULT 0,
    failed BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    in_progress_at BIGINT,
    finalizing_at BIGINT,
    completed_at BIGINT,
    failed_at BIGINT,
    expired_at BIGINT,
    cancelling_at BIGINT,
    cancelled_at BIGINT,
    runner TEXT,
    lease_until DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS kiln_batches_org ON kiln_batches (org, id);
CREATE INDEX IF NOT EXISTS kiln_batches_open ON kiln_batches (status)
    WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling');

CREATE TABLE IF NOT EXISTS kiln_batch_lines (
    batch_id TEXT NOT NULL,
    line BIGINT NOT NULL,
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    generation_id TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    not_before DOUBLE PRECISION NOT NULL DEFAULT 0,
    ok INTEGER,
    result TEXT,
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX IF NOT EXISTS kiln_batch_lines_custom ON kiln_batch_lines (batch_id, custom_id);
CREATE INDEX IF NOT EXISTS kiln_batch_lines_state ON kiln_batch_lines (batch_id, state, line);
"""

SQLITE_TABLES = TABLES.format(blob="BLOB")
POSTGRES_TABLES = TABLES.format(blob="BYTEA")


def prepare_sqlite(path: Path) -> None:
    """Make the tables in the SQLite file (those already there are left as they are)."""
    conn = sqlite3.connect(path, timeout=5.0, isolation_level=None)
    try:
        conn.executescript(SQLITE_TABLES)
    finally:
        conn.close()


class BatchDb(SQLiteDb):
    """The SQLite file on a connection of the Batch API's own: ``synchronous=NORMAL`` (in WAL, a commit
    survives the process being killed, which is what a batch's durability asks; a line's outcome is
    committed twice per line, and a full sync of each would bound a batch to the disk's syncs)."""

    async def open(self) -> None:
        try:
            await asyncio.to_thread(prepare_sqlite, self.path)
            self._conn = await aiosqlite.connect(self.path, timeout=5.0, isolation_level=None)
            for pragma in ("synchronous=NORMAL", "wal_autocheckpoint=0"):
                await self._conn.execute_fetchall(f"PRAGMA {pragma}")
        except (sqlite3.Error, OSError) as exc:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
            raise StorageError(f"cannot open the database {str(self.path)!r}: {exc}") from None
        self._conn.row_factory = sqlite3.Row
