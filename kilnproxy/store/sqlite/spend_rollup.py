"""``usage_daily``, the SQLite ledger's rollup of its rows by day, org, key and model (the spend query's,
``kilnproxy.store.spend``), and the triggers that keep it in step.

One rollup row per ``(day, org, key_id, model)`` (``day``: the first 10 characters of
``created_at``; ``model``: "" for a row without one) holds the count of rows and the sums of their
tokens and of their cost in whole ten-billionths of a dollar. Its key is ordered ``(day, model, org,
key_id)``: a span's rows come in the order of a sum by day and model (a chart's), summed without a
sort. Triggers on ``usage_events`` add a row
inserted, take away a row deleted, and move a row updated (its old values taken away, its new ones
added), in the statement's own transaction: whichever program writes the file (the gateway's group
commit, the row journal replayed, a command, the ``sqlite3`` shell), the rollup holds the sums of
the rows. The ledger writes a row again (the same id) as an UPSERT, whose update fires the update
trigger: an ``INSERT OR REPLACE`` would delete the old row without firing the delete trigger
(SQLite fires it only with ``recursive_triggers`` on).

SQLite adds integers past 2**63 as floats rather than fail: no sum can make a commit fail.

``add_rollup`` creates the table, fills it from the rows already there (a ledger an older kilnproxy
made), then creates the triggers, in one transaction; ``prepare_file`` calls it at open.
"""

from __future__ import annotations

import sqlite3

TABLE = """
CREATE TABLE usage_daily (
    day TEXT NOT NULL,
    org TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    cost_units INTEGER NOT NULL,
    PRIMARY KEY (day, model, org, key_id)
) WITHOUT ROWID;
CREATE INDEX usage_daily_org_day ON usage_daily (org, day);
"""

# A row's rollup key and figures, from the row ``{r}`` (NEW or OLD in a trigger, the table in FILL).
_KEY = "substr({r}.created_at, 1, 10), {r}.org, {r}.key_id, coalesce({r}.model, '')"
_FIGURES = ("{r}.prompt_tokens, {r}.completion_tokens, {r}.cached_tokens,"
            " CAST(round({r}.cost * 10000000000) AS INTEGER)")
_ADD = ("INSERT INTO usage_daily (day, org, key_id, model, requests, prompt_tokens, completion_tokens,"
        " cached_tokens, cost_units) VALUES (" + _KEY + ", 1, " + _FIGURES + ")"
        " ON CONFLICT (day, model, org, key_id) DO UPDATE SET requests = requests + 1,"
        " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
        " completion_tokens = completion_tokens + excluded.completion_tokens,"
        " cached_tokens = cached_tokens + excluded.cached_tokens, cost_units = cost_units + excluded.cost_units;")
_TAKE = ("UPDATE usage_daily SET requests = requests - 1, prompt_tokens = prompt_tokens - {r}.prompt_tokens,"
         " completion_tokens = completion_tokens - {r}.completion_tokens,"
         " cached_tokens = cached_tokens - {r}.cached_tokens,"
         " cost_units = cost_units - CAST(round({r}.cost * 10000000000) AS INTEGER)"
         " WHERE (day, org, key_id, model) = (" + _KEY + ");")

TRIGGERS = f"""
CREATE TRIGGER usage_daily_insert AFTER INSERT ON usage_events BEGIN
    {_ADD.format(r="NEW")}
END;
CREATE TRIGGER usage_daily_delete AFTER DELETE ON usage_events BEGIN
    {_TAKE.format(r="OLD")}
END;
CREATE TRIGGER usage_daily_update AFTER UPDATE OF created_at, org, key_id, model, prompt_tokens,
        completion_tokens, cached_tokens, cost ON usage_events BEGIN
    {_TAKE.format(r="OLD")}
    {_ADD.format(r="NEW")}
END;
"""

FILL = ("INSERT INTO usage_daily (day, org, key_id, model, requests, prompt_tokens, completion_tokens,"
        " cached_tokens, cost_units) SELECT " + _KEY.format(r="u") + ", count(*), sum(u.prompt_tokens),"
        " sum(u.completion_tokens), sum(u.cached_tokens), sum(CAST(round(u.cost * 10000000000) AS INTEGER))"
        " FROM usage_events u GROUP BY 1, 2, 3, 4")


def has_rollup(db: sqlite3.Connection) -> bool:
    found = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'usage_daily'").fetchone()
    return found is not None


def add_rollup(db: sqlite3.Connection) -> None:
    """Create ``usage_daily`` from the rows there and its triggers, in one transaction, unless the file
    has it (no write then). ``db`` is in autocommit mode (``isolation_level=None``)."""
    if has_rollup(db):
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        if not has_rollup(db):  # another process may have made it while this one waited for the lock
            for sql in (TABLE, FILL, TRIGGERS):
                for part in split(sql):
                    db.execute(part)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def split(script: str) -> list[str]:
    """The statements of ``script`` (``sqlite3.complete_statement`` tells where a trigger ends)."""
    statements, current = [], ""
    for line in script.strip().splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    if current.strip():
        statements.append(current.strip())
    return statements
