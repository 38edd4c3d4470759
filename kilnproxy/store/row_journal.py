"""``RowJournal``: a lone usage row made durable by one append to a file, before its store has it.

On a loop that serves one request at a time, a one-row SQLite commit is most of
what the gateway adds to a response's latency: the loop reaches it with cold
caches, and it writes three b-tree pages as six frame writes between six lock
calls. One JSON line appended to a file costs a few µs. So ``LoopCommits``
appends a lone row here (``append``), its response ends at once, and the loop
commits the row to SQLite at its next iteration, as it would have. Against a
killed gateway the line is as durable as a WAL commit at ``synchronous=NORMAL``
(neither is fsynced): the next start inserts every row of the file whose id the
table lacks (``kilnproxy.store.sqlite.ledger.replay_journal``), then empties it.

On PostgreSQL a lone row's settlement is a round trip and the server's WAL
flush: the store appends the row here, beside its spool, and the settlement
follows (``kilnproxy.store.postgres.store``); the next start settles what the file
holds (settlement is idempotent by id).

The file is ``<database>-rows`` (the SQLite ledger's file, or the spool's), one
JSON object per line, the row's columns. It is emptied once every row in it is
committed and it holds ``EMPTY_AT_BYTES``, and removed at a stop that committed
every row. Only one gateway appends to it (an exclusive ``flock``): a second
one on the same file leaves it alone. An append that fails (a full disk, an
I/O error, a short write, a value JSON cannot hold) returns False: that row
waits for its commit, as every row did before the journal, and appends stop
until the rows already in the file are committed and the file is emptied. A
file deleted or replaced under the gateway (``check``: every half second on
SQLite, at each heartbeat on PostgreSQL) is likewise left once its rows are
committed, and made anew.
"""

from __future__ import annotations

import fcntl
import logging
import os
from os import write as _write
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("kilnproxy.ledger")

EMPTY_AT_BYTES = 1 << 20  # the file is emptied once this big and every row in it is committed

_dumps = orjson.dumps
_NEWLINE = orjson.OPT_APPEND_NEWLINE


def journal_path(database: Path) -> Path:
    return Path(f"{database}-rows")


class RowJournal:
    def __init__(self, database: Path):
        self.database = database
        self.path = journal_path(database)
        self.uncommitted = 0  # rows appended whose commit is not done yet
        self.size = 0  # bytes in the file
        self.usable = False  # whether ``append`` writes (opened, and no failed append since it was emptied)
        self._fd: int | None = None
        self._id: tuple[int, int] | None = None  # (device, inode) of the file open
        self._error = ""  # the last failure said in the log

    def open(self) -> None:
        """Open the file for appends, emptied (its rows are in the table: they were replayed). A file that
        cannot be opened, or that another gateway has open (an exclusive ``flock``), leaves the journal
        unusable, said once: rows wait for their commits."""
        self.close()
        fd = None
        try:
            mode = _mode_of(self.database)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, mode)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # emptied only once no other gateway appends to it
            os.ftruncate(fd, 0)
            st = os.fstat(fd)
        except OSError as exc:
            if fd is not None:
                os.close(fd)
            self._failed("another gateway has it open" if isinstance(exc, BlockingIOError)
                         else f"cannot open it: {exc}")
            return
        self._fd = fd
        self._id = (st.st_dev, st.st_ino)
        self.size = 0
        self.usable = True

    def append(self, row: dict[str, Any]) -> bool:
        """Append ``row`` as one line; True once the whole line is in the file, else False (module docstring)."""
        if not self.usable:
            return False
        try:
            line = _dumps(row, option=_NEWLINE)
        except orjson.JSONEncodeError:  # an integer past 64 bits, say: SQLite's writer stores it as text
            return False
        try:
            written = _write(self._fd, line)
        except OSError as exc:
            self._failed(str(exc))
            return False
        self.size += written
        if written != len(line):  # part of a line: nothing after it until the file is emptied
            self._failed(f"a short write ({written} of {len(line)} bytes)")
            return False
        self.uncommitted += 1
        return True

    def committed(self, rows: int) -> None:
        """``rows`` appended rows are committed to SQLite."""
        self.uncommitted -= rows
        if not self.uncommitted and self.size >= EMPTY_AT_BYTES:
            self._empty()

    def check(self) -> None:
        """The half-second check: a file deleted or replaced is left, and appends stop until its rows are
        committed; a journal unusable with every row committed is made anew."""
        if self.usable and self._id != _file_id(self.path):
            self._failed("the file was deleted or replaced")
        if not self.usable and not self.uncommitted:
            self.open()
            if self.usable and self._error:
                log.warning("usage ledger: appending rows to %s again", self.path)
                self._error = ""

    def close(self, keep: bool = False) -> None:
        """Close the file; remove it unless ``keep`` (rows in it that were not committed: the next start
        inserts them) or a row appended is not committed."""
        if self._fd is None:
            return
        remove = not keep and not self.uncommitted and self._id == _file_id(self.path)
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = None
        self.usable = False
        if remove:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _empty(self) -> None:
        try:
            os.ftruncate(self._fd, 0)
        except OSError as exc:
            self._failed(f"cannot empty it: {exc}")
            return
        self.size = 0

    def _failed(self, error: str) -> None:
        self.usable = False
        if error != self._error:
            self._error = error
            log.error("usage ledger: %s: %s; rows wait for their commits instead", self.path, error)


def _mode_of(database: Path) -> int:
    """The database's permission bits, as SQLite gives its -wal and -shm; 0o600 before it exists (a spool
    that never held a row)."""
    try:
        return os.stat(database).st_mode & 0o666
    except FileNotFoundError:
        return 0o600


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def read_rows(path: Path) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The rows of a journal file left by a gateway, and the lines that are not one (a line cut short by
    a power cut); no file: nothing."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], []
    rows, bad = [], []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            row.setdefault("upstream", None)  # a row journaled by a kilnproxy before the column
            row.setdefault("batch_id", None)
            rows.append(row)
        else:
            bad.append(line)
    return rows, bad
