"""The spend query on a generated ledger of 10 million rows, on SQLite and on PostgreSQL.

    PYTHONPATH=. python bench/spend_query.py [--rows 10000000] [--stores sqlite,pg] [--keep DIR] [--runs 15]

The ledger: ``--rows`` usage rows over ``--days`` (100) days ending 2026-12-01, the same number each
day at times spread over the day, 20 orgs of 10 keys each, 8 models, tokens and costs drawn at random
(costs rounded to 10 decimals, as the gateway rounds them). It is written the fast way (one
transaction of multi-row INSERTs on SQLite, ``COPY`` on PostgreSQL) into a ledger made by an older
kilnproxy (the table and its indexes, no rollup), then opened as a gateway opens it: SQLite's
``prepare_file``, PostgreSQL's migration to the last version, which builds ``usage_daily`` from the rows;
that time is reported too. The SQLite file kept with ``--keep DIR`` is used again by a later run.

Timed, each ``--runs`` times (median, min-max), by the store's own query (``kilnproxy.store.spend``),
answer rows included: 30 days by day and model for every org, whole days (``from`` and ``to`` dates)
and from a time to a time (13:27 on both ends: two partial days read from the rows); the same for one
org; and beside each, the same answer from a plain scan of the rows (``statement(..., rollup=False)``),
the baseline. Every answer is checked equal to the scan's. Results go to
``bench/results/partial/<date>-<time>-spend.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

from kilnproxy.store import spend
from kilnproxy.store.sqlite.schema import NEW_FILE_PAGE_SIZE, SCHEMA, prepare_file
from kilnproxy.usage import COLUMNS

LAST_DAY = date(2026, 11, 30)
ORGS = [f"org-{i:02d}" for i in range(20)]
KEYS = [(org, f"key_{org}_{k}") for org in ORGS for k in range(10)]
MODELS = [("llama-3.1-8b", 0.05, 0.08), ("llama-3.3-70b", 0.60, 0.80), ("qwen3-32b", 0.10, 0.30),
          ("qwen3-235b", 0.22, 0.88), ("gemma-3-27b", 0.09, 0.17), ("mistral-small-3", 0.10, 0.30),
          ("deepseek-v3", 0.27, 1.10), ("bge-m3", 0.01, 0.0)]
QUERIES = [  # (name, parameters)
    ("30 days by day and model, whole days", {"from": "2026-11-01", "to": "2026-12-01", "group_by": "day,model"}),
    ("30 days by day and model, 13:27 to 13:27", {"from": "2026-10-31T13:27:00Z", "to": "2026-11-30T13:27:00Z",
                                                 "group_by": "day,model"}),
    ("one org, 30 days by day and model, whole days", {"from": "2026-11-01", "to": "2026-12-01",
                                                      "group_by": "day,model", "org": "org-07"}),
    ("one org, 30 days by day and model, 13:27 to 13:27", {"from": "2026-10-31T13:27:00Z",
                                                          "to": "2026-11-30T13:27:00Z",
                                                          "group_by": "day,model", "org": "org-07"}),
]


def rows(count: int, days: int, seed: int = 42):
    """The ledger's rows in time order, as tuples in ``COLUMNS`` order."""
    rnd = random.Random(seed)
    per_day = count // days
    first = datetime.combine(LAST_DAY - timedelta(days=days - 1), datetime.min.time(), timezone.utc)
    n = 0
    for d in range(days):
        day = first + timedelta(days=d)
        stamps = sorted(rnd.randrange(86_400_000) for _ in range(per_day if d < days - 1 else count - n))
        for ms in stamps:
            org, key = KEYS[rnd.randrange(len(KEYS))]
            model, p_price, c_price = MODELS[rnd.randrange(len(MODELS))]
            prompt = rnd.randrange(20, 4000)
            completion = 0 if model == "bge-m3" else rnd.randrange(1, 800)
            cached = rnd.randrange(prompt) if rnd.random() < 0.3 else 0
            error = rnd.random() < 0.02
            cost = round((prompt * p_price + completion * c_price) / 1e6, 10)
            created = (day + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds")
            yield (f"gen-{n:012d}", created, org, key, model, "chat/completions", 1, 429 if error else 200,
                   "rate_limited" if error else None, 0 if error else prompt, 0 if error else completion,
                   0 if error else cached, 0 if error else prompt + completion, 0.0 if error else cost,
                   rnd.uniform(50, 5000), rnd.uniform(10, 500), None if error else "stop", 0, model,
                   "http://10.0.0.1:8000/v1")
            n += 1


def timed(fn, runs: int) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1000)
    return times, result


def fmt(times: list[float]) -> str:
    return f"{statistics.median(times):.1f} ms ({min(times):.1f}-{max(times):.1f})"


# -- SQLite -----------------------------------------------------------------------------------------

