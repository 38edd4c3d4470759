"""A settlement and an admission taking the same per-minute entries, on a real PostgreSQL: they took
them in different orders and could deadlock (schema version 8); so could a reap and an admission
(schema version 10).

``kiln_settle`` updates the entries of its rows (their tokens); an admission that checks an org's
per-minute bound (``kiln_minute_full``) first deletes the org's entries older than 60 s. Two
requests of one org longer than 60 s, settled in one batch while another request of the org is
admitted: the settlement took the entries in the order of their ids, the admission in the order of
their time (the ``(org, at)`` index). Sessions here run with ``enable_seqscan = off`` to get the
plans a table of some size gets; a third session holds the first entry so that each side is
waiting where it would be, and the test waits for the sessions to be waiting on a lock
(``pg_stat_activity``), never for time.
"""

from __future__ import annotations

import asyncio

import asyncpg
import orjson
import pytest

from kilnproxy.store.postgres.schema import migrate

GUARD_SECONDS = 20  # a bound on events that come within a second: a test that hangs fails instead
HOLD = {"id": "gen-c", "org": "acme", "limit": 100, "granted": 1e6, "amount": 1.0, "prompt_cost": 0.25,
        "prompt_tokens": 6, "created_at": "2026-12-02T01:02:00.000+00:00", "key_id": "key-1", "model": "m",
        "endpoint": "completions", "stream": 0, "key_limit": None, "key_since": None, "tokens": 66,
        "org_tpm": None, "key_tpm": None}
ROW = {"org": "acme", "key_id": "key-1", "model": "m", "endpoint": "completions", "stream": 0, "status": 200,
       "error_code": None, "prompt_tokens": 6, "completion_tokens": 60, "cached_tokens": 0, "total_tokens": 66,
       "cost": 0.5, "duration_ms": 61000.0, "ttft_ms": 10.0, "finish_reason": "stop", "disconnected": 0,
       "requested_model": "m"}


async def waiting_or_done(conn: asyncpg.Connection, pid: int, task: asyncio.Task) -> None:
    """Once the session ``pid`` waits for a lock, or ``task`` (its statement) has ended."""
    async with asyncio.timeout(GUARD_SECONDS):
        while not task.done() and not await conn.fetchval(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid):
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("bound", ["org_rpm", "key_rpm"])
async def test_a_settlement_and_an_admission_taking_old_minute_entries_do_not_deadlock(pg_url, bound):
    """gen-a admitted 90 s ago, gen-b 120 s ago (ids and times in opposite orders), both settled in one
    batch while gen-c of the same org and key is admitted under a ``requests_per_minute`` of the org
    (its entries dropped by org) or of the key (by key): the settlement
    took gen-a and waited for gen-b, the admission took gen-b and waited for gen-a, and PostgreSQL
    ended one of them (DeadlockDetectedError: rows spooled, or requests answered 503). Now both take
    the entries in the order of their ids: the settlement commits, then the admission drops the two
    old entries and admits gen-c."""
    conn = await asyncpg.connect(pg_url)
    await migrate(conn)
    await conn.execute("INSERT INTO kiln_replicas (id) VALUES ('r1')")
    await conn.execute("INSERT INTO kiln_minute (id, org, key_id, at, tokens) VALUES"
                       " ('gen-a', 'acme', 'key-1', now() - interval '90 seconds', 66),"
                       " ('gen-b', 'acme', 'key-1', now() - interval '120 seconds', 66)")
    plans = {"enable_seqscan": "off"}
    gate = await asyncpg.connect(pg_url)
    settlement = await asyncpg.connect(pg_url, server_settings=plans)
    admission = await asyncpg.connect(pg_url, server_settings=plans)
    try:
        await gate.execute("BEGIN")
        await gate.execute("SELECT 1 FROM kiln_minute WHERE id = 'gen-a' FOR UPDATE")
        rows = [{**ROW, "id": "gen-a", "created_at": "2026-12-02T01:00:30.000+00:00"},
                {**ROW, "id": "gen-b", "created_at": "2026-12-02T01:00:00.000+00:00"}]
        settle = asyncio.create_task(settlement.fetch("SELECT * FROM kiln_settle($1::jsonb, 'r1')",
                                                      orjson.dumps(rows).decode()))
        await waiting_or_done(conn, settlement.get_server_pid(), settle)
        admit = asyncio.create_task(admission.fetch("SELECT r_verdict FROM kiln_admit($1::jsonb, 'r1', 60)",
                                                    orjson.dumps([{**HOLD, bound: 1000}]).decode()))
        await waiting_or_done(conn, admission.get_server_pid(), admit)
        await gate.execute("COMMIT")
        settled, admitted = await asyncio.wait_for(
            asyncio.gather(settle, admit, return_exceptions=True), GUARD_SECONDS)
        assert not isinstance(settled, BaseException), settled
        assert not isinstance(admitted, BaseException), admitted
        assert [tuple(r) for r in settled] == [("acme", 1.0)]
        assert [tuple(r) for r in admitted] == [("ok",)]
        assert await conn.fetchval("SELECT array_agg(id ORDER BY id) FROM kiln_minute") == ["gen-c"]
        assert await conn.fetchval("SELECT array_agg(id ORDER BY id) FROM usage_events") == ["gen-a", "gen-b"]
        assert await conn.fetchval("SELECT array_agg(id ORDER BY id) FROM kiln_holds") == ["gen-c"]
    finally:
        for c in (gate, settlement, admission, conn):
            await c.close()


