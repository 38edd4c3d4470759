"""Schema version 4 on a real PostgreSQL: a version-3 database with rows and live holds is migrated in
place and keeps its slots, holds, spending and per-minute entries; a request costs the gateway one
statement per round trip, each prepared once per connection (the server's own log says so)."""

import re

import asyncpg
import orjson

from kilnproxy.store.postgres import schema as pg_schema
from kilnproxy.testing import completion_body
from kilnproxy.testing.postgres import PostgresServer

HOLD = {"org": "acme", "limit": 2, "granted": 10.0, "amount": 1.0, "prompt_cost": 0.25, "prompt_tokens": 6,
        "created_at": "2026-11-30T22:00:00.000+00:00", "key_id": "key-1", "model": "m", "endpoint": "completions",
        "stream": 1, "key_limit": None, "key_since": None, "tokens": 66, "org_rpm": 100, "org_tpm": None,
        "key_rpm": None, "key_tpm": None}


def usage_row(generation_id: str, cost: float, total_tokens: int) -> dict:
    return {"id": generation_id, "created_at": "2026-11-30T22:00:00.000+00:00", "org": "acme", "key_id": "key-1",
            "model": "m", "endpoint": "completions", "stream": 1, "status": 200, "error_code": None,
            "prompt_tokens": 6, "completion_tokens": total_tokens - 6, "cached_tokens": 0,
            "total_tokens": total_tokens, "cost": cost, "duration_ms": 5.0, "ttft_ms": 1.0,
            "finish_reason": "stop", "disconnected": 0, "requested_model": "m"}


async def admit(conn, replica: str, generation_id: str) -> str:
    holds = orjson.dumps([{**HOLD, "id": generation_id}]).decode()
    row = await conn.fetchrow("SELECT * FROM kiln_admit($1::jsonb, $2, 60)", holds, replica)
    return row["r_verdict"]


async def settle(conn, replica: str, *rows: dict) -> None:
    await conn.fetch("SELECT * FROM kiln_settle($1::jsonb, $2)", orjson.dumps(list(rows)).decode(), replica)


async def minute_tokens(conn) -> dict[str, int]:
    return dict(await conn.fetch("SELECT id, tokens FROM kiln_minute"))


async def test_a_version_3_database_with_rows_and_live_holds_is_migrated_and_keeps_them(pg_url):
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE kiln_schema (version INTEGER NOT NULL)")
        for version in range(3):
            async with conn.transaction():
                await conn.execute(pg_schema.MIGRATIONS[version])
                await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
        await conn.execute("INSERT INTO kiln_replicas (id) VALUES ('live'), ('dead')")
        # version 3 at work: one request settled, one in flight on each replica
        assert await admit(conn, "live", "gen-done") == "ok"
        await settle(conn, "live", usage_row("gen-done", 0.5, 20))
        assert await admit(conn, "live", "gen-live") == "ok"
        assert await admit(conn, "dead", "gen-dead") == "ok"
        assert await minute_tokens(conn) == {"gen-done": 20, "gen-live": 66, "gen-dead": 66}

        assert await pg_schema.migrate(conn) == 3
        assert await conn.fetchval("SELECT max(version) FROM kiln_schema") == len(pg_schema.MIGRATIONS)
        assert await conn.fetchval("SELECT count(*) FROM pg_trigger WHERE tgrelid = 'usage_events'::regclass"
                                   " AND NOT tgisinternal AND tgname NOT LIKE 'usage_daily_%'") == 0  # v15's are spend's
        assert await conn.fetchval("SELECT spent FROM kiln_orgs WHERE org = 'acme'") == 0.5

        # the live holds still take the org's two slots and hold its credits
        assert await admit(conn, "live", "gen-refused") == "rate_limited"
        # the request in flight settles: its hold goes, its row comes, its tokens replace the 66 reserved
        await settle(conn, "live", usage_row("gen-live", 0.75, 30))
        assert {r["id"] for r in await conn.fetch("SELECT id FROM kiln_holds")} == {"gen-dead"}
        assert await conn.fetchval("SELECT spent FROM kiln_orgs WHERE org = 'acme'") == 1.25
        assert (await minute_tokens(conn))["gen-live"] == 30
        # the dead replica's request is reaped: a replica_lost row settles its entry to the prompt's tokens
        await conn.execute("UPDATE kiln_replicas SET seen_at = now() - interval '1 hour' WHERE id = 'dead'")
        assert [tuple(r) for r in await conn.fetch("SELECT * FROM kiln_reap(60)")] == [("acme", 1.5, 1)]
        assert (await minute_tokens(conn))["gen-dead"] == 6
        # ... and the dead replica, back, replaces that row with its own and its entry with the real count
        await settle(conn, "dead", usage_row("gen-dead", 0.5, 40))
        assert await conn.fetchval("SELECT spent FROM kiln_orgs WHERE org = 'acme'") == 1.75
        assert await minute_tokens(conn) == {"gen-done": 20, "gen-live": 30, "gen-dead": 40}
        assert await conn.fetchval("SELECT sum(cost) FROM usage_events") == 1.75
        assert await pg_schema.migrate(conn) == len(pg_schema.MIGRATIONS)  # a second replica: nothing to do
    finally:
        await conn.close()


