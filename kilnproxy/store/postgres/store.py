"""``PostgresStore``: the ledger and the admission state of several replicas, in PostgreSQL.

Every replica started with the same ``[storage] url`` shares, through it, the
in-flight slots, the credit holds, the spending and the usage rows (several replicas (docs/reference.md)).

* Admission (``admit``) is one round trip, shared by the requests admitted
  at the same moment: ``kiln_admit`` takes the org's admission lock, counts
  its live holds, checks its credits and inserts the hold, for each in turn.
* Settlement is a group commit, as the SQLite writer does: one task takes
  every row submitted meanwhile and calls ``kiln_settle`` once, which deletes
  their holds, inserts them and adds their cost to the orgs' spending in one
  transaction, idempotent by generation id. A request awaits its row's
  commit before its response ends; the row of a request served alone
  (``journal_when``), with no settlement under way, is appended to the row
  journal (``kilnproxy.store.row_journal``, ``<spool_path>-rows``) instead,
  and its settlement follows. Until that settlement commits, this replica's
  admissions wait for it and its reads (``_read``) too, so that the replica
  counts the request as settled as soon as its response ended; a start
  settles what a killed run left in the journal (``_replay_journal``).
* Liveness (``kilnproxy.store.postgres.replicas``): a heartbeat every few seconds; the
  holds of a replica silent for ``replica_timeout_seconds`` stop counting and
  are turned into ``replica_lost`` rows by a surviving replica.
* Outage: with PostgreSQL out of reach the store is down (``available`` and
  ``refuses_requests`` false): new requests get 503 ``store_unavailable`` at
  once, without waiting for their rows (``kilnproxy.proxy.request_path``, up
  to ``MAX_WAITING_ROWS`` rows waiting), and rows that cannot be settled go to
  the spool (``kilnproxy.store.postgres.spool``), flushed once the database answers
  again (``kilnproxy.store.postgres.spool_flush``). A spool that cannot be written is
  tried again, and PostgreSQL with it; at a stop, rows neither takes are
  written to the log (``not_committed``).
  A database that answers but refuses the gateway's statements (read-only, a
  full disk, a lock held past ``LOCK_TIMEOUT``, a dropped table) is down the
  same way (``down_error``); only an error of the batch itself (its data, a
  deadlock) leaves the store up, and so does a lock on one org's row of
  ``kiln_orgs``: that org alone is set aside (``kilnproxy.store.postgres.org_locks``).
  The store is up again once a heartbeat and a settlement of spooled rows have
  both passed (``Heartbeat.beat``): a database that answers reads but still
  refuses rows does not make it flap.
* Every statement is bounded on both sides: PostgreSQL ends one that waits for
  a lock past ``LOCK_TIMEOUT`` or runs past ``SERVER_STATEMENT_TIMEOUT`` (the
  session's settings), before the client gives up at ``STATEMENT_TIMEOUT``. A
  statement the client gave up on would otherwise go on in the server, its
  locks held, and might commit a hold for a request already answered 503.

Nothing holds a connection across a stream. The admitter and the writer each
keep a connection of their own for their statements (``kilnproxy.store.postgres.pinned``:
a round trip costs no borrowing); every other statement borrows one from a
small pool and gives it back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import orjson

from ...config import Config
from ...errors import GatewayError, StorageError
from ...usage import COLUMNS
from . import spool_flush
from ..batches import Batches, GroupCommitted
from ..limits import Counts, Credits, Hold, insufficient_credits, key_limit_exceeded, per_minute_exceeded, rate_limited
from .org_locks import OrgLocks, org_locked
from .pinned import Pinned
from .schema import migrate
from .replicas import Heartbeat
from ..row_journal import RowJournal, read_rows
from .spool import Damaged, Spool
from .sqlstates import database_state

log = logging.getLogger("kilnproxy.ledger")


class OneLine(logging.Filter):
    """asyncpg's pool logs a traceback at each failed reconnect while PostgreSQL is away, which the
    gateway reports in its own line: its records keep the exception's type and message, one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", ()
            record.exc_info = record.exc_text = None
        return True


logging.getLogger("asyncpg.pool").addFilter(OneLine())

