"""``Ledger``: the usage store as the request path sees it, one row per request.

``kilnproxy.store.sqlite.ledger.SQLiteLedger`` is the store of one gateway process,
``kilnproxy.store.postgres.store.PostgresStore`` the one of several replicas.

The request path calls ``submit(row)``, which never blocks and never raises:
the row goes on a queue and a future is returned. Everything queued is
inserted in one transaction and the futures resolved: on SQLite, by the event
loop's own thread once per loop iteration (``kilnproxy.store.sqlite.loop_commits``;
a commit there is a WAL append that never waits for a lock nor fsyncs), else,
and on PostgreSQL always, by one writer task (``kilnproxy.store.batches``).
The request awaits its future before the response ends, so a response a client
saw end always has its row on disk (WAL, ``synchronous=NORMAL``: a committed
transaction survives the gateway being killed; only a power cut could lose the
last ones). A lone row's future resolves once the row is appended to the row
journal, as durable, and its commit follows: on SQLite at the loop's next
turn, on PostgreSQL at once (``kilnproxy.store.row_journal``). A failed commit (a lock held by another program, a full disk) is
retried with the same rows; none is dropped, and the responses wait. A value
SQLite cannot bind is stored as text rather than wedge every later commit.
A store that takes no rows for a while says so (``available`` false) and asks
for new requests to be refused at once (``refuses_requests``); see
``kilnproxy.store.sqlite.ledger``. Every member of ``Ledger`` is implemented
by both stores, with a neutral value where a store has no such thing (no
``pool`` on SQLite, no ``file_users`` on PostgreSQL): the request path reads
them as plain attributes, never with ``getattr``.

The ledger is a store, not a plugin, and ``record_usage`` plugins are told of
each row after its commit (``on_commit``, then the gateway's notifier task).
Why not make the SQLite writer the built-in ``record_usage`` plugin: the row
must be committed before the response ends and the request awaits exactly that,
which a hook call (pluggy is synchronous, its order set by registration) cannot
promise; a slow or failing plugin must never delay a response nor lose a row;
plugins should only ever see rows that are on disk (what ``GET
/v1/generations/{id}`` and credits will show); and spending is read back from the
store at start-up, so the store is chosen by the gateway (``Gateway(ledger=...)``),
not by whichever plugins happen to load.

WAL checkpoints run in the background (``checkpoint.Checkpointer``): a
commit is one group commit and never a checkpoint's copy and fsyncs.

``stats()`` gives ops metrics for free: rows queued, transactions and rows
committed, failed attempts, and the last commit's duration.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable, Protocol

from ..errors import GatewayError

CommitListener = Callable[[list[tuple[dict[str, Any], Any]]], None]

CANNOT_WRITE_MESSAGE = "The gateway cannot write its usage database. Retry with exponential backoff."
UNREACHABLE_MESSAGE = "The gateway's database cannot be reached. Retry with exponential backoff."


def store_unavailable(message: str = CANNOT_WRITE_MESSAGE) -> GatewayError:
    """503 ``store_unavailable``, the one answer of a store that cannot serve now, ``message`` saying why:
    a new request while the store is down (``refuses_requests``; the default message), PostgreSQL out of
    reach (``UNREACHABLE_MESSAGE``), a read past its time, an org whose row is locked."""
    return GatewayError(503, "store_unavailable", message, type="service_unavailable")


class Ledger(Protocol):
    """What the gateway needs of a usage store (SQLite, or PostgreSQL for several replicas)."""

    available: bool
    """Whether the store takes rows now (``/healthz``, ``kilnproxy_store_up``): false while SQLite has
    not committed for a while, or PostgreSQL cannot take statements."""

    refuses_requests: bool
    """True while the store is down and new requests are to be refused at once with 503
    ``store_unavailable`` (``kilnproxy.proxy.request_path.refused_while_down``); read on every request,
    so a plain attribute the store sets when it goes down and comes back."""

    refused: int
    """Requests refused while down (this outage) with a row; counted by the request path."""

    refused_unrecorded: int
    """Requests refused without a row (``keeps_refused_rows`` was false); counted by the request path."""

    journaled: dict[str, "asyncio.Future[None]"]
    """Generation id -> the commit of each row whose response ended at its row-journal append, until
    that commit (``kilnproxy.store.row_journal``); a read that must see every row ended waits for these.
    Empty while no row is journaled."""

    pool: Any
    """The shared store's connection pool (an ``asyncpg.Pool``), on which the gateway opens its
    tenancy store; None on SQLite, whose file the tenancy store opens itself."""

    file_users: list[Any] | None
    """Other connections of this process to the store's file (each with ``pause`` and ``resume``,
    ``kilnproxy.store.sqlite.reopen.FileUser``), closed and opened again with the ledger's own when its
    files are deleted: whoever opens one appends it, and removes it once closed. None on PostgreSQL
    (no file)."""

    not_committed: list[dict[str, Any]]
    """Rows given up at a stop (each also written to the log): the process then exits with an error."""

    @property
    def commits(self) -> int:
        """Group commits so far (``kilnproxy_ledger_commits``)."""

    async def open(self) -> None:
        """Connect and prove the store can be written; ``StorageError`` (one line) if not."""

    async def close(self) -> None:
        """Commit everything submitted so far, then disconnect."""

    def submit(self, row: dict[str, Any], tag: Any = None) -> "asyncio.Future[None]":
        """Queue ``row`` (the columns of ``usage.COLUMNS``); never blocks, never raises.
        The future resolves once the row is durable."""

    def journal_when(self, alone: Callable[[], bool]) -> None:
        """Append a lone row to the row journal only while ``alone()`` (the request submitting it is the
        only one in progress, ``kilnproxy.ops.lifecycle``); until called, never (PostgreSQL) or whenever
        a row is lone (SQLite)."""

    def keeps_refused_rows(self) -> bool:
        """While down: whether the row of a request refused now can still wait (in memory, or the
        spool) rather than be left out."""

    async def spent_by_org(self) -> dict[str, float]:
        """``SUM(cost)`` per org, read at start-up for credits."""

    async def org_spent(self, org: str) -> float | None:
        """``org``'s spending as a shared store has it (every replica's rows; the gateway's credits are
        brought up to it), 503 ``store_unavailable`` when out of reach; None on a store of one process,
        whose spending is the gateway's own count (``Credits.spent``)."""

    async def get(self, generation_id: str) -> dict[str, Any] | None:
        """The committed row of that id, or ``None``."""

    async def fetch(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """The rows of a read query written with ``?`` placeholders (the same SQL on both stores), seeing
        the row of every response this process has ended; 503 ``store_unavailable`` when out of reach."""

    def queue_depth(self) -> int:
        """Rows submitted and not yet being committed."""

    def stats(self) -> dict[str, float]:
        """Numbers for ops metrics (``queue_depth`` at least)."""
