"""PostgreSQL's spend rollup (``usage_daily``, schema version 15) in step with the rows on a real server: a
database of the version before, with rows, gets it built by the migration; then a settlement of a batch,
the same batch settled again (nothing twice), a reaped ``replica_lost`` row and the real row replacing it
on another day and model, ``import-ledger`` from an SQLite ledger, a ``COPY``, an UPDATE and a DELETE
each leave it equal to a GROUP BY over the rows."""

import sqlite3

import asyncpg
import orjson

from kilnproxy.cli.import_ledger import SQLiteSource, import_rows
from kilnproxy.store.postgres import schema as pg_schema
from kilnproxy.store.sqlite.inserts import insert_sync
from kilnproxy.store.sqlite.schema import prepare_file
from kilnproxy.usage import COLUMNS

HOLD = {"org": "acme", "limit": 100, "granted": 1e6, "amount": 1.0, "prompt_cost": 0.25, "prompt_tokens": 6,
        "created_at": "2026-12-02T01:00:00.000+00:00", "key_id": "key-1", "model": "m", "endpoint": "completions",
        "stream": 0, "key_limit": None, "key_since": None, "tokens": 66, "org_rpm": None, "org_tpm": None,
        "key_rpm": None, "key_tpm": None}
ROLLUP = ("SELECT day, org, key_id, model, requests, prompt_tokens, completion_tokens, cached_tokens, cost_units"
          " FROM usage_daily WHERE requests <> 0 ORDER BY 1, 2, 3, 4")
BY_ROWS = ("SELECT substr(created_at, 1, 10) AS day, org, key_id, coalesce(model, '') AS model, count(*) AS requests,"
           " sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,"
           " sum(cached_tokens) AS cached_tokens, sum(round(cost * 10000000000)::NUMERIC) AS cost_units"
           " FROM usage_events GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4")


def row(n: int, **extra) -> dict:
    out = dict.fromkeys(COLUMNS)
    out.update(id=f"gen-{n}", created_at=f"2026-11-{1 + n % 3:02d}T{n % 24:02d}:00:00.{n % 1000:03d}+00:00",
               org=("acme", "globex")[n % 2], key_id=f"key-{n % 3}", model=("m1", "m2", None, "")[n % 4],
               endpoint="completions", stream=0, status=200, prompt_tokens=n, completion_tokens=2 * n,
               cached_tokens=n % 5, total_tokens=3 * n, cost=round(n * 1.7e-7 + 0.1, 10), disconnected=0)
    out.update(extra)
    return out


async def in_step(conn) -> list[tuple]:
    rollup = [tuple(r) for r in await conn.fetch(ROLLUP)]
    assert rollup == [tuple(int(v) if i > 3 else v for i, v in enumerate(r)) for r in await conn.fetch(BY_ROWS)]
    return rollup


async def settle(conn, replica: str, rows: list[dict]) -> None:
    await conn.execute("SELECT FROM kiln_settle($1::jsonb, $2)", orjson.dumps(rows).decode(), replica)


async def test_the_migration_builds_it_and_every_write_keeps_it_in_step(pg_url, tmp_path):
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE kiln_schema (version INTEGER NOT NULL)")
        for version in range(len(pg_schema.MIGRATIONS) - 1):
            async with conn.transaction():
                await conn.execute(pg_schema.MIGRATIONS[version])
                await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
        await settle(conn, "old", [row(n) for n in range(100)])  # a ledger of the version before
        assert await pg_schema.migrate(conn) == len(pg_schema.MIGRATIONS) - 1
        assert len(await in_step(conn)) == 12
        assert await conn.fetchval("SELECT sum(requests) FROM usage_daily") == 100

        await conn.execute("INSERT INTO kiln_replicas (id) VALUES ('live'), ('dead')")
        await settle(conn, "live", [row(n) for n in range(100, 180)])
        await settle(conn, "live", [row(n) for n in range(150, 190)])  # settled again: nothing twice
        assert await conn.fetchval("SELECT sum(requests) FROM usage_daily") == 190
        await in_step(conn)
        # a replica dies with a request in flight: reaped as a replica_lost row, replaced by the real one
        holds = orjson.dumps([{**HOLD, "id": "gen-lost"}]).decode()
        assert (await conn.fetchrow("SELECT * FROM kiln_admit($1::jsonb, 'dead', 60)", holds))["r_verdict"] == "ok"
        await conn.execute("UPDATE kiln_replicas SET seen_at = now() - interval '1 hour' WHERE id = 'dead'")
        assert [r["lost"] for r in await conn.fetch("SELECT * FROM kiln_reap(60)")] == [1]
        assert await conn.fetchval("SELECT requests FROM usage_daily WHERE day = '2026-12-02' AND model = 'm'") == 1
        await in_step(conn)
        await settle(conn, "dead", [row(999, id="gen-lost", model="m7", created_at="2026-12-03T00:00:00.000+00:00",
                                        cost=0.75)])
        assert await conn.fetchval("SELECT requests FROM usage_daily WHERE day = '2026-12-02' AND model = 'm'") == 0
        assert await conn.fetchval("SELECT cost_units FROM usage_daily WHERE model = 'm7'") == 7500000000
        await in_step(conn)
        # import-ledger: an SQLite ledger's rows settled, some already there
        ledger = tmp_path / "ledger.db"
        prepare_file(ledger)
        db = sqlite3.connect(ledger, isolation_level=None)
        insert_sync(db, [row(n) for n in range(180, 260)])
        db.close()
        source = SQLiteSource(ledger)
        try:
            assert await import_rows(source, pg_url, 25, False) == (70, 10)
        finally:
            source.close()
        assert await conn.fetchval("SELECT sum(requests) FROM usage_daily") == 261
        await in_step(conn)
        # counts at their cap and a cost past a BIGINT of ten-billionths: settled all the same
        await settle(conn, "live", [row(400, prompt_tokens=2**53 - 1, completion_tokens=2**53 - 1, cost=2.7e9)])
        assert await conn.fetchval("SELECT count(*) FROM usage_events WHERE id = 'gen-400'") == 1
        await in_step(conn)
        # a COPY, an UPDATE and a DELETE by another program
        await conn.copy_records_to_table("usage_events", columns=list(COLUMNS),
                                         records=[tuple(row(n)[c] for c in COLUMNS) for n in range(300, 340)])
        await in_step(conn)
        await conn.execute("UPDATE usage_events SET created_at = '2026-10-30T23:59:59.999+00:00', model = 'm3'"
                           " WHERE id IN ('gen-8', 'gen-9')")
        await conn.execute("UPDATE usage_events SET cost = cost + 0.0000000001, prompt_tokens = 7 WHERE org = 'acme'")
        await conn.execute("UPDATE usage_events SET finish_reason = 'length'")
        await in_step(conn)
        await conn.execute("DELETE FROM usage_events WHERE key_id = 'key-1'")
        await in_step(conn)
        await conn.execute("DELETE FROM usage_events")
        assert await in_step(conn) == []
    finally:
        await conn.close()
