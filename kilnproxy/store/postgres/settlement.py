"""Settlement on PostgreSQL: ``PostgresStore``'s rows, from ``submit`` to committed (or spooled).

A group commit, as the SQLite writer does: one task (``rows``, a ``Batches``, on
the writer's own connection) takes every row submitted meanwhile and calls
``kiln_settle`` once, which deletes their holds, inserts them and adds their
cost to the orgs' spending in one transaction, idempotent by generation id.
The row of a request served alone (``journal_when``), with no settlement under
way, is appended to the row journal (``kilnproxy.store.row_journal``) instead,
and its settlement follows (``journaled``); until it commits, this replica's
admissions and reads wait for it (``journal_settled_all``). A start settles
what a killed run left there (``replay_journal``). Rows that cannot be settled
go to the spool (``kilnproxy.store.postgres.spool``); the rows of an org whose
row another session keeps locked are set aside (``kilnproxy.store.postgres.org_locks``).
With ``tell_rows`` (the inspector), each settlement NOTIFYs ``ROWS_CHANNEL`` of
its rows' ids (``row_notices``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable

import asyncpg
import orjson

from . import spool_flush
from ..row_journal import read_rows
from .connection import REMIND_SECONDS, UNREACHABLE

log = logging.getLogger("kilnproxy.ledger")

SPOOL_RETRY_SECONDS = 0.2  # while the spool cannot be written, how often it (and PostgreSQL) is tried again
SETTLE = "SELECT * FROM kiln_settle($1::jsonb, $2)"
# The same, and in its transaction (so delivered at its commit, and only if it commits) one NOTIFY per
# notice of ``row_notices``: the inspectors of the other replicas show the rows as they are committed.
SETTLE_AND_TELL = ("SELECT * FROM kiln_settle($1::jsonb, $2)"
                   " WHERE (SELECT count(pg_notify($3, n)) FROM unnest($4::text[]) n) >= 0")
ROWS_CHANNEL = "kiln_rows"
NOTICE_BYTES = 7900  # a NOTIFY payload must stay under 8000 bytes


def row_notices(replica: str, ids: list[str]) -> list[str]:
    """``"<replica> <id> <id> ..."``, as few as fit under ``NOTICE_BYTES`` each."""
    notices, start = [], len(replica.encode())
    notice, size = [replica], start  # a notice's parts and its length in bytes so far
    for generation_id in ids:
        length = len(generation_id.encode()) + 1
        if size + length > NOTICE_BYTES and len(notice) > 1:
            notices.append(" ".join(notice))
            notice, size = [replica], start
        notice.append(generation_id)
        size += length
    return notices + [" ".join(notice)]


class Settling:
    """``PostgresStore``'s settlement (its attributes: ``rows``, ``writer``, ``journal``, ``journaled``, ``alone``,
    ``spool``, ``org_locks``, ``available``, ``tell_rows``, ``replica``; its ``lost``, ``run``, ``attempt``)."""

    def journal_when(self, alone: Callable[[], bool]) -> None:
        """Append a lone row to the row journal only while ``alone()``: the request submitting it is the
        only one in progress."""
        self.alone = alone

    def submit(self, row: dict[str, Any], tag: Any = None) -> asyncio.Future:
        """Queue ``row``; the future resolves once it is durable: settled (or spooled), or, for a lone
        row, appended to the row journal (``kilnproxy.store.row_journal``), its settlement under way."""
        settled = self.rows.add(row, tag)
        if self.available and self.rows.lone() and self.alone() and self.journal.append(row):
            self.journaled[row["id"]] = settled
            settled.add_done_callback(functools.partial(self._journal_settled, row["id"]))
            settled = settled.get_loop().create_future()
            settled.set_result(None)
        return settled

    def _journal_settled(self, generation_id: str, settled: asyncio.Future) -> None:
        del self.journaled[generation_id]
        if not settled.cancelled() and settled.exception() is None:
            self.journal.committed(1)  # else its line stays in the file, for the next start

    async def journal_settled_all(self) -> None:
        """Return once every row journaled so far is settled (or spooled, or given up)."""
        if self.journaled:
            await asyncio.wait(list(self.journaled.values()))

    async def replay_journal(self) -> None:
        """Settle (or spool) the rows of the row journal a replica using this spool left: killed between
        a response and its row's settlement. Settlement is idempotent by id: a row already settled is
        not charged again, a ``replica_lost`` row of it is replaced."""
        rows, bad = await asyncio.to_thread(read_rows, self.journal.path)
        for line in bad:
            log.error("usage ledger: a line of %s is not a usage row, left out: %r", self.journal.path, line[:200])
        if rows:
            await self._commit(rows)
            log.warning("%d usage rows of responses that ended before the gateway stopped were in %s; settled",
                        len(rows), self.journal.path)

    async def _commit(self, rows: list[dict[str, Any]]) -> None:
        """Rows are durable once settled in PostgreSQL, or else in the spool (those of an org set
        aside, ``org_locks``, go there at once)."""
        if self.available and not self.org_locks.orgs and await self.settle(rows, self.writer.run):
            return  # (the common case: one statement, no sorting of rows)
        # an org set aside before, or found locked just now: the other orgs' rows are settled
        aside = (await self._settle_around(rows, self.writer.run)
                 if self.available and self.org_locks.orgs else None)
        if aside is None:
            await self._spool(rows)
        elif aside:
            await self._spool(aside)

    async def _settle_around(self, rows: list[dict[str, Any]], run=None,
                             say: bool = True) -> list[dict[str, Any]] | None:
        """Settle ``rows`` but those of orgs set aside (``org_locks``), including any found locked on the
        way: the rows left out (``[]``: all committed), or ``None`` when none committed (``settle``)."""
        aside: list[dict[str, Any]] = []
        while True:
            rows, held = self.org_locks.split(rows)
            aside += held
            if not rows or await self.settle(rows, run, say):
                return aside
            if not self.locked_now:  # each round sets aside at least one more org of ``rows``
                return None

    async def settle(self, rows: list[dict[str, Any]], run=None, say: bool = True) -> bool:
        """One ``kiln_settle`` transaction (sent with ``run``, by default ``self.run``); False when it
        did not commit (the rows must be kept): ``settle_error`` says why, unless the store is down or
        an org's row is locked (``locked_now``: that org is set aside). A refusal is logged if ``say``."""
        run = run or self.run
        self.locked_now = False
        try:
            body = orjson.dumps(rows).decode()
            if self.tell_rows:
                spent = await run("fetch", SETTLE_AND_TELL, body, self.replica, ROWS_CHANNEL,
                                  row_notices(self.replica, [r["id"] for r in rows]))
            else:
                spent = await run("fetch", SETTLE, body, self.replica)
        except (*UNREACHABLE, asyncpg.PostgresError) as exc:
            self.commit_failures += 1
            self.settle_error = None
            if isinstance(exc, asyncpg.LockNotAvailableError) and await self._orgs_locked(rows, run):
                return False
            if not self.lost(exc):  # a deadlock, a value refused: kept in the spool and retried
                self.settle_error = exc
                if say:
                    log.error("usage settlement of %d rows failed, spooled for a retry: %s", len(rows), exc)
            return False
        except Exception as exc:  # a bug must not stop the writer: the rows are spooled, the responses go on
            self.commit_failures += 1
            self.settle_error = exc
            log.exception("usage settlement of %d rows failed, spooled for a retry", len(rows))
            return False
        self.load_spent(spent)
        self.org_locks.settled(rows)
        return True

    async def _orgs_locked(self, rows: list[dict[str, Any]], run) -> bool:
        """After a lock timeout: whether some org of ``rows`` has its row locked (set aside, ``locked_now``)
        rather than the store refusing statements. A probe that fails says nothing."""
        try:
            self.locked_now = bool(await self.org_locks.probe(run, rows))
        except (*UNREACHABLE, asyncpg.PostgresError):
            self.locked_now = False
        return self.locked_now

    async def _spool(self, rows: list[dict[str, Any]]) -> None:
        """Keep ``rows`` in the spool. While it cannot be written (a full disk), the responses waiting
        for them wait: it is tried again every ``SPOOL_RETRY_SECONDS``, and so is PostgreSQL once
        the store is up; the log says so once, when the error changes, then once a minute. Stopping,
        rows are given up after ``LAST_TRY_SECONDS`` (``not_committed``)."""
        self._spooling = len(rows)
        try:
            await self._keep(rows)
        finally:
            self._spooling = 0

    async def _keep(self, rows: list[dict[str, Any]]) -> None:
        loop = asyncio.get_running_loop()
        failing_since = said_at = None
        error = ""
        while True:
            try:
                await asyncio.to_thread(self.spool.add, rows)
            except Exception as exc:
                self.commit_failures += 1
                now = loop.time()
                if failing_since is None or str(exc) != error or now - said_at >= REMIND_SECONDS:
                    log.error("cannot write %d usage rows to the spool %s: %s; tried again every %g s, and "
                              "PostgreSQL once it is up; the responses waiting for them wait", len(rows),
                              self.spool.path, exc, SPOOL_RETRY_SECONDS)
                    said_at = now
                failing_since, error = failing_since or now, str(exc)
                if self._give_up_at is not None and now >= self._give_up_at:
                    self.not_committed += rows
                    return
                await asyncio.sleep(SPOOL_RETRY_SECONDS)
                aside = await self._settle_around(rows, self.writer.run) if self.available else None
                if aside is not None and len(aside) < len(rows):
                    log.warning("%d usage rows the spool could not take are settled in PostgreSQL",
                                len(rows) - len(aside))
                    if not aside:
                        return
                    rows = aside
                continue
            self.spooled += len(rows)
            if failing_since is not None:
                log.warning("the spool takes rows again after %.1f s", loop.time() - failing_since)
            return

    async def tell_reaped(self) -> None:
        """Rows were reaped (``replica_lost``): ``"<replica> *"`` tells every inspector to reload its list."""
        if self.tell_rows:
            await self.attempt("execute", "SELECT pg_notify($1, $2)", ROWS_CHANNEL, f"{self.replica} *")

    async def flush_spool(self, batches: int | None = None) -> bool:
        """Settle the spooled rows in PostgreSQL (``kilnproxy.store.postgres.spool_flush``)."""
        async with self._flushing:
            return await spool_flush.flush(self, batches)
