"""PG: M1, M2 and M3 with the usage store in PostgreSQL beside the same gateway on SQLite.

The database is a throw-away PostgreSQL server (``kilnproxy.testing.postgres``)
on this machine, with fsync on as in production, running on the load
generators' CPU; the gateway is pinned to its own CPU as in M1-M3. The
PostgreSQL row is the database as created (``synchronous_commit`` at its
default, on: a row is on disk before its response ends); a third gateway
uses a database set to ``synchronous_commit = off``. Targets (issue 22): M1's
p50 on PostgreSQL ≤ SQLite's + 1 ms, and M2 on PostgreSQL ≥ 90% of M2 on
SQLite per full core.

Beside the figures of the gateway, what PostgreSQL itself spent: the time
inside ``kiln_admit`` and ``kiln_settle`` per call during M1 (one request at
a time, so one call of each per request; ``pg_stat_user_functions`` with
``track_functions = pl``), and what a synchronous commit costs over an
asynchronous one on this machine's disk at the time (M1's floor: the row's
commit waits for the WAL flush).
"""

from __future__ import annotations

import asyncio
import time
from statistics import median

from report import ratio, spread, table
from upstreams import CHUNKS, request_body

SQLITE, PG = "kilnproxy, SQLite", "kilnproxy, PostgreSQL"
PG_ASYNC = "kilnproxy, PostgreSQL, synchronous_commit off"


def storage_toml(url: str) -> str:
    return f'url = "{url}"\nspool_path = "pg-spool.db"\nreplica_timeout_seconds = 15'


def measure(bench, postgres) -> None:
    """``postgres``: a running ``PostgresServer``."""
    postgres.psql("ALTER DATABASE kiln SET track_functions = 'pl';")
    gw_pg = bench.gateway("kilnproxy-pg", storage=storage_toml(postgres.url()))
    async_url = postgres.create_database("kiln_async")
    postgres.psql("ALTER DATABASE kiln_async SET synchronous_commit = off;")
    gw_async = bench.gateway("kilnproxy-pg-async", storage=storage_toml(async_url))
    json_targets = {SQLITE: f"{bench.gw}/v1/completions", PG: f"{gw_pg}/v1/completions",
                    PG_ASYNC: f"{gw_async}/v1/completions"}

    postgres.psql("SELECT pg_stat_reset();", database="kiln")
    m1 = bench.wrk_rounds(json_targets, request_body(False), 1)
    functions = function_ms(postgres)
    commit = asyncio.run(commit_ms(postgres.url()))
    p50 = {k: [s["p50_us"] / 1000 for s in v] for k, v in m1.items()}
    p99 = {k: [s["p99_us"] / 1000 for s in v] for k, v in m1.items()}
    added = [p - s for p, s in zip(p50[PG], p50[SQLITE])]
    added_async = [p - s for p, s in zip(p50[PG_ASYNC], p50[SQLITE])]

    m2 = bench.wrk_rounds(json_targets, request_body(False), 64)
    m3 = bench.wrk_rounds(json_targets, request_body(True, model="bench-stream"), 32)

    def per_core(res, per):
        return {k: [per * 1e6 / s["cpu_us"] for s in v] for k, v in res.items()}

    def rate(res, per):
        return {k: [s["rps"] * per for s in v] for k, v in res.items()}

    rows = []
    for name in (SQLITE, PG, PG_ASYNC):
        rows.append([name, spread(p50[name], "{:.3f}"), spread(p99[name], "{:.3f}"),
                     spread(rate(m2, 1)[name]), spread(per_core(m2, 1)[name]),
                     spread(rate(m3, CHUNKS)[name]), spread(per_core(m3, CHUNKS)[name])])
    m2_share = ratio(per_core(m2, 1)[PG], per_core(m2, 1)[SQLITE])
    m3_share = ratio(per_core(m3, CHUNKS)[PG], per_core(m3, CHUNKS)[SQLITE])
    rows.append(["PostgreSQL vs SQLite", spread(added, "{:+.3f}"), "", ratio(rate(m2, 1)[PG], rate(m2, 1)[SQLITE]),
                 m2_share, ratio(rate(m3, CHUNKS)[PG], rate(m3, CHUNKS)[SQLITE]), m3_share])
    rows.append(["PostgreSQL, synchronous_commit off, vs SQLite", spread(added_async, "{:+.3f}"), "",
                 ratio(rate(m2, 1)[PG_ASYNC], rate(m2, 1)[SQLITE]),
                 ratio(per_core(m2, 1)[PG_ASYNC], per_core(m2, 1)[SQLITE]),
                 ratio(rate(m3, CHUNKS)[PG_ASYNC], rate(m3, CHUNKS)[SQLITE]),
                 ratio(per_core(m3, CHUNKS)[PG_ASYNC], per_core(m3, CHUNKS)[SQLITE])])
    bench.sections.append(
        "## PG: the usage store in PostgreSQL beside SQLite (M1, M2, M3)\n\n" + table(
            ["", "M1 p50 ms", "M1 p99 ms", "M2 requests/s", "M2 per full core", f"M3 chunks/s",
             "M3 per full core"], rows)
        + "\n\nPostgreSQL 15 on this machine (fsync on), on the load generators' CPU. Per request the "
          "PostgreSQL store adds one round trip at admission (slot and credit hold, batched with the requests "
          "admitted at the same moment) and shares a group commit at the end (rows, holds released, "
          "spending), whose commit waits for PostgreSQL's WAL flush: an fdatasync took "
          f"{fsync_ms():.1f} ms on this machine's disk during the run (under other load it can take "
          "several ms, and then dominates M1). The third row is "
          "the same gateway on a database set to `synchronous_commit = off` (rows of the last ~0.6 s may "
          "be lost if PostgreSQL itself crashes; a killed replica still loses none).\n\n"
          "Inside PostgreSQL during M1 (one request at a time), per call: "
          + ", ".join(f"`{name}` {ms:.3f} ms" for name, ms in functions.items())
          + f"; a synchronous commit (one row, p50) took {commit['on']:.3f} ms, an asynchronous one "
          f"{commit['off']:.3f} ms (p90 {commit['on_p90']:.3f} and {commit['off_p90']:.3f} ms).")
    share = [p / s * 100 for p, s in zip(per_core(m2, 1)[PG], per_core(m2, 1)[SQLITE])]
    bench.goal("PG M2", "≥ 90% of M2 on SQLite (per full core)", spread(share, "{:.0f}%"), median(share) >= 90)
    bench.goal("PG M1", "p50 added by PostgreSQL ≤ 1 ms", spread(added, "{:+.3f} ms"), median(added) <= 1.0)
    bench.goal("PG M1, synchronous_commit off", "p50 added by PostgreSQL ≤ 1 ms", spread(added_async, "{:+.3f} ms"),
               median(added_async) <= 1.0)


