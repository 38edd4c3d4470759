"""The reaping of a silent replica's holds against a settlement, on a real PostgreSQL: the two took
the holds in different orders and could deadlock (schema version 7); a reap PostgreSQL ends anyway
(a deadlock with another session, a lock held past the lock timeout) is one log line, tried again at
the next heartbeat, not a traceback nor the store down.

Plain asyncpg connections play the settlement and the operator, taking locks one statement at a
time, so that each order is taken for certain; a test waits for the other session to be waiting
on a lock (``pg_stat_activity``), never for time.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import orjson

from kilnproxy.store.postgres.connection import down_error
from kilnproxy.store.postgres.schema import migrate
from kilnproxy.store.postgres.replicas import Heartbeat

HOLD = {"limit": 100, "granted": 1e6, "amount": 1.0, "prompt_cost": 0.25, "prompt_tokens": 6,
        "created_at": "2026-12-02T01:00:00.000+00:00", "key_id": "key-1", "model": "m", "endpoint": "completions",
        "stream": 0, "key_limit": None, "key_since": None, "tokens": 66, "org_rpm": None, "org_tpm": None,
        "key_rpm": None, "key_tpm": None}
GUARD_SECONDS = 20  # a bound on events that come within a second: a test that hangs fails instead


async def database(pg_url: str, *holds: tuple[str, str]) -> asyncpg.Connection:
    """The schema, and holds (id, org) placed in this order by replica ``dead``, silent for an hour."""
    conn = await asyncpg.connect(pg_url)
    await migrate(conn)
    await conn.execute("INSERT INTO kiln_replicas (id) VALUES ('dead')")
    for generation_id, org in holds:
        batch = orjson.dumps([{**HOLD, "id": generation_id, "org": org}]).decode()
        assert (await conn.fetchrow("SELECT * FROM kiln_admit($1::jsonb, 'dead', 60)", batch))["r_verdict"] == "ok"
    await conn.execute("UPDATE kiln_replicas SET seen_at = now() - interval '1 hour' WHERE id = 'dead'")
    return conn


async def waiting_or_done(conn: asyncpg.Connection, pid: int, task: asyncio.Task) -> None:
    """Once the session ``pid`` waits for a lock, or ``task`` (its statement) has ended."""
    async with asyncio.timeout(GUARD_SECONDS):
        while not task.done() and not await conn.fetchval(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid):
            await asyncio.sleep(0.005)


async def test_a_reap_and_a_settlement_taking_the_same_holds_do_not_deadlock(pg_url):
    """A settlement deletes its holds in the order of their ids; the reap deleted a silent replica's
    holds in the order they lie in the table, waiting for each one a settlement had taken. Holds
    placed b then a: the settlement took a, the reap took b and waited for a, the settlement waited
    for b: a deadlock, one of them ended by PostgreSQL. Now the reap skips the hold being settled and
    waits for nothing; the settlement's row replaces the reap's replica_lost row as before."""
    conn = await database(pg_url, ("gen-b", "acme"), ("gen-a", "acme"))
    settlement = await asyncpg.connect(pg_url)
    reaper = await asyncpg.connect(pg_url)
    try:
        await settlement.execute("BEGIN")
        assert await settlement.execute("DELETE FROM kiln_holds WHERE id = 'gen-a'") == "DELETE 1"
        reap = asyncio.create_task(reaper.fetch("SELECT * FROM kiln_reap(60)"))
        await waiting_or_done(conn, reaper.get_server_pid(), reap)
        await asyncio.wait_for(settlement.execute("DELETE FROM kiln_holds WHERE id = 'gen-b'"), GUARD_SECONDS)
        await settlement.execute("COMMIT")
        reaped = await asyncio.wait_for(reap, GUARD_SECONDS)
        # gen-a was being settled: not reaped; gen-b was not: a replica_lost row, charged its prompt
        assert [tuple(r) for r in reaped] == [("acme", 0.25, 1)]
        assert await conn.fetchval("SELECT count(*) FROM kiln_holds") == 0
        lost = await conn.fetch("SELECT id, error_code FROM usage_events")
        assert [tuple(r) for r in lost] == [("gen-b", "replica_lost")]
    finally:
        for c in (settlement, reaper, conn):
            await c.close()


class Store:
    """What ``Heartbeat.reap`` uses of ``PostgresStore``, on one real connection."""

    STATEMENT_TIMEOUT = 3.0
    UNREACHABLE = (OSError, asyncio.TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError)

    def __init__(self, conn: asyncpg.Connection):
        self.conn = conn
        self.timeout = 60.0
        self.credits = type("Credits", (), {"spent": {}})()
        self.down = 0

    async def run(self, method: str, sql: str, *args):
        return await getattr(self.conn, method)(sql, *args)

    async def attempt(self, method: str, sql: str, *args):
        try:
            return await self.run(method, sql, *args)
        except asyncpg.PostgresError as exc:
            if not self.lost(exc):
                raise
            return None

    def lost(self, exc: BaseException) -> bool:
        self.down += down_error(exc)
        return down_error(exc)

    async def tell_reaped(self) -> None:
        pass


async def test_a_reap_ended_by_a_deadlock_is_one_line_and_done_at_the_next_beat(postgres, pg_url, caplog):
    """An operator's transaction updates the orgs' rows in the other order than the reap charges them
    (globex, then acme): PostgreSQL ends the reap for a deadlock, which the heartbeat logged as a
    traceback ("heartbeat failed"). Now: one warning line, the store not down, and the next reap
    (the operator's transaction gone) turns both holds into replica_lost rows.

    PostgreSQL looks for a deadlock once, in the session whose ``deadlock_timeout`` runs out first
    after it began to wait, and ends that session. So that the victim is the reap whatever the
    machine's load, the reap looks after 4 s (time for the operator's update to queue behind it) and
    the operator only after a minute."""
    postgres.psql(f"GRANT SET ON PARAMETER deadlock_timeout TO {postgres.USER}")
    conn = await database(pg_url, ("gen-1", "acme"), ("gen-2", "globex"))
    operator = await asyncpg.connect(pg_url)
    reaper = await asyncpg.connect(pg_url)
    await operator.execute("SET deadlock_timeout = '60s'")
    await reaper.execute("SET deadlock_timeout = '4s'")
    store = Store(reaper)
    heartbeat = Heartbeat(store)
    try:
        await conn.execute("INSERT INTO kiln_orgs (org) VALUES ('acme'), ('globex')")
        await operator.execute("BEGIN")
        await operator.execute("UPDATE kiln_orgs SET spent = spent WHERE org = 'globex'")
        caplog.set_level(logging.WARNING, logger="kilnproxy.replicas")
        reap = asyncio.create_task(heartbeat.reap())
        await waiting_or_done(conn, reaper.get_server_pid(), reap)  # it has acme's row, waits for globex's
        update = asyncio.create_task(operator.execute("UPDATE kiln_orgs SET spent = spent WHERE org = 'acme'"))
        await asyncio.wait_for(reap, GUARD_SECONDS)  # ended by the deadlock detector; raised before
        await asyncio.wait_for(update, GUARD_SECONDS)
        await operator.execute("ROLLBACK")
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "DeadlockDetectedError" in lines[0], lines
        assert not any(r.exc_info for r in caplog.records)
        assert store.down == 0 and heartbeat.reaped == 0

        await heartbeat.reap()
        assert heartbeat.reaped == 2
        assert sorted(store.credits.spent.items()) == [("acme", 0.25), ("globex", 0.25)]
        assert await conn.fetchval("SELECT count(*) FROM usage_events WHERE error_code = 'replica_lost'") == 2
        assert len(caplog.records) == 4  # the line of the deadlock, "passes again", and one per org reaped
    finally:
        for c in (operator, reaper, conn):
            await c.close()
