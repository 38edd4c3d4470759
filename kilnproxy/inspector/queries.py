"""The inspector's reads of the usage ledger: pages of requests, one request, usage buckets.

Each query is written once for both stores (``?`` placeholders, explicit
column lists, nothing but SQL both SQLite and PostgreSQL read the same way)
and runs through a reader:

* ``SQLiteReader``: the inspector's own SQLite connection (WAL: readers never
  hold up the ledger's group commits); it creates the index and the tables
  below, once, and writes nothing else;
* ``SharedReader``: the PostgreSQL store's own pool (``PostgresStore.fetch``),
  so every replica's rows are seen; the same indexes are made by the store's
  schema (``kilnproxy.store.postgres.schema``). A database out of reach is a 503
  ``store_unavailable`` answer, as elsewhere.

With those indexes a page is a short index range scan however many rows the
table holds:

* no filter, and ``status=ok`` or a status below 400 (nearly every row matches):
  on PostgreSQL the time index ``usage_events_created``; on SQLite the
  inspector's own table ``inspector_times`` (time, rowid);
* org: ``usage_events_org_created`` (the ledger's), whatever else is filtered;
* model: on PostgreSQL ``usage_events_model_created``; on SQLite the inspector's
  own table ``inspector_models`` (model, time, rowid);
* ``status=error`` or an error status (400 and above): the partial index
  ``usage_events_errors_created``, which holds error rows only (so successful
  requests, nearly all of them, pay no write for it).

Usage buckets read the same time index or table (the org's index for an org).

On SQLite the ledger's table keeps only the indexes the gateway's own queries
need (``kilnproxy.store.sqlite.ledger``): every index is one more b-tree written in
every request's commit. The inspector's two tables (their primary keys are the
index; each entry is joined to its row by rowid, and must match the row's time
and model, so an entry of a row since deleted matches nothing) are filled when
the inspector reads them, in bulk, from the rows committed since its last read,
in the read's own transaction (``SQLiteReader.read_filled``): off the request
path, and at no cost while nobody looks.

Pages are newest first, ordered by ``(created_at, rowid)`` (on PostgreSQL,
whose indexes hold no rowid, rows of one same ``created_at`` are put in order
by an incremental sort, a few rows at a time); the cursor of a page's last row
(``<created_at>~<rowid>`` in base64url) asks for the rows before it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable, Protocol

import aiosqlite

from ..usage import COLUMNS

log = logging.getLogger("kilnproxy.inspector")

INDEXES = """
CREATE INDEX IF NOT EXISTS usage_events_errors_created ON usage_events (created_at) WHERE status >= 400;
CREATE TABLE IF NOT EXISTS inspector_times (
    created_at TEXT NOT NULL,
    rid INTEGER NOT NULL,
    PRIMARY KEY (created_at, rid)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS inspector_models (
    model TEXT NOT NULL,
    created_at TEXT NOT NULL,
    rid INTEGER NOT NULL,
    PRIMARY KEY (model, created_at, rid)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS inspector_filled (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    up_to INTEGER NOT NULL,
    up_to_id TEXT NOT NULL
);
"""
FILL_ROWS = 5_000  # rows copied into the inspector's tables per transaction: the ledger's commits wait no longer
FILL_WAIT_MS = 500  # how long a fill waits for the file's write lock (the ledger holds it a moment a commit)
READ_WAIT_MS = 10_000  # the reader's busy timeout otherwise

BUCKETS = {"minute": (16, timedelta(minutes=1)), "hour": (13, timedelta(hours=1)), "day": (10, timedelta(days=1))}
DEFAULT_SPAN = {"minute": 60, "hour": 48, "day": 30}  # buckets shown when ``since`` is not given
MAX_BUCKETS = 10_000
MAX_LIMIT = 500
MAX_ROWID = 2**63 - 1  # SQLite's INTEGER and PostgreSQL's BIGINT
MAX_TIME_CHARS = 64  # a cursor's time: the ledger writes 29 characters
SELECT_COLUMNS = ", ".join(COLUMNS)  # never ``*``: PostgreSQL's table has two columns more


class QueryError(ValueError):
    """A parameter the API cannot use; the message names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def page_query(org: str | None = None, model: str | None = None, status: str | None = None,
               before: str | None = None, limit: int = 50, own_tables: bool = False) -> tuple[str, list[Any]]:
    """The SQL of one page of requests, newest first (``limit + 1`` rows: the extra tells
    whether there is a next page). ``own_tables`` (SQLite): through the inspector's own tables where
    a page needs one (module docstring)."""
    where, params = _row_terms(org, status, "")
    if own_tables and (model or not (org or _errors_only(status))):
        return _own_page_query(model, org, status, before, limit)
    if model:
        where.append("model = ?")
        params.append(model)
    if before:
        created_at, rowid = parse_cursor(before)
        where.append("created_at <= ? AND (created_at < ? OR rowid < ?)")
        params += [created_at, created_at, rowid]
    sql = f"SELECT rowid AS _rowid, {SELECT_COLUMNS} FROM usage_events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
    params.append(limit + 1)
    return sql, params


def _errors_only(status: str | None) -> bool:
    """Whether a page's status filter lets only error rows through (the partial index serves it)."""
    return status == "error" or (status not in (None, "", "ok") and parse_status(status) >= 400)


def _own_page_query(model: str | None, org: str | None, status: str | None, before: str | None,
                    limit: int) -> tuple[str, list[Any]]:
    """``page_query`` on SQLite through ``inspector_models`` (a model given) or ``inspector_times``:
    the table's primary key walked newest first, each entry joined to its row by rowid (and checked
    against the row's time and model)."""
    if model:
        source = ("inspector_models AS m CROSS JOIN usage_events AS u"
                  " ON u.rowid = m.rid AND u.model = m.model AND u.created_at = m.created_at")
        where, params = ["m.model = ?"], [model]
    else:
        source = "inspector_times AS m CROSS JOIN usage_events AS u ON u.rowid = m.rid AND u.created_at = m.created_at"
        where, params = [], []
    terms, more = _row_terms(org, status, "u.")
    where += terms
    params += more
    if before:
        created_at, rowid = parse_cursor(before)
        where.append("m.created_at <= ? AND (m.created_at < ? OR m.rid < ?)")
        params += [created_at, created_at, rowid]
    columns = ", ".join(f"u.{c}" for c in COLUMNS)
    sql = (f"SELECT u.rowid AS _rowid, {columns} FROM {source}" + (f" WHERE {' AND '.join(where)}" if where else "")
           + " ORDER BY m.created_at DESC, m.rid DESC LIMIT ?")
    params.append(limit + 1)
    return sql, params


def _row_terms(org: str | None, status: str | None, table: str) -> tuple[list[str], list[Any]]:
    """The org and status terms of a page's ``WHERE`` (columns prefixed with ``table``)."""
    where, params = [], []
    if org:
        where.append(f"{table}org = ?")
        params.append(org)
    if status:
        if status == "error":
            where.append(f"{table}status >= 400")
        elif status == "ok":
            where.append(f"+{table}status < 400")  # unary + (SQLite): scan by time; nearly every row matches
        elif (code := parse_status(status)) >= 400:
            where.append(f"{table}status = ? AND {table}status >= 400")  # the second term: the partial index
            params.append(code)
        else:
            where.append(f"+{table}status = ?")
            params.append(code)
    return where, params


def digits(text: str, most: int = 19) -> bool:
    """``text`` is a decimal integer ``int()`` reads: ASCII digits only (``str.isdigit`` is true of
    "²", which ``int()`` refuses), and at most ``most`` of them (``int()`` refuses over 4,300)."""
    return 0 < len(text) <= most and text.isascii() and text.isdigit()


def parse_status(status: str) -> int:
    if not digits(status) or not 100 <= int(status) <= 599:
        raise QueryError("status", "status must be an HTTP status (e.g. 429), `ok` (below 400) or `error` "
                                   "(400 and above)")
    return int(status)


def parse_cursor(cursor: str) -> tuple[str, int]:
    """``(created_at, rowid)`` of a ``next`` cursor; a QueryError on ``before`` for anything else: a
    row id beyond the largest both databases store, or a time that is not an ISO-8601 time in printable
    ASCII (a NUL, which PostgreSQL refuses in text, never reaches the query). The time is compared as
    the row's text, as it came."""
    try:
        created_at, sep, rowid = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().rpartition("~")
    except (ValueError, UnicodeDecodeError):
        sep = ""
    if not sep or not created_at or not digits(rowid) or int(rowid) > MAX_ROWID:
        raise QueryError("before", "before must be the `next` cursor of a previous page")
    if not _iso_time(created_at):
        raise QueryError("before", "before must be the `next` cursor of a previous page: its time is not an "
                                   "ISO-8601 time such as 2026-11-29T20:00:00.123+00:00")
    return created_at, int(rowid)


def _iso_time(text: str) -> bool:
    if not (text.isascii() and text.isprintable()) or len(text) > MAX_TIME_CHARS:
        return False
    try:
        datetime.fromisoformat(text)
    except ValueError:
        return False
    return True


def cursor_of(row: dict) -> str:
    """URL-safe (base64url of ``<created_at>~<rowid>``), so scripts can paste it into a query as is."""
    return base64.urlsafe_b64encode(f"{row['created_at']}~{row['_rowid']}".encode()).decode().rstrip("=")


def parse_time(value: str, param: str) -> str:
    """An ISO-8601 time (naive means UTC) in the ledger's own format, for text comparison."""
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise QueryError(param, f"{param} must be an ISO-8601 time, e.g. 2026-11-29T20:00:00Z") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    try:
        return when.astimezone(timezone.utc).isoformat(timespec="milliseconds")
    except OverflowError:
        raise QueryError(param, f"{param} is out of range: in UTC it falls outside the years 1 to 9999") from None


class Reader(Protocol):
    """Where the inspector's queries run."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def fetch(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """The rows of a read query written with ``?`` placeholders, as dicts."""


class SQLiteReader:
    """A connection of its own to the SQLite ledger; creates the inspector's index and tables
    (``INDEXES``), and writes nothing but those tables (``read_filled``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.db: aiosqlite.Connection | None = None
        self._paused = asyncio.Lock()  # held by a read, or while paused
        self._fill_error = ""  # why the inspector's tables could not be filled at the last read

    async def open(self) -> None:
        self.db = await aiosqlite.connect(self.path, timeout=READ_WAIT_MS / 1000, isolation_level=None)
        await self.db.executescript(INDEXES)
        await self.db.execute("PRAGMA query_only = 1")
        self.db.row_factory = sqlite3.Row

    async def close(self) -> None:
        if self.db is not None:
            await self.db.close()
            self.db = None

    async def pause(self) -> None:
        """Close the connection, reads waiting until ``resume``: the ledger opens the file anew
        (``SQLiteLedger.file_users``)."""
        await self._paused.acquire()
        await self.close()

    async def resume(self) -> None:
        try:
            await self.open()
        finally:
            self._paused.release()

    async def fetch(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        async with self._paused:  # one read at a time, as on the connection's one thread anyway
            async with self.db.execute(sql, tuple(params)) as cur:
                return [dict(r) for r in await cur.fetchall()]

    async def read_filled(self, sql: str, params: Iterable[Any],
                          shared: tuple[str, list[Any]]) -> list[dict[str, Any]]:
        """The rows of a query of the inspector's own tables: they are first brought up to every row
        committed, then read, in one transaction (the rows the query sees are those of one moment).
        A long way behind (the first read after an upgrade, or after a long time), they are filled
        ``FILL_ROWS`` rows at a time, a transaction each, so that the ledger's commits never wait long.
        When they cannot be written now (another program holds the file's write lock, a full disk, a
        read-only file), the ``shared`` query answers instead, from the usage table alone: the same
        rows, found without the inspector's tables (slower on a large table), rather than no answer."""
        async with self._paused:
            db = self.db
            await db.execute("PRAGMA query_only = 0")
            await db.execute(f"PRAGMA busy_timeout = {FILL_WAIT_MS}")
            try:
                while True:
                    await db.execute("BEGIN IMMEDIATE")
                    try:
                        if await self._fill(db):
                            async with db.execute(sql, tuple(params)) as cur:
                                rows = [dict(r) for r in await cur.fetchall()]
                            await db.execute("COMMIT")
                            return rows
                        await db.execute("COMMIT")
                    except BaseException:
                        if db.in_transaction:
                            await db.execute("ROLLBACK")
                        raise
            except sqlite3.OperationalError as exc:
                if str(exc) != self._fill_error:  # said once, not at each read
                    log.warning("inspector: its own tables cannot be filled now (%s); reading the usage table "
                                "without them", exc)
                self._fill_error = str(exc)
            else:
                self._fill_error = ""
            finally:
                await db.execute(f"PRAGMA busy_timeout = {READ_WAIT_MS}")
                await db.execute("PRAGMA query_only = 1")
            async with db.execute(shared[0], tuple(shared[1])) as cur:
                return [dict(r) for r in await cur.fetchall()]

    @staticmethod
    async def _fill(db: aiosqlite.Connection) -> bool:
        """Copy up to ``FILL_ROWS`` rows' time, model and rowid into the inspector's tables; True once they
        hold every row. Where it stopped is kept as a rowid and that row's id: if that row is gone (rows
        deleted from the top of the table, whose rowids new rows may take again), they are filled anew."""
        (up_to, up_to_id), = await db.execute_fetchall(
            "SELECT COALESCE((SELECT up_to FROM inspector_filled), 0), (SELECT up_to_id FROM inspector_filled)")
        if up_to and not await db.execute_fetchall("SELECT 1 FROM usage_events WHERE rowid = ? AND id = ?",
                                                   (up_to, up_to_id)):
            await db.execute("DELETE FROM inspector_times")
            await db.execute("DELETE FROM inspector_models")
            up_to = 0
        last = await db.execute_fetchall("SELECT rowid, id FROM usage_events WHERE rowid > ? AND rowid <= ? "
                                         "ORDER BY rowid DESC LIMIT 1", (up_to, up_to + FILL_ROWS))
        if not last:
            return not await db.execute_fetchall("SELECT 1 FROM usage_events WHERE rowid > ? LIMIT 1", (up_to,))
        end, end_id = last[0]
        await db.execute("INSERT OR IGNORE INTO inspector_times (created_at, rid) SELECT created_at, rowid "
                         "FROM usage_events WHERE rowid > ? AND rowid <= ?", (up_to, end))
        await db.execute("INSERT OR IGNORE INTO inspector_models (model, created_at, rid) SELECT model, created_at, "
                         "rowid FROM usage_events WHERE rowid > ? AND rowid <= ? AND model IS NOT NULL", (up_to, end))
        await db.execute("INSERT OR REPLACE INTO inspector_filled (id, up_to, up_to_id) VALUES (1, ?, ?)",
                         (end, end_id))
        return not await db.execute_fetchall("SELECT 1 FROM usage_events WHERE rowid > ? LIMIT 1", (end,))


class SharedReader:
    """The shared store's pool (``PostgresStore.fetch``): opened and closed with the gateway, not here.
    A database out of reach is its 503 ``store_unavailable``."""

    def __init__(self, store: Any):
        self.fetch = store.fetch

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass


class InspectorStore:
    def __init__(self, reader: Reader):
        self.reader = reader

    async def open(self) -> None:
        await self.reader.open()

    async def close(self) -> None:
        await self.reader.close()

    async def page(self, limit: int = 50, **filters: str | None) -> tuple[list[dict], str | None]:
        """One page of rows, newest first, and the cursor of the next page (None: the last)."""
        rows = await self._read(page_query, limit=limit, **filters)
        more = len(rows) > limit
        rows = rows[:limit]
        cursor = cursor_of(rows[-1]) if more else None
        for row in rows:
            del row["_rowid"]
        return rows, cursor

    async def get(self, generation_id: str) -> dict | None:
        rows = await self._fetch(f"SELECT {SELECT_COLUMNS} FROM usage_events WHERE id = ?", (generation_id,))
        return rows[0] if rows else None

    async def usage(self, bucket: str, since: str | None, until: str | None,
                    org: str | None = None, model: str | None = None) -> dict[str, Any]:
        """Requests, tokens, cost and errors per time bucket, org and model."""
        if bucket not in BUCKETS:
            raise QueryError("bucket", f"bucket must be one of {', '.join(BUCKETS)}")
        width, step = BUCKETS[bucket]
        end = datetime.fromisoformat(parse_time(until, "until")) if until else datetime.now(timezone.utc)
        start = datetime.fromisoformat(parse_time(since, "since")) if since else _default_start(end, bucket)
        if start >= end:
            raise QueryError("since", "since must be before until")
        if (end - start) / step > MAX_BUCKETS:
            raise QueryError("bucket", f"more than {MAX_BUCKETS} buckets: use a wider bucket or a later since")
        labels = _bucket_labels(start, end, step, width)
        # Without ``until`` the span ends now, and a row stamped in this very millisecond is in it.
        rows = await self._read(usage_query, width, _iso(start), _iso(end), org, model, up_to_now=not until)
        series = sorted(rows, key=_series_order)
        return {"bucket": bucket, "since": _iso(start), "until": _iso(end), "buckets": labels, "series": series}

    async def _read(self, query: Any, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """The rows of ``query(*args, **kwargs)`` (``page_query``, ``usage_query``): on SQLite through
        the inspector's own tables where the query has a form for them (``SQLiteReader.read_filled``)."""
        shared = query(*args, **kwargs)
        read_filled = getattr(self.reader, "read_filled", None)
        if read_filled is not None:
            sql, params = query(*args, own_tables=True, **kwargs)
            if "inspector_" in sql:
                if _has_nul(params):
                    return []
                return await read_filled(sql, params, shared)
        return await self._fetch(*shared)

    async def _fetch(self, sql: str, params: list[Any] | tuple[Any, ...]) -> list[dict[str, Any]]:
        """The reader's rows; none, without asking, when a text parameter holds a NUL (``_has_nul``)."""
        if _has_nul(params):
            return []
        return await self.reader.fetch(sql, params)


def _has_nul(params: Iterable[Any]) -> bool:
    """A text parameter holds a NUL: no row can hold one (PostgreSQL's text cannot, and refuses the
    parameter; the ledger writes none on SQLite either), so an org, a model or an id with one matches
    nothing on both stores, and the query is not sent."""
    return any(type(p) is str and "\x00" in p for p in params)


def usage_query(width: int, start: str, end: str, org: str | None = None,
                model: str | None = None, up_to_now: bool = False, own_tables: bool = False) -> tuple[str, list[Any]]:
    """Sums per bucket (the first ``width`` characters of ``created_at``), org and model, from
    ``start`` to ``end`` (included when ``up_to_now``). The casts keep PostgreSQL's sums of
    BIGINT columns integers (not NUMERIC), as SQLite's are. ``own_tables`` (SQLite): without an org,
    the rows of the span are found through ``inspector_times``."""
    through = own_tables and not org
    p = "u." if through else ""
    span = "m." if through else ""
    where = [f"{span}created_at >= ?", f"{span}created_at {'<=' if up_to_now else '<'} ?"]
    params = [start, end]
    for column, value in (("org", org), ("model", model)):
        if value:
            where.append(f"{p}{column} = ?")
            params.append(value)
    source = ("inspector_times AS m CROSS JOIN usage_events AS u ON u.rowid = m.rid AND u.created_at = m.created_at"
              if through else "usage_events")
    sql = (f"SELECT substr({p}created_at, 1, {width}) AS t, {p}org AS org, {p}model AS model, COUNT(*) AS requests,"
           f" CAST(SUM({p}prompt_tokens) AS BIGINT) AS prompt_tokens,"
           f" CAST(SUM({p}completion_tokens) AS BIGINT) AS completion_tokens,"
           f" CAST(SUM({p}total_tokens) AS BIGINT) AS total_tokens, SUM({p}cost) AS cost,"
           f" SUM(CASE WHEN {p}status >= 400 THEN 1 ELSE 0 END) AS errors FROM {source}"
           f" WHERE {' AND '.join(where)} GROUP BY substr({p}created_at, 1, {width}), {p}org, {p}model")
    return sql, params


def _series_order(row: dict) -> tuple:
    """Sorted here, not in SQL: text order and NULLs' place differ between the two databases."""
    return row["t"], row["org"], row["model"] is not None, row["model"] or ""


def _iso(when: datetime) -> str:
    return when.isoformat(timespec="milliseconds")


def _default_start(end: datetime, bucket: str) -> datetime:
    """The start of the default span ending at ``end``; a QueryError on ``until`` if it would
    fall before year 1."""
    try:
        return end - DEFAULT_SPAN[bucket] * BUCKETS[bucket][1]
    except OverflowError:
        raise QueryError("until", "until is too early for the default span: give since as well") from None


def _bucket_labels(start: datetime, end: datetime, step: timedelta, width: int) -> list[str]:
    """Every bucket of the span, empty ones included, so charts keep a true time axis; a
    QueryError on ``until`` if the last bucket would end after year 9999."""
    labels, t = [], _floor(start, step)
    try:
        while t < end:
            labels.append(t.isoformat()[:width])
            t += step
    except OverflowError:
        raise QueryError("until", "until is too late: its bucket would end after year 9999") from None
    return labels


def _floor(when: datetime, step: timedelta) -> datetime:
    if step >= timedelta(days=1):
        return when.replace(hour=0, minute=0, second=0, microsecond=0)
    if step >= timedelta(hours=1):
        return when.replace(minute=0, second=0, microsecond=0)
    return when.replace(second=0, microsecond=0)