def function_ms(postgres) -> dict[str, float]:
    """Mean time inside each of the store's functions per call since the last ``pg_stat_reset()``
    (statistics reach the view within a second or so of a call: waited for)."""
    names = ("kiln_admit", "kiln_settle")
    sql = ("SELECT funcname, calls, total_time FROM pg_stat_user_functions WHERE funcname IN "
           f"({', '.join(repr(n) for n in names)}) ORDER BY funcname;")
    deadline = time.monotonic() + 15
    while True:
        found = {}
        for line in postgres.psql(sql, database="kiln").split():
            name, calls, total = line.split("|")
            if int(calls):
                found[name] = float(total) / int(calls)
        if len(found) == len(names) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


async def commit_ms(url: str, commits: int = 200) -> dict[str, float]:
    """p50 and p90 of a one-row INSERT committed with ``synchronous_commit`` on, then off (ms)."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        # not a TEMP table: those write no WAL, so their commits wait for no flush
        await conn.execute("CREATE TABLE bench_commit (id serial PRIMARY KEY, v text)")
        figures = {}
        for mode in ("on", "off"):
            await conn.execute(f"SET synchronous_commit = {mode}")
            times = []
            for _ in range(commits):
                started = time.perf_counter()
                await conn.execute("INSERT INTO bench_commit (v) VALUES ('x')")
                times.append((time.perf_counter() - started) * 1000)
            times.sort()
            figures[mode], figures[f"{mode}_p90"] = times[len(times) // 2], times[len(times) * 9 // 10]
        await conn.execute("DROP TABLE bench_commit")
        return figures
    finally:
        await conn.close()


def fsync_ms() -> float:
    """One 8 kB write + fdatasync on this machine's disk, as PostgreSQL's WAL flush does (ms)."""
    import os
    import tempfile
    import time
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as f:
        times = []
        for _ in range(50):
            os.write(f.fileno(), b"\0" * 8192)
            started = time.perf_counter()
            os.fdatasync(f.fileno())
            times.append(time.perf_counter() - started)
    return median(times) * 1000
