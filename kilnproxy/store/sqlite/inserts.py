"""Rows into the SQLite ledger's table: the INSERT statements, their parameters, and the row journal replayed.

A commit inserts up to ``ROWS_PER_INSERT`` rows per statement (every size up to it stays in
``sqlite3``'s statement cache); ``insert_sync`` is the loop's commit (``loop_commits``), the writer
thread's the same statements on aiosqlite (``SQLiteLedger._insert``). ``replay_journal`` inserts
the rows a killed gateway left in the row journal (``kilnproxy.store.row_journal``).
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
from operator import itemgetter
from pathlib import Path
from typing import Any

import orjson

from ...usage import COLUMNS
from ..row_journal import read_rows as read_journal
from .schema import LOCK_WAIT_SECONDS

log = logging.getLogger("kilnproxy.ledger")

_VALUES = f"({', '.join('?' * len(COLUMNS))})"
ADD = f"INSERT OR IGNORE INTO usage_events ({', '.join(COLUMNS)}) VALUES {_VALUES}"  # a row there is left as it is
REPLAY = ADD
# A row written again (its id there) replaces the one there, as an UPDATE: its triggers keep the spend
# rollup in step, which a REPLACE's delete would not fire (``spend_rollup``).
_UPSERT = (f" ON CONFLICT (id) DO UPDATE SET ({', '.join(COLUMNS[1:])})"
           f" = ({', '.join('excluded.' + c for c in COLUMNS[1:])})")
INSERT = f"INSERT INTO usage_events ({', '.join(COLUMNS)}) VALUES {_VALUES}"
ROWS_PER_INSERT = 64  # rows in one INSERT statement; every size up to it stays in sqlite3's statement cache


@functools.lru_cache(maxsize=None)
def insert_rows(n: int) -> str:
    return INSERT + f", {_VALUES}" * (n - 1) + _UPSERT


values = itemgetter(*COLUMNS)  # row dict -> tuple in column order

COLUMN_LIST = list(COLUMNS)


def params(rows: list[dict[str, Any]]) -> list[Any]:
    """The rows' values, one flat list in column order. A row whose keys are the columns in their
    order (``RequestRecord.row``'s) is read as it is: one pass over its values, not 19 lookups."""
    params: list[Any] = []
    for row in rows:
        params += row.values() if list(row) == COLUMN_LIST else values(row)
    return params


def insert_sync(db: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
    """``rows`` in one transaction on an autocommit ``sqlite3`` connection."""
    if len(rows) <= ROWS_PER_INSERT:
        db.execute(insert_rows(len(rows)), params(rows))
        return
    db.execute("BEGIN IMMEDIATE")
    for start in range(0, len(rows), ROWS_PER_INSERT):
        part = rows[start:start + ROWS_PER_INSERT]
        db.execute(insert_rows(len(part)), params(part))
    db.execute("COMMIT")


def replay_journal(path: Path, journal: Path) -> int:
    """Insert every row of the ``RowJournal`` file a gateway left (killed between a response and its
    row's commit) whose id ``usage_events`` lacks, then empty the file; the number inserted. A line that
    is not a row (cut short by a power cut) and a row the table refuses are written to the log as the
    rows a stop could not commit are."""
    rows, bad = read_journal(journal)
    if not rows and not bad:
        return 0
    db = sqlite3.connect(path, timeout=LOCK_WAIT_SECONDS, isolation_level=None)
    inserted = 0
    try:
        db.execute("BEGIN IMMEDIATE")
        for row in rows:
            try:
                inserted += db.execute(REPLAY, [row.get(c) for c in COLUMNS]).rowcount
            except sqlite3.Error as exc:
                log.error("usage row not committed: %s (%s)", orjson.dumps(row).decode(), exc)
        db.execute("COMMIT")
    finally:
        db.close()
    for line in bad:
        log.error("usage ledger: a line of %s is not a usage row, left out: %r", journal, line[:200])
    if inserted:
        log.warning("usage ledger: %d usage rows of responses that ended before the gateway stopped were in %s; "
                    "inserted", inserted, journal)
    os.truncate(journal, 0)
    return inserted


def storable(value: Any) -> Any:
    if type(value) is int:
        return value if -2**63 <= value < 2**63 else str(value)
    return value if value is None or isinstance(value, (float, str)) else str(value)