POOL_SIZE = 5  # besides the admitter's and the writer's own connections (``Pinned``)
STATEMENT_TIMEOUT = 3.0  # seconds: a database that does not answer is treated as out of reach
LOCK_TIMEOUT = 2.0  # seconds a statement may wait for a lock, in the server (another session's lock)
SERVER_STATEMENT_TIMEOUT = 2.5  # seconds a statement may run, in the server: ended there before the client's
REMIND_SECONDS = 60.0  # while down, how often the log says so again
SPOOL_RETRY_SECONDS = 0.2  # while the spool cannot be written, how often it (and PostgreSQL) is tried again
LAST_TRY_SECONDS = 5.0  # at a stop, how long rows that neither PostgreSQL nor the spool takes are still tried
# Rows waiting (in memory and in the spool) past which a request refused while the store is down gets
# no row: a long outage under traffic does not fill the spool's disk with refusals (about 60 MB).
MAX_WAITING_ROWS = 200_000
CONNECT_TIMEOUT = 5.0
# What a lost connection raises. InternalClientError: asyncpg's protocol state after a session was
# terminated mid-statement (MagicStack/asyncpg#1069); the pool's connections are then replaced.
UNREACHABLE = (OSError, asyncio.TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
               asyncpg.OperatorInterventionError, asyncpg.InternalClientError)


