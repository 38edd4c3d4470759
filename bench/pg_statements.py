"""Where the PostgreSQL store's time goes inside the server, per statement: PG M1's calls, one at a time.

``python bench/pg_statements.py [--calls N] [--rounds R] [--rows N] [--before DIR]`` starts a throw-away
PostgreSQL (``kilnproxy.testing.postgres``, ``pg_stat_statements`` loaded, ``track = all`` so
that the statements inside ``kiln_admit`` and ``kiln_settle`` are counted too), sets up the
schema of this tree (``--rows`` usage rows already in it, 5,000 by default: PG M1's
database after its first seconds; ``--minute N``: per-minute limits on, N entries of another
org's last minute there) and, with ``--before``, a second database with the schema of another tree
(e.g. a ``git archive`` of main), then alternates rounds of N requests on each: one
``kiln_admit`` of one hold, then one ``kiln_settle`` of its row, as PG M1's load makes them
(the same JSON the store sends, on one kept connection, as the admitter and the writer do).

Prints, per database, the server's execution and planning time per call of each statement
(``pg_stat_statements``, mean over all rounds; the functions' own lines include their
statements'), and the client's round trip (p50, as asyncpg sees it).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
import time
from pathlib import Path
from statistics import median

import orjson

HERE = Path(__file__).resolve().parent


def hold(i: int) -> dict:
    return {"id": f"gen-{i}", "org": "acme", "limit": 1000000, "granted": 1e9, "amount": 0.001,
            "prompt_cost": 0.0001, "prompt_tokens": 6, "created_at": "2026-12-02T00:00:00.000+00:00",
            "key_id": "key-1", "model": "bench-json", "endpoint": "completions", "stream": 0,
            "key_limit": None, "key_since": None, "tokens": 66, "org_rpm": None, "org_tpm": None,
            "key_rpm": None, "key_tpm": None}


def row(i: int) -> dict:
    return {"id": f"gen-{i}", "created_at": "2026-12-02T00:00:00.000+00:00", "org": "acme", "key_id": "key-1",
            "model": "bench-json", "endpoint": "completions", "stream": 0, "status": 200, "error_code": None,
            "prompt_tokens": 6, "completion_tokens": 60, "cached_tokens": 0, "total_tokens": 66, "cost": 0.0009,
            "duration_ms": 0.4, "ttft_ms": None, "finish_reason": "stop", "disconnected": 0,
            "requested_model": "bench-json"}


def schema_of(tree: Path | None):
    """The ``migrate`` of the tree's ``kilnproxy.store.postgres.schema`` (this tree's by default)."""
    if tree is None:
        from kilnproxy.store.postgres import schema as postgres_schema
        return postgres_schema.migrate
    saved = {k: v for k, v in sys.modules.items() if k == "kilnproxy" or k.startswith("kilnproxy.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(tree))
    try:
        return importlib.import_module("kilnproxy.store.postgres.schema").migrate
    finally:
        sys.path.remove(str(tree))
        for k in [k for k in sys.modules if k == "kilnproxy" or k.startswith("kilnproxy.")]:
            del sys.modules[k]
        sys.modules.update(saved)


async def setup(url: str, migrate, rows: int, minute: int) -> None:
    import asyncpg
    conn = await asyncpg.connect(url)
    await migrate(conn)
    await conn.execute(
        "INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status, cost, replica)"
        " SELECT 'old-' || g, '2026-12-01T00:00:00.000+00:00', 'acme', 'key-1', 'bench-json', 'completions', 0,"
        " 200, 0.001, 'r0' FROM generate_series(1, $1) g", rows)
    await conn.execute("INSERT INTO kiln_minute (id, org, key_id, at, tokens) SELECT 'minute-' || g, 'other',"
                       " 'key-2', now() + interval '1 hour', 66 FROM generate_series(1, $1) g", minute)
    await conn.execute("ANALYZE usage_events")
    await conn.execute("INSERT INTO kiln_orgs (org) VALUES ('acme') ON CONFLICT DO NOTHING")
    await conn.execute("INSERT INTO kiln_replicas (id) VALUES ('r1') ON CONFLICT DO NOTHING")
    await conn.close()


async def round_of(url: str, start: int, calls: int, bounds: dict | None = None) -> list[float]:
    import asyncpg
    conn = await asyncpg.connect(url)
    trips = []
    try:
        for i in range(start, start + calls):
            t = time.perf_counter()
            holds = orjson.dumps([{**hold(i), **(bounds or {})}]).decode()
            await conn.fetch("SELECT * FROM kiln_admit($1::jsonb, $2, $3)", holds, "r1", 15.0)
            t1 = time.perf_counter()
            await conn.fetch("SELECT * FROM kiln_settle($1::jsonb, $2)", orjson.dumps([row(i)]).decode(), "r1")
            trips += [t1 - t, time.perf_counter() - t1]
            if i % 500 == 0:  # the replica stays live: its holds count
                await conn.execute("UPDATE kiln_replicas SET seen_at = now() WHERE id = 'r1'")
    finally:
        await conn.close()
    return trips


def stats(pg, db: str) -> list[tuple[float, float, int, str]]:
    out = pg.psql("SELECT round((total_exec_time / calls)::numeric * 1000, 1), round((total_plan_time / calls)::numeric * 1000, 1), calls, "
                  "regexp_replace(left(query, 110), '\\s+', ' ', 'g') FROM pg_stat_statements s "
                  f"JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{db}' AND calls >= 100 "
                  "ORDER BY total_exec_time DESC LIMIT 14;", database=db)
    rows = []
    for line in out.splitlines():
        us, plan, calls, query = line.split("|", 3)
        rows.append((float(us), float(plan), int(calls), query))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--before", type=Path, help="a tree (git archive) whose schema to measure beside this one's")
    ap.add_argument("--rows", type=int, default=5000, help="usage rows already there (a gateway that has served some)")
    ap.add_argument("--minute", type=int, default=0,
                    help="per-minute limits on: the admissions carry one, and N entries of another org are there")
    ap.add_argument("--fsync", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE: a setting of the databases")
    args = ap.parse_args()
    from kilnproxy.testing.postgres import PostgresServer

    with PostgresServer(fsync=args.fsync) as pg:
        pg.start()
        pg.psql("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements';")
        pg.stop()
        pg.start()
        trees = {"after": None} | ({"before": args.before} if args.before else {})
        urls = {}
        for name, tree in trees.items():
            urls[name] = pg.create_database(f"kiln_{name}")
            asyncio.run(setup(urls[name], schema_of(tree), args.rows, args.minute))
            pg.psql("CREATE EXTENSION pg_stat_statements;", database=f"kiln_{name}")
            pg.psql(f"ALTER DATABASE kiln_{name} SET pg_stat_statements.track = 'all';")
            pg.psql(f"ALTER DATABASE kiln_{name} SET pg_stat_statements.track_planning = 'on';")
            pg.psql(f"ALTER DATABASE kiln_{name} SET track_functions = 'pl';")
            for setting in args.set:
                key, _, value = setting.partition("=")
                pg.psql(f"ALTER DATABASE kiln_{name} SET {key} = '{value}';")
        for name in urls:  # warm-up, then clean figures
            asyncio.run(round_of(urls[name], 10_000_000, 200))
        pg.psql("SELECT pg_stat_statements_reset();", database="kiln_after")
        pg.psql("SELECT pg_stat_reset();", database="kiln_after")
        trips: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(args.rounds):
            for name in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                trips[name] += asyncio.run(round_of(urls[name], r * args.calls, args.calls,
                                                   {"org_rpm": 10**9} if args.minute else None))
        for name in urls:
            print(f"\n== {name}: server time per call (µs), all {args.rounds} rounds, {args.calls} calls a round")
            print("    exec     plan   calls")
            for us, plan, calls, query in stats(pg, f"kiln_{name}"):
                print(f"{us:8.1f} {plan:8.1f} {calls:7d}  {query}")
            admit, settle = trips[name][0::2], trips[name][1::2]
            print(f"client round trip p50: admit {median(admit) * 1e6:.0f} µs, settle {median(settle) * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
