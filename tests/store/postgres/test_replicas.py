"""Several replicas (docs/reference.md): several real replicas on one real PostgreSQL keep the contract as one gateway.

Each replica is a ``python -m kilnproxy`` process with its own folder (config,
spool); all share one mock upstream and one database (``pg_url``).
"""

import asyncio
import signal

import aiohttp
import orjson
import pytest
from replicas import Ledger, open_stream, replica, stalled, stop_all, two_replicas

from kilnproxy.store.postgres.schema import MIGRATIONS, migrate
from kilnproxy.usage import prompt_token_bound
from kilnproxy.testing import KEY, OTHER_KEY, completion_body

GEN = "X-Neocloud-Generation-Id"
ORGS = [{"id": "acme", "credits": 100.0, "max_in_flight": 8}, {"id": "globex", "credits": 100.0}]


async def test_two_replicas_started_at_once_on_an_empty_database_share_one_schema(tmp_path, mock_url, pg_url):
    a, b = await two_replicas(tmp_path, mock_url, pg_url)
    try:
        async with aiohttp.ClientSession() as session, Ledger(pg_url) as db:
            ids = []
            for r in (a, b):
                async with session.post(f"{r.url}/v1/completions", json=completion_body(),
                                        headers={"Authorization": f"Bearer {KEY}"}) as resp:
                    assert resp.status == 200
                    ids.append(resp.headers["X-Neocloud-Generation-Id"])
            versions = [r[0] for r in await db.conn.fetch("SELECT version FROM kiln_schema ORDER BY version")]
            assert versions == list(range(1, len(MIGRATIONS) + 1))  # each migration applied once
            assert len({row["replica"] for row in await db.settled(*ids)}) == 2
            assert len(await db.rows()) == 2
    finally:
        await stop_all(a, b)


async def test_the_org_limit_holds_across_replicas(tmp_path, mock_url, pg_url, eventually):
    a, b = await two_replicas(tmp_path, mock_url, pg_url, orgs=ORGS)
    try:
        async with aiohttp.ClientSession() as session, Ledger(pg_url) as db:
            resps = await asyncio.gather(*(open_stream(session, (a, b)[i % 2].url, stalled()) for i in range(12)))
            statuses = sorted(r.status for r in resps)
            assert statuses == [200] * 8 + [429] * 4
            for r in resps:
                if r.status == 429:
                    body = await r.json()
                    assert body["error"]["code"] == "rate_limit_exceeded"
                    assert "Retry-After" not in r.headers
            assert len(await db.holds()) == 8
            # the other org is not held back by acme's slots
            other = await open_stream(session, b.url, stalled(), key=OTHER_KEY)
            assert other.status == 200
            for r in (*resps, other):
                r.close()
            await eventually(lambda: rows_counted(db, 13))
            # slots and holds are gone with the rows: 8 new requests are admitted again
            assert await db.holds() == []
            again = await asyncio.gather(*(open_stream(session, (a, b)[i % 2].url, stalled()) for i in range(8)))
            assert [r.status for r in again] == [200] * 8
            for r in again:
                r.close()
    finally:
        await stop_all(a, b)


async def rows_counted(db: Ledger, n: int) -> bool:
    return await db.conn.fetchval("SELECT count(*) FROM usage_events") == n


async def test_a_killed_replicas_slots_are_freed_and_its_requests_get_one_replica_lost_row_each(
        tmp_path, mock_url, pg_url, eventually):
    a, b = await two_replicas(tmp_path, mock_url, pg_url, orgs=ORGS)
    try:
        async with aiohttp.ClientSession() as session, Ledger(pg_url) as db:
            held = [await open_stream(session, a.url, stalled()) for _ in range(3)]
            ids = {r.headers[GEN] for r in held}
            assert all(r.status == 200 for r in held)
            a.send(signal.SIGKILL)
            await a.wait()
            for r in held:
                r.close()

            async def lost_rows():
                rows = await db.rows(error_code="replica_lost")
                return rows if len(rows) == 3 else None

            rows = await eventually(lost_rows)
            assert {r["id"] for r in rows} == ids
            for row in rows:
                assert (row["status"], row["disconnected"], row["org"], row["completion_tokens"]) == (502, 1, "acme", 0)
                # the prompt part of the hold: its bound (usage.prompt_token_bound), not the chars/4 estimate (6)
                assert row["prompt_tokens"] == prompt_token_bound(stalled(), None) == 88
                assert row["cost"] == pytest.approx(88 * 0.10 / 1e6)
            await b.wait_for("stderr", "replica_lost")  # written by the survivor
            assert await db.holds() == []
            assert await db.consistent()
            # all 8 slots are free again, through the survivor
            again = await asyncio.gather(*(open_stream(session, b.url, stalled()) for _ in range(8)))
            assert [r.status for r in again] == [200] * 8
            for r in again:
                r.close()
            await eventually(lambda: rows_counted(db, 11))
    finally:
        await stop_all(a, b)


