"""The spool: usage rows kept in a local SQLite file while PostgreSQL is out of reach.

A row goes in when its batch could not be settled in PostgreSQL, and comes
out only after a later settlement of it has committed there (settlement is
idempotent by id, so a row that did reach PostgreSQL before the connection
broke is not charged twice). The file outlives the process: a replica
restarted during an outage flushes what its previous run spooled.

Every method is synchronous; the store calls them in a thread, and from
more than one at a time (its writer adds rows while its heartbeat flushes):
they take turns on the file's one connection (``_turn``), or a BEGIN of one
would land in the other's transaction, and its rollback undo the other's rows.

A file damaged while no replica had it open (a disk error, a copy cut short)
is refused at ``open`` (``Damaged``, after SQLite's ``quick_check``) rather
than read in part: its rows are the operator's to recover.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any, Collection

from ...usage import COLUMNS
from ..sqlite.inserts import ADD, values
from ..sqlite.schema import LOCK_WAIT_SECONDS, SCHEMA, add_missing_columns



class Damaged(Exception):
    """The spool's file cannot be read as a whole (the reason is SQLite's)."""


class Spool:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._db: sqlite3.Connection | None = None
        self._turn = threading.Lock()

    def open(self) -> int:
        """Open (creating) the file; returns the rows it already holds."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=LOCK_WAIT_SECONDS, isolation_level=None,
                                   check_same_thread=False)
        try:
            self._check()
        except BaseException:
            self.close()
            raise
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # a committed row survives the process being killed
        self._db.executescript(SCHEMA)
        add_missing_columns(self._db)
        return self.count()

    def _check(self) -> None:
        try:
            check = self._db.execute("PRAGMA quick_check").fetchall()
        except sqlite3.OperationalError:  # cannot read or lock the file: not a matter of its content
            raise
        except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
            raise Damaged(str(exc)) from None
        if check != [("ok",)]:
            raise Damaged(check[0][0])

    def add(self, rows: list[dict[str, Any]]) -> None:
        with self._turn, self._db:
            self._db.execute("BEGIN")
            self._db.executemany(ADD, [values(r) for r in rows])

    def take(self, limit: int, skip: Collection[str] = ()) -> list[dict[str, Any]]:
        """The oldest ``limit`` rows but those of ids in ``skip``, still in the spool."""
        with self._turn:
            cur = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_events"
                                   f" WHERE id NOT IN ({', '.join('?' * len(skip))}) ORDER BY rowid LIMIT ?",
                                   (*skip, limit))
            return [dict(zip(COLUMNS, r)) for r in cur.fetchall()]

    def remove(self, ids: list[str]) -> None:
        with self._turn, self._db:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM usage_events WHERE id = ?", [(i,) for i in ids])

    def count(self) -> int:
        with self._turn:
            return self._db.execute("SELECT count(*) FROM usage_events").fetchone()[0]

    def close(self) -> None:
        with self._turn:
            if self._db is not None:
                self._db.close()
                self._db = None
