"""Paging stays an index range scan with a million rows in the ledger (and on PostgreSQL too)."""

import asyncio
import base64
import shutil
import sqlite3

import asyncpg
import orjson
import pytest

from kilnproxy.inspector.queries import page_query, usage_query
from kilnproxy.store.inspector_tables import SQLITE_TABLES as INDEXES
from kilnproxy.store.postgres.connection import numbered
from kilnproxy.store.postgres.schema import migrate
from kilnproxy.store.sqlite.schema import SCHEMA

ROWS = 1_000_000
START = 1_764_000_000  # unix seconds of row 0; row i is i seconds later
ORGS = ("acme", "globex", "initech", "umbrella")

FILL = f"""
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {ROWS - 1})
INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status,
                          prompt_tokens, completion_tokens, total_tokens, cost, duration_ms, ttft_ms)
SELECT 'gen-' || i, strftime('%Y-%m-%dT%H:%M:%f+00:00', {START} + i, 'unixepoch'),
       CASE i % 4 WHEN 0 THEN 'acme' WHEN 1 THEN 'globex' WHEN 2 THEN 'initech' ELSE 'umbrella' END,
       'k', 'model-' || (i % 3), 'completions', 1,
       CASE WHEN i % 100 < 98 THEN 200 WHEN i % 100 = 98 THEN 429 ELSE 502 END,
       10, 20, 30, 0.0001, 100.0, 10.0
FROM n
"""

SHAPES = [{}, {"org": "acme"}, {"model": "model-1"}, {"status": "429"}, {"status": "error"}, {"status": "ok"},
          {"status": "200"}, {"status": "502", "org": "umbrella"},
          {"org": "globex", "model": "model-2"}]


@pytest.fixture(scope="module")
def big_db(tmp_path_factory):
    """A ledger of a million rows, written in one statement (a few seconds), indexes built after."""
    path = tmp_path_factory.mktemp("million") / "usage.db"
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=OFF")
    db.execute("PRAGMA synchronous=OFF")
    db.execute(SCHEMA.split(";")[0])  # the table alone: indexes are faster to build once filled
    db.execute(FILL)
    db.commit()
    db.executescript(SCHEMA + INDEXES)
    db.close()
    return path


def cursor(plain: str) -> str:
    return base64.urlsafe_b64encode(plain.encode()).decode().rstrip("=")


def expected(i: int) -> str:
    return f"gen-{i}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "&".join(f"{k}={v}" for k, v in s.items()) or "all")
@pytest.mark.parametrize("deep", [False, True], ids=["first", "deep"])
def test_every_filter_pages_by_an_index(big_db, shape, deep):
    db = sqlite3.connect(big_db)
    try:
        before = cursor("2025-11-30T10:00:00.000+00:00~500000") if deep else None
        sql, params = page_query(before=before, limit=50, own_tables=True, **shape)  # SQLite's reader's query
        steps = [r[3] for r in db.execute("EXPLAIN QUERY PLAN " + sql, params)]
        plan = " | ".join(steps)
        # ``SCAN m``: the inspector's own table is its primary key (WITHOUT ROWID), walked in order
        assert "TEMP B-TREE" not in plan and all("USING" in step or step == "SCAN m" for step in steps), plan
    finally:
        db.close()


async def test_paging_through_the_api_over_a_million_rows(harness, tmp_path, big_db):
    shutil.copyfile(big_db, tmp_path / "usage.db")
    async with harness() as h:
        async def page(query):
            async with h.session.get(f"{h.url}/ui/api/requests?{query}") as resp:
                assert resp.status == 200
                return orjson.loads(await resp.read())

        first = await page("limit=100")
        assert [r["id"] for r in first["data"]] == [expected(i) for i in range(ROWS - 1, ROWS - 101, -1)]
        got, next_cursor = [], first["next"]
        for _ in range(5):
            nxt = await page(f"limit=100&before={next_cursor}")
            got += [r["id"] for r in nxt["data"]]
            next_cursor = nxt["next"]
        assert got == [expected(i) for i in range(ROWS - 101, ROWS - 601, -1)]

        # row i is START + i seconds, rowid i + 1: 2025-11-30T10:00:00 is row 496800, before rowid 500000
        deep = await page(f"limit=3&before={cursor('2025-11-30T10:00:00.000+00:00~500000')}")
        assert [r["id"] for r in deep["data"]] == [expected(496800), expected(496799), expected(496798)]

        errors = await page("limit=4&status=error&org=umbrella")
        assert [r["id"] for r in errors["data"]] == [expected(i) for i in (999999, 999899, 999799, 999699)]
        too_many = await page("limit=3&status=429")
        assert [r["id"] for r in too_many["data"]] == [expected(i) for i in (999998, 999898, 999798)]
        ok = await page("limit=3&status=200&org=acme")
        assert [r["id"] for r in ok["data"]] == [expected(i) for i in (999996, 999992, 999988)]
        by_model = await page("limit=3&model=model-1")
        assert [r["id"] for r in by_model["data"]] == [expected(i) for i in (999997, 999994, 999991)]


# -- the same queries on PostgreSQL -------------------------------------------------------