async def test_a_replica_cut_off_and_back_replaces_its_replica_lost_rows_with_its_own(
        tmp_path, mock_url, pg_url, eventually):
    a, b = await two_replicas(tmp_path, mock_url, pg_url, orgs=ORGS)
    try:
        async with aiohttp.ClientSession() as session, Ledger(pg_url) as db:
            held = [await open_stream(session, a.url, stalled()) for _ in range(2)]
            ids = {r.headers[GEN] for r in held}
            a.send(signal.SIGSTOP)  # frozen: no heartbeat, as if cut off from the database
            await eventually(lambda: rows_counted(db, 2))
            assert {r["error_code"] for r in await db.rows()} == {"replica_lost"}
            lost_cost = sum(r["cost"] for r in await db.rows())
            assert (await db.spent())["acme"] == pytest.approx(lost_cost)
            for r in held:
                r.close()  # the clients leave while the replica is frozen
            a.send(signal.SIGCONT)

            async def replaced():
                rows = await db.rows()
                return rows if len(rows) == 2 and all(r["error_code"] != "replica_lost" for r in rows) else None

            rows = await eventually(replaced)
            assert {r["id"] for r in rows} == ids
            assert all(r["disconnected"] == 1 and r["status"] == 200 for r in rows)
            assert await db.consistent()
            assert await db.holds() == []
    finally:
        await stop_all(a, b)


async def test_kill_9_of_a_replica_under_load_loses_no_row_of_an_ended_response(
        tmp_path, mock_url, pg_url, eventually):
    orgs = [{"id": "acme", "credits": 100.0, "max_in_flight": 64}, {"id": "globex", "credits": 100.0}]
    a, b = await two_replicas(tmp_path, mock_url, pg_url, orgs=orgs)
    ended: list[str] = []
    seen: dict[str, str] = {}  # generation id -> the replica's URL
    killed = asyncio.Event()

    async def client(session, target, n):
        for i in range(n):
            stream = i % 2 == 0
            body = completion_body(stream=stream, max_tokens=8, mock={"delay": 0.002})
            try:
                async with session.post(f"{target.url}/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {KEY}"}) as resp:
                    seen[resp.headers.get(GEN, "")] = target.url
                    data = await resp.read()
                    if resp.status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n")):
                        ended.append(resp.headers[GEN])
            except aiohttp.ClientError:
                if target is a:
                    return
            if len(ended) >= 150 and not killed.is_set():
                killed.set()
                a.send(signal.SIGKILL)

    try:
        async with aiohttp.ClientSession() as session, Ledger(pg_url) as db:
            await asyncio.gather(*(client(session, (a, b)[i % 2], 60) for i in range(8)))
            assert killed.is_set()
            ids = {r["id"] for r in await db.rows()}
            assert set(ended) <= ids  # every response a client saw end has its row
            assert len(ended) > 150

            async def settled():
                return await db.holds() == [] and await db.consistent()

            await eventually(settled)  # A's requests in flight at the kill became replica_lost rows
            rows = await db.rows()
            assert len(rows) == len({r["id"] for r in rows})
            # rows no client saw are the killed replica's: its replica_lost rows, or rows it committed
            # just before dying with their answers still unsent
            survivor = {r["replica"] for r in rows if seen.get(r["id"]) == b.url}
            assert len(survivor) == 1
            assert all(r["replica"] not in survivor for r in rows if r["id"] not in seen)
    finally:
        await stop_all(a, b)


async def test_a_settlement_retried_after_its_commit_charges_nothing_twice(pg_url, tmp_path, mock_url):
    a = await replica(tmp_path, "a", mock_url, pg_url)
    try:
        async with aiohttp.ClientSession() as session, Ledger(pg_url) as db:
            async with session.post(f"{a.url}/v1/completions", json=completion_body(),
                                    headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200
            await db.settled(resp.headers[GEN])  # settled just after the response ended: the retry comes after it
            rows = await db.rows()
            before = await db.spent()
            payload = [{k: v for k, v in row.items() if k not in ("rowid", "replica")} for row in rows]
            await db.conn.fetch("SELECT * FROM kiln_settle($1::jsonb, 'retry')", orjson.dumps(payload).decode())
            assert await db.spent() == before
            assert await db.rows() == rows
    finally:
        await stop_all(a)


async def test_replicas_long_silent_and_holding_nothing_are_forgotten(pg_url):
    async with Ledger(pg_url) as db:
        await migrate(db.conn)
        await db.conn.execute("INSERT INTO kiln_replicas (id, seen_at) VALUES ('gone', now() - interval '1 hour'),"
                              " ('recent', now() - interval '5 seconds'), ('live', now())")
        await db.conn.execute(
            "INSERT INTO kiln_holds (id, org, replica, amount, prompt_cost, prompt_tokens, created_at, key_id,"
            " endpoint, stream) VALUES ('gen-x', 'acme', 'gone', 0.01, 0.001, 10, 't', 'k', 'completions', 1)")
        lost = await db.conn.fetch("SELECT * FROM kiln_reap(2)")
        assert [tuple(r) for r in lost] == [("acme", 0.001, 1)]  # its hold first becomes a replica_lost row
        assert {r["id"] for r in await db.conn.fetch("SELECT id FROM kiln_replicas")} == {"gone", "recent", "live"}
        await db.conn.fetch("SELECT * FROM kiln_reap(2)")
        assert {r["id"] for r in await db.conn.fetch("SELECT id FROM kiln_replicas")} == {"recent", "live"}
        assert [r["error_code"] for r in await db.rows()] == ["replica_lost"]
