"""Schema version 6 on a real PostgreSQL: a settlement reads only the rows it settles. Version 5's
``kiln_settle`` read all of ``usage_events`` (looking for ``replica_lost`` rows to replace: no
index led to them), of ``kiln_holds`` and of ``kiln_minute`` at each settlement, so that its time
grew with the tables. A version-5 database with rows, a ``replica_lost`` row among them, holds in
flight and per-minute entries, is migrated in place."""

import asyncpg
import orjson
import pytest

from kilnproxy.store.postgres import schema as pg_schema

HOLD = {"org": "acme", "limit": 100, "granted": 1e6, "amount": 1.0, "prompt_cost": 0.25, "prompt_tokens": 6,
        "created_at": "2026-12-02T01:00:00.000+00:00", "key_id": "key-1", "model": "m", "endpoint": "completions",
        "stream": 0, "key_limit": None, "key_since": None, "tokens": 66, "org_rpm": None, "org_tpm": None,
        "key_rpm": None, "key_tpm": None}
ROWS = 3000


def usage_row(generation_id: str, cost: float) -> dict:
    return {"id": generation_id, "created_at": "2026-12-02T01:00:00.000+00:00", "org": "acme", "key_id": "key-1",
            "model": "m", "endpoint": "completions", "stream": 0, "status": 200, "error_code": None,
            "prompt_tokens": 6, "completion_tokens": 14, "cached_tokens": 0, "total_tokens": 20, "cost": cost,
            "duration_ms": 5.0, "ttft_ms": None, "finish_reason": "stop", "disconnected": 0, "requested_model": "m"}


async def admit(conn, replica: str, generation_id: str, **bounds) -> str:
    holds = orjson.dumps([{**HOLD, "id": generation_id, **bounds}]).decode()
    return (await conn.fetchrow("SELECT * FROM kiln_admit($1::jsonb, $2, 60)", holds, replica))["r_verdict"]


async def settle(conn, replica: str, *rows: dict) -> list:
    return [tuple(r) for r in await conn.fetch("SELECT * FROM kiln_settle($1::jsonb, $2)",
                                               orjson.dumps(list(rows)).decode(), replica)]


async def rows_read_by_scans(conn, replica: str, row: dict) -> dict[str, int]:
    """The rows of each table that sequential scans read while ``row`` was settled
    (``pg_stat_xact_user_tables``: this session's counts not yet reported, which stay unreported until
    the transaction ends: exact, nothing to wait for)."""
    read = ("SELECT relname, seq_tup_read FROM pg_stat_xact_user_tables"
            " WHERE relname IN ('usage_events', 'kiln_holds', 'kiln_minute')")
    async with conn.transaction():
        before = dict(await conn.fetch(read))
        await settle(conn, replica, row)
        return {name: read - before.get(name, 0) for name, read in await conn.fetch(read)}


async def test_a_settlement_reads_no_row_but_its_own_and_a_version_5_database_keeps_its_rows(pg_url):
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE kiln_schema (version INTEGER NOT NULL)")
        for version in range(5):
            async with conn.transaction():
                await conn.execute(pg_schema.MIGRATIONS[version])
                await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
        await conn.execute("INSERT INTO kiln_replicas (id) VALUES ('live'), ('dead')")
        # version 5 at work: many rows settled, and a request of a replica that died, reaped
        await conn.execute(
            "INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status, cost, replica)"
            " SELECT 'old-' || g, '2026-12-01T00:00:00.000+00:00', 'acme', 'key-1', 'm', 'completions', 0, 200,"
            " 0.001, 'live' FROM generate_series(1, $1) g", ROWS)
        await conn.execute("INSERT INTO kiln_orgs (org, spent) VALUES ('acme', $1)", ROWS * 0.001)
        # other requests in flight (another org's) and the last minute's admissions under a per-minute limit
        await conn.execute(
            "INSERT INTO kiln_holds (id, org, replica, amount, prompt_cost, prompt_tokens, created_at, key_id, model,"
            " endpoint, stream) SELECT 'flying-' || g, 'other', 'live', 1, 0.25, 6, '2026-12-02T01:00:00.000+00:00',"
            " 'key-2', 'm', 'completions', 1 FROM generate_series(1, $1) g", ROWS)
        await conn.execute("INSERT INTO kiln_minute (id, org, key_id, at, tokens)"
                           " SELECT 'minute-' || g, 'other', 'key-2', now(), 66 FROM generate_series(1, $1) g", ROWS)
        assert await admit(conn, "dead", "gen-dead") == "ok"
        await conn.execute("UPDATE kiln_replicas SET seen_at = now() - interval '1 hour' WHERE id = 'dead'")
        assert [r["lost"] for r in await conn.fetch("SELECT * FROM kiln_reap(60)")] == [1]
        await conn.execute("UPDATE kiln_replicas SET seen_at = now() WHERE id = 'dead'")
        await conn.execute("ANALYZE usage_events")

        assert await pg_schema.migrate(conn) == 5
        assert await conn.fetchval("SELECT max(version) FROM kiln_schema") == len(pg_schema.MIGRATIONS)
        assert await conn.fetchval("SELECT count(*) FROM usage_events") == ROWS + 1

        # a settlement: its row in, its hold out, its cost added, its per-minute entry settled to its
        # tokens; no other row of the tables read to get there
        assert await admit(conn, "live", "gen-new", org_rpm=1000000) == "ok"
        assert await rows_read_by_scans(conn, "live", usage_row("gen-new", 0.5)) == {
            "usage_events": 0, "kiln_holds": 0, "kiln_minute": 0}
        assert await conn.fetchval("SELECT tokens FROM kiln_minute WHERE id = 'gen-new'") == 20
        spent = await conn.fetchval("SELECT spent FROM kiln_orgs WHERE org = 'acme'")
        assert spent == pytest.approx(ROWS * 0.001 + 0.25 + 0.5)
        assert await conn.fetchval("SELECT count(*) FROM kiln_holds WHERE org = 'acme'") == 0
        # the dead replica, back, still replaces its replica_lost row with the real one (charging the difference)
        assert await settle(conn, "dead", usage_row("gen-dead", 0.75)) == [
            ("acme", pytest.approx(ROWS * 0.001 + 0.25 + 0.5 + 0.5))]
        replaced = await conn.fetchrow("SELECT error_code, cost, replica FROM usage_events WHERE id = 'gen-dead'")
        assert tuple(replaced) == (None, 0.75, "dead")
        assert await conn.fetchval("SELECT count(*) FROM usage_events") == ROWS + 2
        assert await conn.fetchval("SELECT sum(cost) FROM usage_events") == pytest.approx(await conn.fetchval(
            "SELECT spent FROM kiln_orgs WHERE org = 'acme'"))
        assert await pg_schema.migrate(conn) == len(pg_schema.MIGRATIONS)  # a second replica: nothing to do
    finally:
        await conn.close()
