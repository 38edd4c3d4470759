"""The inspector's tables and SQL, owned by the store: pages of requests and usage buckets, on either store.

Each query is written once for both stores (``?`` placeholders, explicit
column lists, nothing but SQL both SQLite and PostgreSQL read the same way).
The inspector (``kilnproxy.inspector.queries``) parses what the API was given
and asks for the SQL here: ``page_sql``, ``usage_sql``.

With these indexes a page is a short index range scan however many rows the
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

Where they are made: on PostgreSQL the indexes are the schema's since its
first version (``kilnproxy.store.postgres.schema``); on SQLite ``SQLITE_TABLES``
is created with the ledger's table (``kilnproxy.store.sqlite.schema.prepare_file``,
when the gateway runs with the inspector). The ledger's table keeps only the
indexes the gateway's own queries need: every index is one more b-tree written
in every request's commit. The inspector's two tables (their primary keys are
the index; each entry is joined to its row by rowid, and must match the row's
time and model, so an entry of a row since deleted matches nothing) are filled
when the inspector reads them, in bulk, from the rows committed since its last
read, in the read's own transaction (``kilnproxy.store.sqlite.inspector_reader``):
off the request path, and at no cost while nobody looks.

Pages are newest first, ordered by ``(created_at, rowid)`` (on PostgreSQL,
whose indexes hold no rowid, rows of one same ``created_at`` are put in order
by an incremental sort, a few rows at a time).
"""

from __future__ import annotations

from typing import Any

from ..usage import COLUMNS

SQLITE_TABLES = """
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
SELECT_COLUMNS = ", ".join(COLUMNS)  # never ``*``: PostgreSQL's table has two columns more
SELECT_BY_ID = f"SELECT {SELECT_COLUMNS} FROM usage_events WHERE id = ?"  # one row, by its generation id



def page_sql(org: str | None, model: str | None, status: str | int | None, before: tuple[str, int] | None,
             limit: int, own_tables: bool = False) -> tuple[str, list[Any]]:
    """The SQL of one page of requests, newest first (``limit + 1`` rows: the extra tells whether there
    is a next page), before the row ``before`` (its ``(created_at, rowid)``). ``own_tables`` (SQLite):
    through the inspector's own tables where a page needs one (module docstring)."""
    where, params = row_terms(org, status, "")
    if own_tables and (model or not (org or errors_only(status))):
        return own_page_sql(model, org, status, before, limit)
    if model:
        where.append("model = ?")
        params.append(model)
    if before:
        created_at, rowid = before
        where.append("created_at <= ? AND (created_at < ? OR rowid < ?)")
        params += [created_at, created_at, rowid]
    sql = f"SELECT rowid AS _rowid, {SELECT_COLUMNS} FROM usage_events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
    params.append(limit + 1)
    return sql, params


def errors_only(status: str | int | None) -> bool:
    """Whether a page's status filter lets only error rows through (the partial index serves it)."""
    return status == "error" or (type(status) is int and status >= 400)


def own_page_sql(model: str | None, org: str | None, status: str | int | None, before: tuple[str, int] | None,
                 limit: int) -> tuple[str, list[Any]]:
    """``page_sql`` on SQLite through ``inspector_models`` (a model given) or ``inspector_times``:
    the table's primary key walked newest first, each entry joined to its row by rowid (and checked
    against the row's time and model)."""
    if model:
        source = ("inspector_models AS m CROSS JOIN usage_events AS u"
                  " ON u.rowid = m.rid AND u.model = m.model AND u.created_at = m.created_at")
        where, params = ["m.model = ?"], [model]
    else:
        source = "inspector_times AS m CROSS JOIN usage_events AS u ON u.rowid = m.rid AND u.created_at = m.created_at"
        where, params = [], []
    terms, more = row_terms(org, status, "u.")
    where += terms
    params += more
    if before:
        created_at, rowid = before
        where.append("m.created_at <= ? AND (m.created_at < ? OR m.rid < ?)")
        params += [created_at, created_at, rowid]
    columns = ", ".join(f"u.{c}" for c in COLUMNS)
    sql = (f"SELECT u.rowid AS _rowid, {columns} FROM {source}" + (f" WHERE {' AND '.join(where)}" if where else "")
           + " ORDER BY m.created_at DESC, m.rid DESC LIMIT ?")
    params.append(limit + 1)
    return sql, params


def row_terms(org: str | None, status: str | int | None, table: str) -> tuple[list[str], list[Any]]:
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
        elif status >= 400:
            where.append(f"{table}status = ? AND {table}status >= 400")  # the second term: the partial index
            params.append(status)
        else:
            where.append(f"+{table}status = ?")
            params.append(status)
    return where, params


def usage_sql(width: int, start: str, end: str, org: str | None = None,
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

