"""The inspector's reads of the usage ledger: pages of requests, one request, usage buckets.

What the API was given is parsed here (``QueryError`` names the parameter it
cannot use); the SQL and the tables it reads are the store's
(``kilnproxy.store.inspector_tables``: ``page_sql``, ``usage_sql``, and the
indexes and tables that keep a page a short index range scan). The queries
run through a reader:

* ``SQLiteReader`` (``kilnproxy.store.sqlite.inspector_reader``): the
  inspector's own SQLite connection, which fills the inspector's tables when
  it reads them;
* ``SharedReader``: the PostgreSQL store's own pool (``PostgresStore.fetch``),
  so every replica's rows are seen. A database out of reach is a 503
  ``store_unavailable`` answer, as elsewhere.

Pages are newest first; the cursor of a page's last row (``<created_at>~<rowid>``
in base64url) asks for the rows before it.
"""

from __future__ import annotations

import base64
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable, Iterable, Protocol

from ..store.inspector_tables import SELECT_BY_ID, page_sql
from ..store.inspector_tables import usage_sql as usage_query

BUCKETS = {"minute": (16, timedelta(minutes=1)), "hour": (13, timedelta(hours=1)), "day": (10, timedelta(days=1))}
DEFAULT_SPAN = {"minute": 60, "hour": 48, "day": 30}  # buckets shown when ``since`` is not given
MAX_BUCKETS = 10_000
MAX_LIMIT = 500
MAX_ROWID = 2**63 - 1  # SQLite's INTEGER and PostgreSQL's BIGINT
MAX_TIME_CHARS = 64  # a cursor's time: the ledger writes 29 characters


class QueryError(ValueError):
    """A parameter the API cannot use; the message names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param



def page_query(org: str | None = None, model: str | None = None, status: str | None = None,
               before: str | None = None, limit: int = 50, own_tables: bool = False) -> tuple[str, list[Any]]:
    """The SQL of one page of requests, newest first (``limit + 1`` rows: the extra tells
    whether there is a next page): the API's ``status`` and ``before`` parsed, the SQL the store's
    (``page_sql``; ``own_tables``: SQLite's, through the inspector's own tables where a page needs one)."""
    code: str | int | None = status if status in (None, "", "ok", "error") else parse_status(status)
    return page_sql(org, model, code, parse_cursor(before) if before else None, limit, own_tables)


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

    read_filled: Callable[[str, Iterable[Any], tuple[str, list[Any]]], Awaitable[list[dict[str, Any]]]] | None
    """SQLite's read through the inspector's own tables, filled first (``SQLiteReader.read_filled``);
    None where the store's indexes serve every query (PostgreSQL)."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def fetch(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """The rows of a read query written with ``?`` placeholders, as dicts."""


class SharedReader:
    """The shared store's pool (``PostgresStore.fetch``): opened and closed with the gateway, not here.
    A database out of reach is its 503 ``store_unavailable``."""

    read_filled = None  # (``Reader.read_filled``) the schema's indexes serve every query

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
        rows = await self._fetch(SELECT_BY_ID, (generation_id,))
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
        the inspector's own tables where the query has a form for them (``SQLiteReader.read_filled``;
        a reader without ``read_filled`` reads the usage table alone)."""
        shared = query(*args, **kwargs)
        read_filled = self.reader.read_filled
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
