"""One org's row of ``kiln_orgs`` locked by another session (an operator's open ``SELECT ... FOR UPDATE``,
a long admin transaction): only that org is affected; every other org is served and its rows settle.

A real replica (``python -m kilnproxy``) on a real PostgreSQL, a second plain connection holding the
row lock of org ``acme``; org ``globex`` sends requests all along.
"""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
import asyncpg
from replicas import Ledger, replica, stop_all

from kilnproxy.testing import KEY, OTHER_KEY, completion_body

GEN = "X-Neocloud-Generation-Id"
GUARD_SECONDS = 30  # a bound on events that come within seconds: a test that hangs fails instead
LOCKED_LINE = "usage rows of org acme cannot be settled"
FREE_LINE = "org acme's row is free again"
DOWN_LINE = "; new requests get 503 store_unavailable, rows are spooled"  # the whole store down


async def post(session: aiohttp.ClientSession, url: str, key: str, stream: bool = False):
    async with session.post(f"{url}/v1/completions", json=completion_body(stream=stream),
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, resp.headers.get(GEN), await resp.read()


async def test_a_locked_org_row_affects_that_org_alone_and_loses_none_of_its_rows(
        tmp_path, mock_url, pg_url, eventually):
    """The settlement waited for acme's row, hit the lock timeout, and the store took that for being
    down: every org's requests got 503 store_unavailable and every row was spooled while the lock
    was held. Now globex is served and its rows settle while acme's row is locked; acme's rows wait
    in the spool, its new requests get 503 saying why, and once the lock goes every row of acme is
    there exactly once and acme is served again."""
    a = await replica(tmp_path, "a", mock_url, pg_url)
    sent: dict[str, int] = {}
    locker = await asyncpg.connect(pg_url)
    try:
        async with aiohttp.ClientSession() as session, Ledger(pg_url) as db:
            for key in (KEY, OTHER_KEY):
                status, gen, _ = await post(session, a.url, key)
                assert status == 200
                sent[gen] = status
            await locker.execute("BEGIN")
            await locker.execute("SELECT * FROM kiln_orgs WHERE org = 'acme' FOR UPDATE")

            # both orgs at once: the batch holding acme's rows meets the lock; globex is never refused
            results = await asyncio.wait_for(asyncio.gather(
                *(post(session, a.url, (KEY, OTHER_KEY)[i % 2], stream=i % 4 >= 2) for i in range(8))),
                GUARD_SECONDS)
            for i, (status, gen, raw) in enumerate(results):
                if i % 2 == 1:
                    assert status == 200, raw
                else:
                    assert status in (200, 503), raw
                sent[gen] = status
            await a.wait_for("stderr", LOCKED_LINE, timeout=GUARD_SECONDS)

            # while the lock is held: globex is served and its rows are settled in PostgreSQL ...
            globex = []
            for stream in (False, True, False):
                status, gen, raw = await asyncio.wait_for(post(session, a.url, OTHER_KEY, stream), GUARD_SECONDS)
                assert status == 200, raw
                sent[gen] = status
                globex.append(gen)
            for gen in globex:  # each served alone: its row is settled just after its response (the row journal)
                await eventually(lambda gen=gen: db.rows(id=gen))
                assert len(await db.rows(id=gen)) == 1
            async with session.get(f"{a.url}/healthz") as resp:
                assert (await resp.json())["store"] == "up"
            # ... and acme's new requests are refused at once, saying why
            status, gen, raw = await asyncio.wait_for(post(session, a.url, KEY), GUARD_SECONDS)
            assert status == 503
            error = json.loads(raw)["error"]
            assert error["code"] == "store_unavailable" and "acme" in error["message"] and "lock" in error["message"]
            sent[gen] = status

            await locker.execute("ROLLBACK")
            await a.wait_for("stderr", FREE_LINE, timeout=GUARD_SECONDS)
            status, gen, raw = await asyncio.wait_for(post(session, a.url, KEY), GUARD_SECONDS)
            assert status == 200, raw
            sent[gen] = status

            async def all_there():
                return len(await db.rows()) >= len(sent) and await db.holds() == []

            await eventually(all_there)
            rows = await db.rows()
            assert sorted(r["id"] for r in rows) == sorted(sent)  # each request exactly once
            assert {r["id"]: r["status"] for r in rows} == sent
            assert await db.consistent()
            assert {r["org"] for r in rows if r["status"] == 503} <= {"acme"}
        a.send(signal.SIGTERM)
        assert await a.wait() == 0
    finally:
        await locker.close()
        await stop_all(a)
    stderr = "\n".join(a.lines["stderr"])
    assert DOWN_LINE not in stderr
    assert "Traceback" not in stderr
    assert stderr.count(LOCKED_LINE) == 1, stderr  # said once, not once per batch or retry
