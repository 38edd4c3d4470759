"""``LoopCommits``: usage rows committed on the event loop's own thread, the writer thread as fallback.

An ``aiosqlite`` call costs about 40 µs of CPU and a thread hop of 0.1 ms or so
of latency; the same one-row INSERT on the loop's thread costs a microsecond or
two. So the SQLite ledger commits rows here, on a plain ``sqlite3`` connection:

- Group commit on the loop: every row submitted in one loop iteration waits
  for one ``call_soon``'d flush, which inserts them all in one transaction.
  While the loop is busy (the last commit held more than one row), a flush
  that finds fewer than ``GATHER_ROWS`` waits one more loop iteration for
  the rows it brings: a commit costs less a row the more it holds (on a
  core that touched 1 MiB of memory between commits, 8.0 µs a row at 8
  rows, 5.7 at 16, 4.6 at 32), and a busy loop's iteration is a
  small part of a response's wait. A lone row (the last commit's too) is
  committed at the first flush.
- Never a wait on the loop: the connection has ``busy_timeout`` 0 and
  ``synchronous=NORMAL`` (a commit is a WAL append, no fsync), and WAL
  checkpoints are someone else's (``wal_autocheckpoint=0``; the
  ``Checkpointer``). Whatever might wait or fsync is handed to the writer
  thread (a ``Batches`` over the ledger's aiosqlite connection) instead:

  * the database is busy or locked (another program's transaction, a
    checkpoint taking a lock), or the commit failed in any way: the writer
    retries it as it always did (``commit_failures``, no row dropped);
  * ``must_hand_off()`` says so: the WAL is past its size bound (the writer
    restarts it first) or would start again from its first frame, whose
    header SQLite fsyncs.

- Order and exactly-once: a flush that failed rolled back, so its rows are
  handed off whole and committed once, by the writer; and while any row is
  with the writer, later rows follow it there, so rows are committed in the
  order they were submitted.

Each future resolves once its row is committed (by whichever thread did it),
and ``committed`` is told of each batch after its commit, as with ``Batches``.
A lone row (its request the only one in progress, ``alone``; nothing else
queued; the last commit lone too; no row with the writer; the commit due on
the loop) is first appended to the ``RowJournal``: its future resolves at
once, and the row is committed as any other; ``journaled`` holds its own
commit future by id until then (a lookup of the row waits for it). Under
load rows never go there: they share group commits as above, and the journal
costs them nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Callable

from ..batches import Batches
from ..row_journal import RowJournal

log = logging.getLogger("kilnproxy.ledger")

GATHER_ROWS = 16  # fewer rows than this wait one more loop iteration, while the loop is busy


class LoopCommits:
    def __init__(self, insert: Callable[[list[dict[str, Any]]], None], writer: Batches,
                 committed: Callable[[list[tuple[dict[str, Any], Any]]], None],
                 must_hand_off: Callable[[], bool], journal: RowJournal | None = None):
        """``insert(rows)`` commits ``rows`` in one transaction on this thread, or raises with
        nothing committed (rolled back)."""
        self.journal = journal
        # whether the request submitting a row is the only one in progress (``SQLiteLedger.journal_when``)
        self.alone: Callable[[], bool] = lambda: True
        self.journaled: dict[str, asyncio.Future] = {}  # id -> commit of a row whose future resolved at its append
        self._insert = insert
        self._writer = writer
        self._committed = committed
        self._must_hand_off = must_hand_off
        self._pending: list[tuple[dict[str, Any], asyncio.Future, Any]] = []
        self._flush_due = False
        self.last_rows = 0  # rows in the last flush: more than one, the loop is busy
        self.with_writer = 0  # rows handed to the writer thread, not yet committed
        self.commits = 0  # transactions committed on the loop
        self.rows_committed = 0
        self.rows_handed_off = 0
        self.last_commit_seconds = 0.0
        # the loop the store serves on, set by its open(): asyncio.get_running_loop() makes a getpid
        # system call on every call
        self.loop: asyncio.AbstractEventLoop | None = None

    def add(self, row: dict[str, Any], tag: Any = None) -> asyncio.Future:
        """Queue ``row`` for this iteration's flush; never blocks, never raises."""
        loop = self.loop or asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((row, future, tag))
        if not self._flush_due:
            self._flush_due = True
            loop.call_soon(self._due, loop)
        if (self.last_rows <= 1 and len(self._pending) == 1 and not self.with_writer and self.journal is not None
                and self.alone() and not self._must_hand_off() and self.journal.append(row)):
            self.journaled[row["id"]] = future
            future = loop.create_future()
            future.set_result(None)
        return future

    def _due(self, loop: asyncio.AbstractEventLoop, waited: bool = False) -> None:
        """The flush a loop iteration after the first row came, or one more later (module docstring)."""
        if not waited and self.last_rows > 1 and len(self._pending) < GATHER_ROWS:
            loop.call_soon(self._due, loop, True)
            return
        self.flush()

    def queue_depth(self) -> int:
        return len(self._pending)

    def flush(self) -> None:
        """Commit everything queued, here if nothing stands in the way, else by the writer."""
        self._flush_due = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        self.last_rows = len(batch)
        if not self.with_writer and not self._must_hand_off():
            started = time.perf_counter()
            try:
                self._insert([row for row, _, _ in batch])
            except Exception as exc:  # busy, locked, full disk, odd values: the writer's job
                log.debug("usage ledger: %d rows go to the writer thread: %s", len(batch), exc)
            else:
                self.last_commit_seconds = time.perf_counter() - started
                self.commits += 1
                self.rows_committed += len(batch)
                for _, future, _ in batch:
                    if not future.done():
                        future.set_result(None)
                if self.journaled:
                    for row, future, _ in batch:
                        self._journal_committed(row, future)
                self._committed([(row, tag) for row, _, tag in batch])
                return
        self._hand_off(batch)

    def _hand_off(self, batch: list[tuple[dict[str, Any], asyncio.Future, Any]]) -> None:
        self.rows_handed_off += len(batch)
        self.with_writer += len(batch)
        for row, future, tag in batch:
            self._writer.add(row, tag).add_done_callback(functools.partial(self._written, row, future))

    def _written(self, row: dict[str, Any], future: asyncio.Future, written: asyncio.Future) -> None:
        self.with_writer -= 1
        if future.done():  # its request stopped waiting; the row is committed all the same
            return
        if written.cancelled() or written.exception() is not None:
            journaled = self.journaled.get(row["id"]) is future
            if journaled:  # nobody awaits it but a lookup; its line stays in the file, for the next start
                del self.journaled[row["id"]]
            if written.cancelled() or journaled:
                future.cancel()
            else:
                future.set_exception(written.exception())
            return
        future.set_result(written.result())
        self._journal_committed(row, future)

    def _journal_committed(self, row: dict[str, Any], future: asyncio.Future) -> None:
        if self.journaled.get(row["id"]) is future:
            del self.journaled[row["id"]]
            self.journal.committed(1)
