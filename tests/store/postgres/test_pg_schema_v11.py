"""Schema version 11 on a real PostgreSQL: the usage row's ``upstream`` (SPEC 13). A version-10 database
with rows, a ``replica_lost`` row among them and a hold in flight, is migrated in place: the old rows keep
everything and hold NULL; ``kiln_settle`` keeps the ``upstream`` of the rows it settles, also when one
replaces a ``replica_lost`` row, and a row from a replica of the release before (no such field) holds NULL."""

import asyncpg
import orjson

from kilnproxy.store.postgres import schema as pg_schema
from kilnproxy.usage import COLUMNS

HOLD = {"org": "acme", "limit": 100, "granted": 1e6, "amount": 1.0, "prompt_cost": 0.25, "prompt_tokens": 6,
        "created_at": "2026-12-02T01:00:00.000+00:00", "key_id": "key-1", "model": "m", "endpoint": "completions",
        "stream": 0, "key_limit": None, "key_since": None, "tokens": 66, "org_rpm": None, "org_tpm": None,
        "key_rpm": None, "key_tpm": None}


def usage_row(generation_id: str, cost: float, **extra) -> dict:
    return {"id": generation_id, "created_at": "2026-12-02T01:00:00.000+00:00", "org": "acme", "key_id": "key-1",
            "model": "m", "endpoint": "completions", "stream": 0, "status": 200, "error_code": None,
            "prompt_tokens": 6, "completion_tokens": 14, "cached_tokens": 0, "total_tokens": 20, "cost": cost,
            "duration_ms": 5.0, "ttft_ms": None, "finish_reason": "stop", "disconnected": 0, "requested_model": "m",
            **extra}


async def admit(conn, replica: str, generation_id: str) -> str:
    holds = orjson.dumps([{**HOLD, "id": generation_id}]).decode()
    return (await conn.fetchrow("SELECT * FROM kiln_admit($1::jsonb, $2, 60)", holds, replica))["r_verdict"]


async def settle(conn, replica: str, *rows: dict) -> list:
    return [tuple(r) for r in await conn.fetch("SELECT * FROM kiln_settle($1::jsonb, $2)",
                                               orjson.dumps(list(rows)).decode(), replica)]


async def test_version_10_migrated_in_place_and_settlements_keep_the_upstream(pg_url):
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE kiln_schema (version INTEGER NOT NULL)")
        for version in range(10):
            async with conn.transaction():
                await conn.execute(pg_schema.MIGRATIONS[version])
                await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
        await conn.execute("INSERT INTO kiln_replicas (id) VALUES ('live'), ('dead')")
        # version 10 at work: a row settled, a request in flight, and one of a replica that died, reaped
        assert await admit(conn, "live", "gen-old") == "ok"
        assert await settle(conn, "live", usage_row("gen-old", 0.5)) == [("acme", 0.5)]
        assert await admit(conn, "live", "gen-flying") == "ok"
        assert await admit(conn, "dead", "gen-dead") == "ok"
        await conn.execute("UPDATE kiln_replicas SET seen_at = now() - interval '1 hour' WHERE id = 'dead'")
        assert [r["lost"] for r in await conn.fetch("SELECT * FROM kiln_reap(60)")] == [1]
        before = [dict(r) for r in await conn.fetch("SELECT * FROM usage_events ORDER BY id")]

        assert await pg_schema.migrate(conn) == 10
        assert await conn.fetchval("SELECT max(version) FROM kiln_schema") == len(pg_schema.MIGRATIONS)
        after = [dict(r) for r in await conn.fetch("SELECT * FROM usage_events ORDER BY id")]
        assert [{k: v for k, v in r.items() if k != "upstream"} for r in after] == before
        assert [r["upstream"] for r in after] == [None, None]  # gen-dead (replica_lost), gen-old

        await settle(conn, "live", usage_row("gen-flying", 0.25, upstream="http://gpu2:8080/v1"),
                               usage_row("gen-dead", 0.125, upstream="http://gpu1:8080/v1"),  # its replica came back
                               usage_row("gen-previous-release", 0.0625))  # no upstream field: NULL
        rows = {r["id"]: r for r in await conn.fetch(f"SELECT {', '.join(COLUMNS)}, replica FROM usage_events")}
        assert rows["gen-flying"]["upstream"] == "http://gpu2:8080/v1"
        assert rows["gen-dead"]["upstream"] == "http://gpu1:8080/v1"
        assert rows["gen-dead"]["error_code"] is None and rows["gen-dead"]["replica"] == "live"
        assert rows["gen-previous-release"]["upstream"] is None
        assert rows["gen-old"]["upstream"] is None
        # the org's spend is still the sum of its rows
        assert await conn.fetchval("SELECT spent FROM kiln_orgs WHERE org = 'acme'") == \
            await conn.fetchval("SELECT sum(cost) FROM usage_events WHERE org = 'acme'")
        # and a migrated database is at the current version: nothing more to do
        assert await pg_schema.migrate(conn) == len(pg_schema.MIGRATIONS)
    finally:
        await conn.close()