def down_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the store cannot take statements now (rather than this batch failed):
    out of reach, or PostgreSQL refusing them (read-only, a full disk, a lock or statement timeout,
    too many connections, a password or a table gone)."""
    if isinstance(exc, UNREACHABLE):
        return True
    return isinstance(exc, asyncpg.PostgresError) and database_state(exc.sqlstate)


# Only the columns read, in the order ``admit`` unpacks them (not ``r_id``: a string decoded a row for nothing).
ADMIT = "SELECT r_verdict, r_spent FROM kiln_admit($1::jsonb, $2, $3)"
SELECT_ROW = f"SELECT {', '.join(COLUMNS)} FROM usage_events WHERE id = $1"
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


def _per_minute(hold: Hold, item: dict[str, Any]) -> None:
    """The hold's per-minute bounds, as ``kiln_admit`` reads them, into its admission's ``item``
    (absent: no bound; ``kiln_admit`` reads a missing key as NULL)."""
    for name, rpm, tpm in hold.per_minute:
        who = "org" if name.startswith("org:") else "key"
        item[f"{who}_rpm"], item[f"{who}_tpm"] = rpm, tpm


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = netloc[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))


def store_unavailable() -> GatewayError:
    return GatewayError(503, "store_unavailable",
                        "The gateway's database cannot be reached. Retry with exponential backoff.",
                        type="service_unavailable")


class PostgresStore(GroupCommitted):
    """``Ledger`` and ``Admission`` on PostgreSQL (see the module's docstring)."""

    STATEMENT_TIMEOUT = STATEMENT_TIMEOUT
    UNREACHABLE = UNREACHABLE

    def __init__(self, config: Config, credits: Credits,
                 on_commit: Callable[[list[tuple[dict, Any]]], None] | None = None):
        self.url = config.storage.url
        self.timeout = config.storage.replica_timeout_seconds
        self.credits = credits
        self.on_commit = on_commit
        self.tell_rows = False  # True (the inspector): each settlement NOTIFYs ROWS_CHANNEL of its rows' ids
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.spool = Spool(config.spool_path)
        self.journal = RowJournal(Path(config.spool_path))  # ``<spool_path>-rows``
        # whether the request submitting a row is the only one in progress (``journal_when``)
        self.alone: Callable[[], bool] = lambda: False
        self.journaled: dict[str, asyncio.Future] = {}  # id -> settlement of a row whose response ended at its append
        self.pool: asyncpg.Pool | None = None
        self.available = False  # the last statement reached the database
        # the same, read by the request path: while down, new requests are refused at once
        # (``kilnproxy.proxy.request_path.refused_while_down``), their rows not awaited
        self.refuses_requests = False
        self.max_waiting_rows = MAX_WAITING_ROWS
        self.refused = 0  # requests refused while down (this outage), with a row
        self.refused_unrecorded = 0  # requests refused without a row: max_waiting_rows were waiting (ever)
        self.not_committed: list[dict[str, Any]] = []  # rows given up at a stop (and written to the log)
        self._give_up_at: float | None = None  # loop time, once stopping, past which rows are given up
        self._spooling = 0  # rows the writer is putting in the spool
        self.heartbeat = Heartbeat(self)
        self.counts = Counts()  # this replica's requests in flight, for metrics
        self.rows = Batches(self._commit, "kilnproxy-ledger-writer", self._committed)
        self.admissions = Batches(self._admit, "kilnproxy-admitter")
        self.writer = Pinned(self)  # the connection of ``rows``' task
        self.admitter = Pinned(self)  # the connection of ``admissions``' task
        self._flushing = asyncio.Lock()
        self.spooled = 0  # rows in the spool
        self.stuck: set[str] = set()  # ids of spooled rows PostgreSQL refused, set aside (spool_flush)
        self.settle_error: BaseException | None = None  # why the last failed settlement failed, the store up
        self.org_locks = OrgLocks(LOCK_TIMEOUT)  # orgs whose row another session keeps locked: set aside
        self.locked_now = False  # the last failed settlement found an org's row locked (``org_locks``)
        self.commit_failures = 0
        self._down_since: float | None = None  # loop time the store went down (None: up)
        self._said_at = 0.0  # loop time the log last said the store is down

    # -- life cycle -------------------------------------------------------------

    async def open(self) -> None:
        try:
            conn = await asyncpg.connect(self.url, timeout=CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
            raise StorageError(f"cannot connect to PostgreSQL at {redacted(self.url)}: {self._reason(exc)}"
                               " (check [storage] url, the password and that the server is running)") from None
        try:
            await migrate(conn)
            await conn.execute("INSERT INTO kiln_orgs (org) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING",
                               sorted(self.credits.granted))
        except asyncpg.PostgresError as exc:
            raise StorageError(f"cannot set up the schema in {redacted(self.url)}: {self._reason(exc)}") from None
        finally:
            await conn.close()
        self.pool = await asyncpg.create_pool(
            self.url, min_size=1, max_size=POOL_SIZE, timeout=CONNECT_TIMEOUT, reset=_nothing_to_reset,
            server_settings=self._session())
        await self.heartbeat.beat()
        try:
            self.spooled = await asyncio.to_thread(self.spool.open)
        except Damaged as exc:
            await self.pool.close()
            raise StorageError(f"the spool {str(self.spool.path)!r} is damaged ({exc}): move it aside and start "
                               "again; its rows can be saved with `sqlite3 FILE .recover` into a new file, then "
                               "`kilnproxy import-ledger NEWFILE`") from None
        except Exception as exc:
            await self.pool.close()
            raise StorageError(f"cannot open the spool {str(self.spool.path)!r}: {exc}"
                               " (check [storage] spool_path and its permissions)") from None
        await self._replay_journal()
        self.journal.open()
        self.rows.start()
        self.admissions.start()
        self.heartbeat.start()
        if self.spooled:
            log.warning("%d usage rows spooled by an earlier run; settling them now", self.spooled)
            await self.flush_spool()

    def _session(self) -> dict[str, str]:
        return {"application_name": f"kilnproxy {self.replica}",
                "lock_timeout": str(int(LOCK_TIMEOUT * 1000)),
                "statement_timeout": str(int(SERVER_STATEMENT_TIMEOUT * 1000))}

    async def connect(self) -> asyncpg.Connection:
        """A new connection of this replica, outside the pool (``Pinned``)."""
        return await asyncpg.connect(self.url, timeout=CONNECT_TIMEOUT, server_settings=self._session())

    async def close(self) -> None:
        """Settle everything submitted (into the spool if the database is out of reach), then disconnect.
        Rows that neither takes for ``LAST_TRY_SECONDS`` are written to the log, one JSON line each
        (``not_committed``)."""
        self._give_up_at = asyncio.get_running_loop().time() + LAST_TRY_SECONDS
        await self.rows.close()
        await self.heartbeat.stop()
        await self.admissions.close()
        await self.writer.close()
        await self.admitter.close()
        if self.available:
            await self.flush_spool()
            await self.attempt("execute", "DELETE FROM kiln_replicas WHERE id = $1 AND NOT EXISTS"
                               " (SELECT 1 FROM kiln_holds WHERE replica = $1)", self.replica)
        if self.pool is not None:
            try:
                await asyncio.wait_for(self.pool.close(), STATEMENT_TIMEOUT)
            except (asyncio.TimeoutError, *UNREACHABLE):
                self.pool.terminate()
            self.pool = None
        self.spool.close()
        self.journal.close(keep=bool(self.not_committed))
        if self.not_committed:
            log.error("stopping with usage rows neither PostgreSQL nor the spool %s took: %d; each follows on a line "
                      "of its own, 'usage row not committed: ' and the row as JSON", self.spool.path,
                      len(self.not_committed))
            for row in self.not_committed:
                log.error("usage row not committed: %s", orjson.dumps(row, default=str).decode())

    def _reason(self, exc: BaseException) -> str:
        return _reason(exc, urlsplit(self.url).password)

    # -- admission (request rule 5 (docs/reference.md)) -------------------------------------------------

    async def admit(self, hold: Hold, limit: int) -> None:
        """One ``kiln_admit`` for every request admitted at the same moment. A request cancelled
        while waiting may still get its hold; its row, submitted as always, deletes it."""
        if not self.available:
            raise store_unavailable()
        # an org set aside: its rows cannot be charged, and served it would keep its slot and hold
        if self.org_locks.orgs and hold.org in self.org_locks.orgs:
            raise org_locked(hold.org)
        item = {
            "id": hold.id, "org": hold.org, "limit": limit, "granted": self.credits.granted.get(hold.org, 0.0),
            "amount": hold.amount, "prompt_cost": hold.prompt_cost, "prompt_tokens": hold.prompt_tokens,
            "created_at": hold.created_at, "key_id": hold.key_id, "model": hold.model, "endpoint": hold.endpoint,
            "stream": hold.stream, "key_limit": hold.key_limit, "key_since": hold.key_since, "tokens": hold.tokens}
        if hold.per_minute:
            _per_minute(hold, item)
        verdict, spent = await self.admissions.add(item)
        self.credits.spent[hold.org] = spent
        if verdict == "rate_limited":
            raise rate_limited(hold.org, limit)
        if verdict == "insufficient_credits":
            raise insufficient_credits(hold.org, holding=True)
        if verdict in ("org_per_minute", "key_per_minute"):
            raise per_minute_exceeded(f"org:{hold.org}" if verdict == "org_per_minute" else f"key:{hold.key_id}")
        if verdict == "key_limit_exceeded":
            raise key_limit_exceeded(hold.key_id, hold.key_limit)
        self.counts.taken(hold.org)

    async def _admit(self, holds: list[dict[str, Any]]) -> list[asyncpg.Record]:
        """Each hold's (verdict, spending of its org), in the order of ``holds``."""
        await self._journal_settled_all()  # this replica's requests whose responses ended count as settled
        if not self.available:  # went down while these waited for the batch before: refused at once
            raise store_unavailable()
        try:
            verdicts = await self.admitter.run("fetch", ADMIT, orjson.dumps(holds).decode(), self.replica,
                                               self.timeout)
        except (*UNREACHABLE, asyncpg.PostgresError) as exc:
            if not self.lost(exc):  # a deadlock: these requests get 503, the next batch is tried anew
                log.error("admission of %d requests failed: %s", len(holds), exc)
            raise store_unavailable() from None
        return verdicts  # records of (r_verdict, r_spent): unpacked as pairs

    async def rehold(self, hold: Hold, new: Hold) -> None:
        """A fallback's prices: one ``kiln_rehold`` round trip under the org's admission lock."""
        if not self.available:
            raise store_unavailable()
        try:
            row = await self.run("fetchrow", "SELECT * FROM kiln_rehold($1::jsonb, $2)", orjson.dumps({
                "id": hold.id, "org": hold.org, "granted": self.credits.granted.get(hold.org, 0.0),
                "amount": new.amount, "prompt_cost": new.prompt_cost, "prompt_tokens": new.prompt_tokens,
                "key_id": hold.key_id, "model": new.model, "requested_model": hold.model,
                "key_limit": hold.key_limit, "key_since": hold.key_since}).decode(), self.timeout)
        except (*UNREACHABLE, asyncpg.PostgresError) as exc:
            if not self.lost(exc):
                log.error("re-placing the hold of %s failed: %s", hold.id, exc)
            raise store_unavailable() from None
        self.credits.spent[hold.org] = row["r_spent"]
        if row["r_verdict"] == "insufficient_credits":
            raise insufficient_credits(hold.org, holding=True)
        if row["r_verdict"] == "key_limit_exceeded":
            raise key_limit_exceeded(hold.key_id, hold.key_limit)

    def keeps_refused_rows(self) -> bool:
        """While down: whether the row of a request refused now can still wait (``max_waiting_rows``)."""
        return self.queue_depth() + self._spooling + self.spooled < self.max_waiting_rows

    def release(self, hold: Hold) -> None:
        """Local bookkeeping only: the hold's row in PostgreSQL goes with the request's row."""
        self.counts.given_back(hold.org)

    def settled(self, hold: Hold | None, row: dict[str, Any]) -> None:
        """Nothing to keep here: ``kiln_admit`` reads a key's spending from its rows, and the rows'
        settlement (``kiln_settle``) settles their per-minute tokens."""

    def count(self, org: str) -> int:
        return self.counts.count(org)

    def snapshot(self) -> dict[str, int]:
        return self.counts.snapshot()

    # -- settlement ---------------------------------------------------------------

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

    async def _journal_settled_all(self) -> None:
        """Return once every row journaled so far is settled (or spooled, or given up)."""
        if self.journaled:
            await asyncio.wait(list(self.journaled.values()))

    async def _replay_journal(self) -> None:
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
        if self.available and not self.org_locks.orgs and await self._settle(rows, self.writer.run):
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
        way: the rows left out (``[]``: all committed), or ``None`` when none committed (``_settle``)."""
        aside: list[dict[str, Any]] = []
        while True:
            rows, held = self.org_locks.split(rows)
            aside += held
            if not rows or await self._settle(rows, run, say):
                return aside
            if not self.locked_now:  # each round sets aside at least one more org of ``rows``
                return None

    async def _settle(self, rows: list[dict[str, Any]], run=None, say: bool = True) -> bool:
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
        self._load_spent(spent)
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

    # -- reachability ----------------------------------------------------------------

    def lost(self, exc: BaseException) -> bool:
        """A statement failed with ``exc``: if it means the store cannot take statements now
        (``down_error``), the store is down (the log says so when it goes down, then once every
        ``REMIND_SECONDS``). Whether it does."""
        if not down_error(exc):
            return False
        self.heartbeat.in_touch_since = None
        now = asyncio.get_running_loop().time()
        reason = self._why(exc)
        if self.available:
            self.available = False
            self.refuses_requests = True
            self.refused = 0
            self._down_since = self._said_at = now
            log.error("%s; new requests get 503 store_unavailable, rows are spooled", reason)
            self.heartbeat.poke()
        elif now - self._said_at >= REMIND_SECONDS:
            self._said_at = now
            log.error("still down after %.0f s: %s; usage rows spooled: %d", now - (self._down_since or now),
                      reason, self.spooled)
        return True

    def _why(self, exc: BaseException) -> str:
        """What the log says of a store down because of ``exc``."""
        if isinstance(exc, asyncpg.LockNotAvailableError):
            return (f"PostgreSQL refuses the gateway's statements: a lock held by another session for more "
                    f"than {LOCK_TIMEOUT:g} s ({self._reason(exc)})")
        if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
            return f"PostgreSQL refuses the gateway's statements: the database is read-only ({self._reason(exc)})"
        if isinstance(exc, asyncpg.PostgresError) and not isinstance(exc, UNREACHABLE):
            return f"PostgreSQL refuses the gateway's statements ({type(exc).__name__}: {self._reason(exc)})"
        return f"PostgreSQL is out of reach ({self._reason(exc)})"

    async def run(self, method: str, sql: str, *args):
        """``conn.<method>(sql, *args)`` on a pooled connection; borrowing it, the statement and giving
        it back all bounded by ``STATEMENT_TIMEOUT`` (raises one of ``UNREACHABLE`` past it)."""
        async with asyncio.timeout(2 * STATEMENT_TIMEOUT):  # not wait_for: it can lose a cancellation (tasks.py)
            async with self.pool.acquire(timeout=STATEMENT_TIMEOUT) as conn:
                return await getattr(conn, method)(sql, *args, timeout=STATEMENT_TIMEOUT)

    async def attempt(self, method: str, sql: str, *args):
        """``run``, or ``None`` when the store cannot take statements (marked down: ``lost``)."""
        try:
            return await self.run(method, sql, *args)
        except (*UNREACHABLE, asyncpg.PostgresError) as exc:
            if not self.lost(exc):
                raise
            return None

    async def expire_connections(self) -> None:
        """After a failure none of the connections is to be trusted: the pool's are replaced at their
        next use, the admitter's and the writer's at their next statement."""
        await self.pool.expire_connections()
        self.writer.expire()
        self.admitter.expire()

    def reached(self) -> None:
        """A heartbeat and a settlement passed: the store is up."""
        if self._down_since is not None:  # (not at start-up)
            log.warning("PostgreSQL takes rows again after %.1f s; new requests are served again (%d refused "
                        "meanwhile)", asyncio.get_running_loop().time() - self._down_since, self.refused)
            self._down_since = None
        self.available, self.refuses_requests = True, False

    def _load_spent(self, records: Iterable[asyncpg.Record]) -> None:
        for org, spent in records:
            self.credits.spent[org] = spent

    # -- reads -------------------------------------------------------------------------

    async def spent_by_org(self) -> dict[str, float]:
        return dict(await self.run("fetch", "SELECT org, spent FROM kiln_orgs"))

    async def org_spent(self, org: str) -> float:
        """Every replica's spending of ``org`` (``SUM(cost)`` of its rows); 503 when out of reach."""
        value = await self._read("fetchval", "SELECT spent FROM kiln_orgs WHERE org = $1", org)
        self.credits.spent[org] = value or 0.0
        return value or 0.0

    async def get(self, generation_id: str) -> dict[str, Any] | None:
        row = await self._read("fetchrow", SELECT_ROW, generation_id)
        return dict(row) if row is not None else None

    async def fetch(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """Rows of a read query written with ``?`` placeholders (the SQLite style)."""
        return [dict(r) for r in await self._read("fetch", numbered(sql), *params)]

    async def _read(self, method: str, sql: str, *args):
        """A read of the store that sees the row of every response this replica has ended (their
        settlements are waited for: ``journaled``)."""
        await self._journal_settled_all()
        if not self.available:
            raise store_unavailable()
        try:
            return await self.run(method, sql, *args)
        except asyncpg.QueryCanceledError:  # ran past the statement timeout: this read, not the store
            raise GatewayError(503, "store_unavailable", "The gateway's database did not answer this query "
                               f"within {SERVER_STATEMENT_TIMEOUT:g} s; ask for less (a shorter span) or retry.",
                               type="service_unavailable") from None
        except (*UNREACHABLE, asyncpg.PostgresError) as exc:
            if not self.lost(exc):
                raise
            raise store_unavailable() from None

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "spooled": self.spooled, "store_up": int(self.available),
                "refused_unrecorded": self.refused_unrecorded}


async def _nothing_to_reset(conn: asyncpg.Connection) -> None:
    """The pool's check-in: the store changes no session state (only ``SET LOCAL``), so the
    round trip of asyncpg's default reset (``RESET ALL; UNLISTEN *; ...``) is saved."""


def numbered(sql: str) -> str:
    """``?`` placeholders as PostgreSQL's ``$1, $2, ...`` (the queries hold no literal ``?``)."""
    parts = sql.split("?")
    return "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)) + parts[-1]


def _reason(exc: BaseException, secret: str | None = None) -> str:
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    return text.replace(secret, "***") if secret else text