async def test_a_reap_and_an_admission_taking_old_minute_entries_do_not_deadlock(pg_url):
    """gen-b then gen-a placed by replica ``dead``, silent for an hour, their entries 120 s and 90 s old
    (ids, times and places in the table in opposite orders), reaped while gen-c of the same org is
    admitted under the org's ``requests_per_minute``: the reap took the entries in the order its join
    returned them (gen-b, then gen-a), the admission in the order of their ids, and PostgreSQL ended
    one of them (DeadlockDetectedError: a warning and another reap a heartbeat later, or requests
    answered 503). Now the reap takes them in the order of their ids too: the admission drops the two
    old entries and admits gen-c, the reap turns both holds into replica_lost rows."""
    conn = await asyncpg.connect(pg_url)
    await migrate(conn)
    await conn.execute("INSERT INTO kiln_replicas (id) VALUES ('dead'), ('r1')")
    for generation_id in ("gen-b", "gen-a"):
        batch = orjson.dumps([{**HOLD, "id": generation_id, "org_rpm": None}]).decode()
        assert await conn.fetchval("SELECT r_verdict FROM kiln_admit($1::jsonb, 'dead', 60)", batch) == "ok"
    await conn.execute("INSERT INTO kiln_minute (id, org, key_id, at, tokens) VALUES"
                       " ('gen-b', 'acme', 'key-1', now() - interval '120 seconds', 66),"
                       " ('gen-a', 'acme', 'key-1', now() - interval '90 seconds', 66)")
    await conn.execute("UPDATE kiln_replicas SET seen_at = now() - interval '1 hour' WHERE id = 'dead'")
    gate = await asyncpg.connect(pg_url)
    reaper = await asyncpg.connect(pg_url)
    admission = await asyncpg.connect(pg_url, server_settings={"enable_seqscan": "off"})
    try:
        await gate.execute("BEGIN")
        await gate.execute("SELECT 1 FROM kiln_minute WHERE id = 'gen-a' FOR UPDATE")
        admit = asyncio.create_task(admission.fetch("SELECT r_verdict FROM kiln_admit($1::jsonb, 'r1', 60)",
                                                    orjson.dumps([{**HOLD, "org_rpm": 1000}]).decode()))
        await waiting_or_done(conn, admission.get_server_pid(), admit)
        reap = asyncio.create_task(reaper.fetch("SELECT * FROM kiln_reap(60)"))
        await waiting_or_done(conn, reaper.get_server_pid(), reap)
        await gate.execute("COMMIT")
        reaped, admitted = await asyncio.wait_for(
            asyncio.gather(reap, admit, return_exceptions=True), GUARD_SECONDS)
        assert not isinstance(reaped, BaseException), reaped
        assert not isinstance(admitted, BaseException), admitted
        assert [tuple(r) for r in reaped] == [("acme", 0.5, 2)]
        assert [tuple(r) for r in admitted] == [("ok",)]
        assert await conn.fetchval("SELECT array_agg(id ORDER BY id) FROM kiln_minute") == ["gen-c"]
        lost = await conn.fetch("SELECT id, error_code FROM usage_events ORDER BY id")
        assert [tuple(r) for r in lost] == [("gen-a", "replica_lost"), ("gen-b", "replica_lost")]
        assert await conn.fetchval("SELECT array_agg(id ORDER BY id) FROM kiln_holds") == ["gen-c"]
    finally:
        for c in (gate, reaper, admission, conn):
            await c.close()