def sqlite_ledger(path: Path, count: int, days: int) -> list[str]:
    notes = []
    if not path.exists():
        db = sqlite3.connect(path, isolation_level=None)
        db.execute(f"PRAGMA page_size={NEW_FILE_PAGE_SIZE}")
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.executescript(SCHEMA)
        start = time.perf_counter()
        sql = f"INSERT INTO usage_events ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
        db.execute("BEGIN")
        batch = []
        for row in rows(count, days):
            batch.append(row)
            if len(batch) == 100_000:
                db.executemany(sql, batch)
                batch.clear()
        db.executemany(sql, batch)
        db.execute("COMMIT")
        db.close()
        notes.append(f"written: {count:,} rows in {time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    prepare_file(path)  # as a gateway opens it: the rollup built from the rows
    notes.append(f"opened (rollup built if missing) in {time.perf_counter() - start:.1f} s; "
                 f"file {path.stat().st_size / 2**30:.2f} GiB")
    return notes


def sqlite_bench(path: Path, runs: int) -> list[tuple[str, str, str, int]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    out = []
    for name, params in QUERIES:
        q = spend.parse_spend(params, org_scoped=False)
        fast_sql, fast_args = spend.statement(q)
        scan_sql, scan_args = spend.statement(q, rollup=False)
        fast_times, fast = timed(lambda: spend.answer_rows(q, db.execute(fast_sql, fast_args).fetchall()), runs)
        scan_times, scan = timed(lambda: spend.answer_rows(q, db.execute(scan_sql, scan_args).fetchall()),
                                 max(3, runs // 5))
        assert fast == scan, f"{name}: the rollup's answer differs from the scan's"
        out.append((name, fmt(fast_times), fmt(scan_times), len(fast)))
    db.close()
    return out


# -- PostgreSQL -------------------------------------------------------------------------------------

async def pg_ledger(url: str, count: int, days: int) -> list[str]:
    import asyncpg

    from kilnproxy.store.postgres.schema import MIGRATIONS, migrate
    notes = []
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS kiln_schema (version INTEGER NOT NULL)")
        found = await conn.fetchval("SELECT max(version) FROM kiln_schema") or 0
        if found == 0:  # an older kilnproxy's database: every version but the rollup's
            for version in range(len(MIGRATIONS) - 1):
                async with conn.transaction():
                    await conn.execute(MIGRATIONS[version])
                    await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
            start = time.perf_counter()
            batch = []
            columns = list(COLUMNS)
            for row in rows(count, days):
                batch.append(row)
                if len(batch) == 200_000:
                    await conn.copy_records_to_table("usage_events", records=batch, columns=columns)
                    batch.clear()
            await conn.copy_records_to_table("usage_events", records=batch, columns=columns)
            await conn.execute("ANALYZE usage_events")
            notes.append(f"written (COPY): {count:,} rows in {time.perf_counter() - start:.0f} s")
        start = time.perf_counter()
        await migrate(conn)
        await conn.execute("ANALYZE usage_daily")
        notes.append(f"migrated (rollup built if missing) in {time.perf_counter() - start:.1f} s; database "
                     f"{await conn.fetchval('SELECT pg_size_pretty(pg_database_size(current_database()))')}")
    finally:
        await conn.close()
    return notes


async def pg_bench(url: str, runs: int) -> list[tuple[str, str, str, int]]:
    import asyncpg

    from kilnproxy.store.postgres.connection import numbered
    conn = await asyncpg.connect(url)
    out = []
    try:
        for name, params in QUERIES:
            q = spend.parse_spend(params, org_scoped=False)
            fast_sql, fast_args = spend.statement(q)
            scan_sql, scan_args = spend.statement(q, rollup=False)
            fast_sql, scan_sql = numbered(fast_sql), numbered(scan_sql)

            async def run(sql, args, n):
                times, result = [], None
                for _ in range(n):
                    start = time.perf_counter()
                    result = spend.answer_rows(q, [dict(r) for r in await conn.fetch(sql, *args)])
                    times.append((time.perf_counter() - start) * 1000)
                return times, result
            fast_times, fast = await run(fast_sql, fast_args, runs)
            scan_times, scan = await run(scan_sql, scan_args, max(3, runs // 5))
            assert fast == scan, f"{name}: the rollup's answer differs from the scan's"
            out.append((name, fmt(fast_times), fmt(scan_times), len(fast)))
    finally:
        await conn.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=100)
    parser.add_argument("--stores", default="sqlite,pg")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--keep", help="a folder to keep the SQLite file in, used again by a later run")
    args = parser.parse_args()
    folder = Path(args.keep or tempfile.mkdtemp(prefix="kiln-spend-"))
    folder.mkdir(parents=True, exist_ok=True)
    report = [f"# spend query on {args.rows:,} generated usage rows ({args.days} days, {len(ORGS)} orgs, "
              f"{len(KEYS)} keys, {len(MODELS)} models)", "",
              f"`PYTHONPATH=. python bench/spend_query.py {' '.join(sys.argv[1:])}`, "
              f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.1f} at start", ""]
    tables = []
    if "sqlite" in args.stores.split(","):
        path = folder / "ledger.db"
        notes = sqlite_ledger(path, args.rows, args.days)
        print("sqlite:", *notes, sep="\n  ", flush=True)
        tables.append(("SQLite", notes, sqlite_bench(path, args.runs)))
    if "pg" in args.stores.split(","):
        from kilnproxy.testing.postgres import PostgresServer
        server = PostgresServer()  # a throw-away server, removed at the end
        server.start()
        try:
            url = server.url()
            notes = asyncio.run(pg_ledger(url, args.rows, args.days))
            print("postgresql:", *notes, sep="\n  ", flush=True)
            tables.append(("PostgreSQL", notes, asyncio.run(pg_bench(url, args.runs))))
        finally:
            server.stop()
            server.remove()
    for store, notes, results in tables:
        report += [f"## {store}", "", *[f"- {n}" for n in notes], "",
                   "| query | rollup + index (median, min-max) | plain scan of the rows | answer rows |",
                   "|---|---|---|---|"]
        report += [f"| {name} | {fast} | {scan} | {n} |" for name, fast, scan, n in results]
        report.append("")
    text = "\n".join(report)
    print(text)
    out = Path(__file__).parent / "results" / "partial" / f"{datetime.now(timezone.utc):%Y-%m-%d-%H%M}-spend.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
