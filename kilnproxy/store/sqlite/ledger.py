"""``SQLiteLedger``: the usage ledger of one gateway process, one SQLite row per request
(the ``Ledger`` contract of ``kilnproxy.store.ledger``), written by group commit in WAL mode:
on the event loop's thread when the file is free (``loop_commits``), else by the writer thread.
A lone row is first appended to the row journal (``row_journal``), which ``open`` replays.

When the file cannot be written (a full disk, a read-only file system, another program's lock
held for long, a disk that hangs), the writer retries the same rows every ``RETRY_SECONDS``
and the responses waiting for them wait; the rows wait in memory. The log says so once when
it starts, once more when the error changes, then once a minute; not at each retry. Once no
commit has succeeded for ``DOWN_AFTER_SECONDS``, the ledger is *down* (``refuses_requests``,
``available`` false: ``/healthz`` and ``/metrics`` say so) and the gateway refuses new requests
with 503 ``store_unavailable`` at once rather than serve what it could not account for
(``kilnproxy.proxy.request_path``); their rows wait in memory with the others, up to
``max_waiting_rows`` rows, past which a refusal gets no row and no generation id. The first
commit that succeeds ends it, by itself. A stop (``close``) retries for ``LAST_TRY_SECONDS``
more, then gives up: the rows not committed are written to the log, one JSON line each, and
kept in ``not_committed`` (the process then exits with an error saying how many).

A -wal, -shm or database file deleted under the gateway is noticed within ``WATCH_SECONDS``:
the rows committed into the deleted file are saved into the database and every connection of
the process to the file is opened anew (``kilnproxy.store.sqlite.reopen``). The file's table and
its making are ``schema``'s, the INSERT statements ``inserts``'.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import aiosqlite
import orjson

from ...tasks import cancelled
from ..batches import Batches, GroupCommitted
from .checkpoint import Checkpointer
from ..ledger import CommitListener, store_unavailable
from .inserts import ROWS_PER_INSERT, insert_rows, insert_sync, replay_journal, storable, values
from .loop_commits import LoopCommits
from .reopen import WATCH_SECONDS, FileUser, Reopening, file_ids
from ..row_journal import RowJournal
from .schema import LOCK_WAIT_SECONDS, cannot_open, connect_for_the_loop, prepare_file

log = logging.getLogger("kilnproxy.ledger")

DOWN_AFTER_SECONDS = 5.0  # no commit for this long (failing, or one blocked): the ledger is down
MAX_WAITING_ROWS = 50_000  # rows kept in memory while down (about 80 MB) before refusals get no row
LAST_TRY_SECONDS = 5.0  # at a stop, how long rows that cannot be committed are still retried
REMIND_SECONDS = 60.0  # while down, how often the log says so again


class SQLiteLedger(Reopening, GroupCommitted):
    """Rows are committed on the loop's thread (``self.here``) on a plain ``sqlite3`` connection,
    handed to the writer thread (``self.rows``, aiosqlite) whenever that could wait or fsync.
    While the file cannot be written, see the module's docstring."""

    RETRY_SECONDS = 0.2
    pool = None  # (``Ledger.pool``) no connection pool: the tenancy store opens the file itself

    def __init__(self, path: Path, on_commit: CommitListener | None = None,
                 checkpointer: Checkpointer | None = None, inspector_tables: bool = True):
        self.path = Path(path)
        self.inspector_tables = inspector_tables  # the file gets the inspector's tables (``schema.prepare_file``)
        self.on_commit = on_commit
        self.checkpointer = checkpointer or Checkpointer(self.path)
        self._db: aiosqlite.Connection | None = None
        self._loop_db: sqlite3.Connection | None = None
        self.rows = Batches(self._commit, "kilnproxy-ledger-writer", self._committed)
        self.journal = RowJournal(self.path)
        self.here = LoopCommits(self._insert_here, self.rows, super()._committed,
                                self.checkpointer.loop_must_hand_off, self.journal)
        self.commit_failures = 0
        self._last_here = False  # whether the last commit was the loop's (else the writer's)
        # The file that cannot be written (module docstring). Times are time.monotonic().
        self.available = True  # False while down
        self.refuses_requests = False  # the same, read by the request path: refuse new requests at once
        self.max_waiting_rows = MAX_WAITING_ROWS
        self.refused = 0  # requests refused while down (this outage), with a row
        self.refused_unrecorded = 0  # requests refused without a row: max_waiting_rows were waiting (ever)
        self.not_committed: list[dict[str, Any]] = []  # rows given up at a stop (and written to the log)
        self._failing_since: float | None = None  # the start of the first failed attempt of this outage
        self._failures = 0  # failed attempts this outage
        self._error = ""  # the last failure's message
        self._attempt_started: float | None = None  # the writer's commit under way (a disk that hangs)
        self._in_commit = 0  # rows of the writer's commit under way
        self._reminded = 0.0
        self._give_up_at: float | None = None  # set by close
        self._watch_task: asyncio.Task | None = None
        # The files deleted under the gateway (``_reopen``): other connections of this process to the
        # file (the tenancy store's, the inspector's), closed while the ledger opens it anew.
        self.file_users: list[FileUser] = []
        self._files: tuple = ()  # (device, inode) of the database, its -wal and -shm as opened
        self._file_lock = asyncio.Lock()  # the writer's commits, and opening the file anew
        self._reopen_error = ""  # why the file could not be opened anew (said once), or "replaced"
        self._reopening: asyncio.Future | None = None

    async def open(self) -> None:
        try:
            await self._connect()
            await asyncio.to_thread(replay_journal, self.path, self.journal.path)
        except (sqlite3.Error, OSError) as exc:
            await self._close_connections()
            raise cannot_open(self.path, exc) from None
        self.journal.open()
        await self.checkpointer.start()
        self._files = file_ids(self.path)
        self.here.loop = asyncio.get_running_loop()
        self.rows.start()
        self._watch_task = asyncio.create_task(self._watch(), name="kilnproxy-ledger-watch")

    async def _connect(self) -> None:
        # Checked with plain sqlite3 first: aiosqlite's thread outlives a failed connect.
        await asyncio.to_thread(prepare_file, self.path, self.inspector_tables)
        self._loop_db = await asyncio.to_thread(connect_for_the_loop, self.path)
        # autocommit: one INSERT of many rows is one transaction and one trip to the db thread
        self._db = await aiosqlite.connect(self.path, timeout=LOCK_WAIT_SECONDS, isolation_level=None)
        for pragma in ("synchronous=NORMAL", "wal_autocheckpoint=0"):  # checkpoints: the Checkpointer's job
            # fetchall: a statement left unfinished holds a read snapshot, and no checkpoint could end
            await self._db.execute_fetchall(f"PRAGMA {pragma}")
        self._db.row_factory = sqlite3.Row

    @property
    def journaled(self) -> dict[str, asyncio.Future]:
        """id -> commit, of each row whose response ended at its journal append, until it is committed."""
        return self.here.journaled

    def journal_when(self, alone: Callable[[], bool]) -> None:
        """Append a lone row to the row journal only while ``alone()``: the request submitting it is the
        only one in progress (the gateway's count of them). Without this call, whenever a row is lone."""
        self.here.alone = alone

    def submit(self, row: dict[str, Any], tag: Any = None) -> asyncio.Future:
        """Queue ``row`` for this loop iteration's commit; the future resolves once it is durable."""
        return self.here.add(row, tag)

    def queue_depth(self) -> int:
        """Rows submitted and not committed yet (those of the writer's commit under way included)."""
        return self.here.queue_depth() + self.rows.queue_depth() + self._in_commit

    def keeps_refused_rows(self) -> bool:
        """While down: whether the row of a request refused now can still wait in memory."""
        return self.queue_depth() < self.max_waiting_rows

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
                "rows_handed_to_writer": self.here.rows_handed_off,
                "refused_unrecorded": self.refused_unrecorded}

    def _insert_here(self, rows: list[dict[str, Any]]) -> None:
        """One transaction on the loop's connection; raises (rolled back) if it cannot commit now."""
        self._last_here = True
        try:
            insert_sync(self._loop_db, rows)
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
        """Insert ``rows`` in one transaction, retried until it succeeds: no row is dropped (at a stop,
        one given up is kept in ``not_committed`` and written to the log by ``close``)."""
        self._last_here = False
        self._in_commit = len(rows)
        params = [values(r) for r in rows]
        try:
            while True:
                async with self._file_lock:  # not while the file is opened anew (nor that, while one is tried)
                    params = await self._attempt(params)
                if params is None:
                    if self._failing_since is not None or self.refuses_requests:
                        self._recovered()
                    return
                self.commit_failures += 1
                if self._give_up_at is not None and time.monotonic() >= self._give_up_at:
                    self.not_committed.extend(rows)  # the futures resolve: nobody waits for them any more
                    return
                await asyncio.sleep(self.RETRY_SECONDS)
        finally:
            self._in_commit = 0
            self._attempt_started = None

    async def _attempt(self, params: list[tuple]) -> list[tuple] | None:
        """One try: None once committed, else the values to try again with (rolled back)."""
        if self.checkpointer.over_bound():
            await self._restart_wal()
        self._attempt_started = time.monotonic()
        try:
            await self._insert(params)
            return None
        except sqlite3.OperationalError as exc:  # locked, disk full, read-only, I/O error: retry
            self._failed(len(params), exc)
        except (sqlite3.Error, OverflowError) as exc:  # a value SQLite cannot bind: store it as text
            log.error("usage ledger commit of %d rows failed, storing odd values as text: %s", len(params), exc)
            params = [tuple(map(storable, p)) for p in params]
        if self._db is not None:
            try:
                await self._db.rollback()
            except sqlite3.Error:
                pass
        return params

    def _failed(self, rows: int, exc: BaseException) -> None:
        """A failed attempt: logged at the first of an outage and when the error changes, not at each."""
        error = str(exc)
        if self._failing_since is None:
            self._failing_since = self._attempt_started
            self._failures = 0
            self._reminded = time.monotonic()
            log.error("usage ledger: cannot commit to %s: %s; retrying every %g s; rows waiting in memory: %d "
                      "(their responses wait too)", self.path, error, self.RETRY_SECONDS, self.queue_depth())
        elif error != self._error:
            log.error("usage ledger: still cannot commit, now: %s (rows waiting: %d)", error, self.queue_depth())
        self._error = error
        self._failures += 1

    def _recovered(self) -> None:
        since = self._failing_since if self._failing_since is not None else self._attempt_started
        log.warning("usage ledger: commits again after %.1f s and %d failed attempts (%s)%s",
                    time.monotonic() - since, self._failures, self._error or "a commit was blocked",
                    f"; new requests are served again ({self.refused} refused meanwhile)"
                    if self.refuses_requests else "")
        self._failing_since = None
        self._failures = 0
        self._error = ""
        self.refused = 0
        self.available = True
        self.refuses_requests = False

    async def _watch(self) -> None:
        """Down once no commit has succeeded for ``DOWN_AFTER_SECONDS``; said again once a minute. A file
        deleted under the gateway: opened anew (``_reopen``)."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            self._check(time.monotonic())
            self.journal.check()
            if self._reopening is not None and not self._reopening.done():
                continue
            if self._db is None or file_ids(self.path) != self._files:
                self._reopening = asyncio.ensure_future(self._reopen())  # a stop waits for it (``close``)
                self._reopening.add_done_callback(self._reopen_ended)

    def _check(self, now: float) -> None:
        since = self._failing_since if self._failing_since is not None else self._attempt_started
        if since is None or now - since < DOWN_AFTER_SECONDS:
            return
        if not self.refuses_requests:
            self.available = False
            self.refuses_requests = True
            self._reminded = now
            log.error("usage ledger: no commit for %.0f s (%s); new requests get 503 store_unavailable until "
                      "one succeeds; rows waiting in memory: %d", now - since, self._error or "a commit is blocked",
                      self.queue_depth())
        elif now - self._reminded >= REMIND_SECONDS:
            self._reminded = now
            log.error("usage ledger: still no commit after %.0f s (%s); rows waiting in memory: %d, requests "
                      "refused: %d", now - since, self._error or "a commit is blocked", self.queue_depth(),
                      self.refused)

    async def _restart_wal(self) -> None:
        """Start the WAL over in an empty file (``Checkpointer``: why empty), without waiting for a reader
        in the way (tried again later)."""
        try:
            await self._db.execute_fetchall("PRAGMA busy_timeout=0")
            try:
                (busy, _, _), = await self._db.execute_fetchall("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                await self._db.execute_fetchall(f"PRAGMA busy_timeout={int(LOCK_WAIT_SECONDS * 1000)}")
        except sqlite3.Error as exc:  # the commit goes on all the same
            self.checkpointer.restart_tried(False, str(exc))
            return
        self.checkpointer.restart_tried(not busy)

    async def _insert(self, values: list[tuple]) -> None:
        if self._db is None:
            raise sqlite3.OperationalError("the database is not open (it is being opened anew)")
        if len(values) <= ROWS_PER_INSERT:
            await self._db.execute(insert_rows(len(values)), [v for row in values for v in row])
            return
        await self._db.execute("BEGIN")
        for start in range(0, len(values), ROWS_PER_INSERT):
            part = values[start:start + ROWS_PER_INSERT]
            await self._db.execute(insert_rows(len(part)), [v for row in part for v in row])
        await self._db.execute("COMMIT")

    async def close(self) -> None:
        """Commit everything queued, then close the database. Rows that still cannot be committed
        after ``LAST_TRY_SECONDS`` are written to the log, one JSON line each (``not_committed``)."""
        self._watch_task = await cancelled(self._watch_task)
        if self._reopening is not None:  # the files being opened anew: let it end
            await asyncio.wait([self._reopening])
        self._give_up_at = time.monotonic() + LAST_TRY_SECONDS
        self.here.flush()
        await self.rows.close()
        self.journal.close(keep=bool(self.not_committed))
        if self._files:  # opened (the checkpointer started)
            await self.checkpointer.stop()
        await self._close_connections()
        if self.not_committed:
            log.error("usage ledger: stopping with usage rows not committed to %s (%s): %d; each follows on a line "
                      "of its own, 'usage row not committed: ' and the row as JSON", self.path, self._error,
                      len(self.not_committed))
            for row in self.not_committed:
                log.error("usage row not committed: %s", orjson.dumps(row, default=str).decode())

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

    async def org_spent(self, org: str) -> None:
        """None: the spending of one process's store is the gateway's own count (``Credits.spent``)."""
        return None

    async def get(self, generation_id: str) -> dict[str, Any] | None:
        """The row as committed: a row whose response ended before its commit (``RowJournal``) is
        committed first."""
        committing = self.here.journaled.get(generation_id)
        if committing is not None:
            self.here.flush()
            await asyncio.wait([committing])
        if self._db is None:  # being opened anew
            raise store_unavailable()
        async with self._db.execute("SELECT * FROM usage_events WHERE id = ?", (generation_id,)) as cur:
            row = await cur.fetchone()
        return dict(row) if row is not None else None

    async def fetch(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """Rows of a read query, seeing every row whose response ended (journaled rows committed first)."""
        if self.here.journaled:
            self.here.flush()
            await asyncio.wait(list(self.here.journaled.values()))
        if self._db is None:  # being opened anew
            raise store_unavailable()
        async with self._db.execute(sql, tuple(params)) as cur:
            return [dict(r) for r in await cur.fetchall()]