PG_ROWS = 50_000  # enough for the planner to prefer an index to a full scan and sort
PG_FILL = f"""
INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status,
                          prompt_tokens, completion_tokens, total_tokens, cost, duration_ms, ttft_ms)
SELECT 'gen-' || i,
       to_char(to_timestamp({START} + i) AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"+00:00"'),
       (ARRAY['acme', 'globex', 'initech', 'umbrella'])[i % 4 + 1], 'k', 'model-' || (i % 3), 'completions', 1,
       CASE WHEN i % 100 < 98 THEN 200 WHEN i % 100 = 98 THEN 429 ELSE 502 END,
       10, 20, 30, 0.0001, 100.0, 10.0
FROM generate_series(0, {PG_ROWS - 1}) AS i
"""


@pytest.fixture(scope="module")
def pg_big(postgres):
    """A PostgreSQL ledger of ``PG_ROWS`` rows (row i: ``START + i`` seconds, ``rowid`` i + 1), analyzed."""
    async def fill(url):
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn)
            await conn.execute(PG_FILL)
            await conn.execute("ANALYZE usage_events")
        finally:
            await conn.close()

    url = postgres.create_database("inspector_paging")
    asyncio.run(fill(url))
    yield url
    postgres.drop_database("inspector_paging")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "&".join(f"{k}={v}" for k, v in s.items()) or "all")
@pytest.mark.parametrize("deep", [False, True], ids=["first", "deep"])
async def test_every_filter_pages_by_an_index_on_postgresql(pg_big, shape, deep):
    """An index scan in time order, rows of one same ``created_at`` put in ``rowid`` order by an
    incremental sort (a few rows at a time); a full sort only of what the partial index of errors
    gives (when the planner expects a handful of rows). Never a scan of the table."""
    before = cursor("2025-11-25T00:00:00.000+00:00~30000") if deep else None
    sql, params = page_query(before=before, limit=50, **shape)
    conn = await asyncpg.connect(pg_big)
    try:
        plan = [r[0].strip() for r in await conn.fetch("EXPLAIN " + numbered(sql), *params)]
    finally:
        await conn.close()
    nodes = [line.removeprefix("->").strip().partition("  (cost=")[0] for line in plan if "(cost=" in line]
    assert nodes[0] == "Limit" and len(nodes) == 3, plan
    assert nodes[2].startswith("Index Scan Backward using usage_events_"), plan
    assert nodes[1] == "Incremental Sort" or (
        nodes[1] == "Sort" and "usage_events_errors_created" in nodes[2]), plan


async def test_paging_through_the_api_on_postgresql(harness, tmp_path, pg_big):
    async with harness(overrides={"storage": {"url": pg_big, "spool_path": str(tmp_path / "spool.db")}}) as h:
        async def page(query):
            async with h.session.get(f"{h.url}/ui/api/requests?{query}") as resp:
                assert resp.status == 200
                return orjson.loads(await resp.read())

        first = await page("limit=100")
        assert [r["id"] for r in first["data"]] == [expected(i) for i in range(PG_ROWS - 1, PG_ROWS - 101, -1)]
        nxt = await page(f"limit=100&before={first['next']}")
        assert [r["id"] for r in nxt["data"]] == [expected(i) for i in range(PG_ROWS - 101, PG_ROWS - 201, -1)]
        # 2025-11-25T00:00:00 is row 28800 (rowid 28801), before rowid 30000: that row comes first
        deep = await page(f"limit=3&before={cursor('2025-11-25T00:00:00.000+00:00~30000')}")
        assert [r["id"] for r in deep["data"]] == [expected(28800), expected(28799), expected(28798)]
        errors = await page("limit=3&status=error&org=umbrella")
        assert [r["id"] for r in errors["data"]] == [expected(i) for i in (49999, 49899, 49799)]
        by_model = await page("limit=3&model=model-1&status=200")
        assert [r["id"] for r in by_model["data"]] == [expected(i) for i in (49996, 49993, 49990)]


HOUR = ("2025-11-24T20:00:00.000+00:00", "2025-11-24T21:00:00.000+00:00")
USAGE_SHAPES = [{}, {"org": "acme"}, {"model": "model-1"}, {"org": "acme", "model": "model-1"}]


@pytest.mark.parametrize("shape", USAGE_SHAPES, ids=lambda s: "&".join(f"{k}={v}" for k, v in s.items()) or "all")
async def test_usage_of_an_hour_reads_an_index_range_on_both_stores(pg_big, shape):
    sql, params = usage_query(16, *HOUR, own_tables=True, **shape)  # SQLite's reader's query
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(SCHEMA + INDEXES)
        steps = [r[3] for r in db.execute("EXPLAIN QUERY PLAN " + sql, params)]
    finally:
        db.close()
    plan = " | ".join(steps)
    assert all(step.startswith("SEARCH ") or "TEMP B-TREE FOR GROUP BY" in step for step in steps), plan
    assert ("USING INDEX usage_events_org_created" if "org" in shape else "SEARCH m USING PRIMARY KEY") in plan, plan
    sql, params = usage_query(16, *HOUR, **shape)
    conn = await asyncpg.connect(pg_big)
    try:
        plan = " | ".join(r[0].strip() for r in await conn.fetch("EXPLAIN " + numbered(sql), *params))
    finally:
        await conn.close()
    assert "Index Scan using usage_events_" in plan and "Seq Scan" not in plan, plan
