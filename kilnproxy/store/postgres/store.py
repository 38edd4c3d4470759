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
  settles what a killed run left in the journal (``replay_journal``). Admission is
  ``kilnproxy.store.postgres.admission``, settlement ``kilnproxy.store.postgres.settlement``.
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
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

import asyncpg
import orjson

from ...config import Config
from ...errors import StorageError
from ...usage import COLUMNS
from .admission import Admitting
from ..batches import Batches, GroupCommitted
from ..ledger import UNREACHABLE_MESSAGE, store_unavailable
from ..limits import Counts, Credits
from .connection import (CONNECT_TIMEOUT, LOCK_TIMEOUT, POOL_SIZE, REMIND_SECONDS, SERVER_STATEMENT_TIMEOUT,
                         STATEMENT_TIMEOUT, UNREACHABLE, down_error, nothing_to_reset, numbered, reason,
                         redacted, session_settings)
from .org_locks import OrgLocks
from .pinned import Pinned
from .schema import migrate
from .replicas import Heartbeat
from ..row_journal import RowJournal
from .settlement import Settling
from .spool import Damaged, Spool

log = logging.getLogger("kilnproxy.ledger")

LAST_TRY_SECONDS = 5.0  # at a stop, how long rows that neither PostgreSQL nor the spool takes are still tried
# Rows waiting (in memory and in the spool) past which a request refused while the store is down gets
# no row: a long outage under traffic does not fill the spool's disk with refusals (about 60 MB).
MAX_WAITING_ROWS = 200_000
SELECT_ROW = f"SELECT {', '.join(COLUMNS)} FROM usage_events WHERE id = $1"


class PostgresStore(Admitting, Settling, GroupCommitted):
    """``Ledger`` and ``Admission`` on PostgreSQL (see the module's docstring)."""

    STATEMENT_TIMEOUT = STATEMENT_TIMEOUT
    UNREACHABLE = UNREACHABLE
    file_users = None  # (``Ledger.file_users``) no file: nothing to open again with the store's connections

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
            self.url, min_size=1, max_size=POOL_SIZE, timeout=CONNECT_TIMEOUT, reset=nothing_to_reset,
            server_settings=session_settings(self.replica))
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
        await self.replay_journal()
        self.journal.open()
        self.rows.start()
        self.admissions.start()
        self.heartbeat.start()
        if self.spooled:
            log.warning("%d usage rows spooled by an earlier run; settling them now", self.spooled)
            await self.flush_spool()

    async def connect(self) -> asyncpg.Connection:
        """A new connection of this replica, outside the pool (``Pinned``)."""
        return await asyncpg.connect(self.url, timeout=CONNECT_TIMEOUT, server_settings=session_settings(self.replica))

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
        return reason(exc, urlsplit(self.url).password)

    def keeps_refused_rows(self) -> bool:
        """While down: whether the row of a request refused now can still wait (``max_waiting_rows``)."""
        return self.queue_depth() + self._spooling + self.spooled < self.max_waiting_rows

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

    def load_spent(self, records: Iterable[asyncpg.Record]) -> None:
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
        await self.journal_settled_all()
        if not self.available:
            raise store_unavailable(UNREACHABLE_MESSAGE)
        try:
            return await self.run(method, sql, *args)
        except asyncpg.QueryCanceledError:  # ran past the statement timeout: this read, not the store
            raise store_unavailable("The gateway's database did not answer this query within "
                                    f"{SERVER_STATEMENT_TIMEOUT:g} s; ask for less (a shorter span) or retry.") from None
        except (*UNREACHABLE, asyncpg.PostgresError) as exc:
            if not self.lost(exc):
                raise
            raise store_unavailable(UNREACHABLE_MESSAGE) from None

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "spooled": self.spooled, "store_up": int(self.available),
                "refused_unrecorded": self.refused_unrecorded}