async def test_a_request_is_one_prepared_statement_per_round_trip(tmp_path, harness, eventually):
    """The server's log (``log_min_duration_statement = 0``: one line per parse, bind and execute):
    each request executes ``kiln_admit`` once and ``kiln_settle`` once, and neither is parsed again
    after its first use on a connection."""
    with PostgresServer() as server:
        url = server.create_database("kiln_v4")
        server.psql("ALTER DATABASE kiln_v4 SET log_min_duration_statement = 0;")
        overrides = {"storage": {"url": url, "spool_path": str(tmp_path / "spool.db")}}
        async with harness(overrides=overrides) as h:
            log_start = server.log.stat().st_size
            requests = 12
            for _ in range(requests):
                async with h.post("/v1/completions", completion_body()) as resp:
                    assert resp.status == 200
                    await resp.read()

            def steps(function: str) -> dict[str, int]:
                with open(server.log, "rb") as f:
                    f.seek(log_start)
                    text = f.read().decode(errors="replace")
                found = re.findall(rf"duration: [0-9.]+ ms  (parse|bind|execute) [^:]*: "
                                   rf"SELECT [a-z_, *]+ FROM {function}\(",
                                   text)
                return {step: found.count(step) for step in ("parse", "bind", "execute")}

            admitted = await eventually(lambda: (s := steps("kiln_admit"))["execute"] >= requests and s)
            settled = await eventually(lambda: (s := steps("kiln_settle"))["execute"] >= requests and s)
            assert admitted == {"parse": 1, "bind": requests, "execute": requests}
            assert settled == {"parse": 1, "bind": requests, "execute": requests}


async def test_connections_the_server_closed_while_idle_are_replaced_without_a_failed_request(
        tmp_path, harness, eventually, postgres, pg_url):
    """The admitter and the writer keep their connections: ended by the server while idle (a
    restart, an idle timeout, ``pg_terminate_backend``), the next request goes on new ones, as it
    would on the pool's."""
    overrides = {"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}}
    async with harness(overrides=overrides) as h:
        store = h.gw.ledger
        async with h.post("/v1/completions", completion_body()) as resp:
            assert resp.status == 200
        await h.gw.rows_committed()  # a lone row's settlement follows its response (the row journal)
        kept = (store.admitter.conn, store.writer.conn)
        assert all(conn is not None for conn in kept)
        pids = [conn.get_server_pid() for conn in kept]
        postgres.psql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid IN ({pids[0]}, {pids[1]});")
        await eventually(lambda: all(conn.is_closed() for conn in kept))
        for _ in range(3):
            async with h.post("/v1/completions", completion_body()) as resp:
                assert resp.status == 200
        assert store.available
        assert len(await h.rows()) == 4
