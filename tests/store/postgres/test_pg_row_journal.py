"""The row journal on PostgreSQL (``kilnproxy.store.postgres.store``, ``kilnproxy.store.row_journal``): the
response of a request served alone ends once its row is appended to ``<spool_path>-rows``, and its
settlement follows. This replica's next admission waits for that settlement, so it counts the request
as settled, as before; a lookup of the row waits for it; a replica killed between the two settles the
row at its next start.

A plain asyncpg session holds ``usage_events`` in EXCLUSIVE mode (reads pass, inserts wait): the
settlement waits for it, shorter than the lock timeout, while the test looks. Tests wait for events
(``pg_stat_activity``, the gateway's state), never for time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import aiohttp
import asyncpg
import orjson
import pytest
from replicas import Ledger, replica, stalled, stop_all

from kilnproxy.testing import KEY, completion_body

GEN = "X-Neocloud-Generation-Id"
GUARD_SECONDS = 20  # a bound on events that come within a second: a test that hangs fails instead
REPLAYED = "usage rows of responses that ended before the gateway stopped were in"


async def lock_rows(pg_url: str) -> asyncpg.Connection:
    """A session holding ``usage_events`` against inserts (not reads), until ``ROLLBACK``."""
    locker = await asyncpg.connect(pg_url)
    await locker.execute("BEGIN")
    await locker.execute("LOCK TABLE usage_events IN EXCLUSIVE MODE")
    return locker


async def settlement_waits(locker: asyncpg.Connection) -> None:
    """Once a ``kiln_settle`` waits for the lock."""
    async with asyncio.timeout(GUARD_SECONDS):
        while not await locker.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%kiln_settle%'"):
            await asyncio.sleep(0.005)


def journal_ids(spool: Path) -> list[str]:
    return [orjson.loads(line)["id"] for line in Path(f"{spool}-rows").read_bytes().splitlines()]


def pg_store(tmp_path: Path, pg_url: str, **overrides):
    return {"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}, **overrides}


async def complete(h) -> str:
    async with h.post("/v1/completions", completion_body()) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers[GEN]


@contextlib.asynccontextmanager
async def settlement_held(h, pg_url: str):
    """A request served alone whose response has ended and whose settlement waits for a lock on
    ``usage_events``: yields the session holding it and the request's id; the lock goes on exit."""
    await h.row(await complete(h))  # the writer's connection is open
    locker = await lock_rows(pg_url)
    try:
        generation_id = await complete(h)
        await settlement_waits(locker)
        yield locker, generation_id
    finally:
        await locker.execute("ROLLBACK")
        await locker.close()


async def test_a_lone_response_ends_at_its_append_and_its_row_is_settled_next(tmp_path, harness, pg_url):
    async with harness(overrides=pg_store(tmp_path, pg_url)) as h:
        store = h.gw.ledger
        async with settlement_held(h, pg_url) as (locker, generation_id):
            assert generation_id in store.journaled
            assert journal_ids(tmp_path / "spool.db")[-1] == generation_id
            assert await locker.fetchval("SELECT count(*) FROM usage_events WHERE id = $1", generation_id) == 0
            assert await locker.fetchval("SELECT count(*) FROM kiln_holds WHERE id = $1", generation_id) == 1
        row = await h.row(generation_id)  # waits for the settlement
        assert row["status"] == 200 and row["cost"] > 0
        assert not store.journaled and store.journal.uncommitted == 0


async def test_the_next_admission_waits_for_the_settlement_of_a_journaled_row(tmp_path, harness, pg_url):
    """At an in-flight limit of one, a client's next request comes while the last one's settlement waits:
    admitted at once, its org's last hold would still be there and it would get 429; it waits for the
    settlement instead, and is served."""
    async with harness(overrides=pg_store(tmp_path, pg_url, limits={"max_in_flight_per_org": 1})) as h:
        store = h.gw.ledger
        async with settlement_held(h, pg_url) as (_, first):
            assert first in store.journaled
            second = asyncio.create_task(complete(h))
            async with asyncio.timeout(GUARD_SECONDS):  # at the admitter, waiting; or answered
                while not (second.done() or store.admissions.processing):
                    await asyncio.sleep(0.005)
            assert not second.done()
        generation_id = await asyncio.wait_for(second, GUARD_SECONDS)
        assert [r["status"] for r in (await h.row(first), await h.row(generation_id))] == [200, 200]


async def test_a_lookup_of_a_journaled_row_waits_for_its_settlement(tmp_path, harness, pg_url):
    """Read while the settlement waits, the row would not be there yet: the lookup waits for it."""
    async with harness(overrides=pg_store(tmp_path, pg_url)) as h:
        store = h.gw.ledger
        async with settlement_held(h, pg_url) as (_, generation_id):
            lookup = asyncio.create_task(store.get(generation_id))
            # read at once, it would be answered (no row) in a round trip, the lock being on inserts only;
            # a slow machine only makes this check weaker, never wrong
            await asyncio.wait([lookup], timeout=0.3)
            assert not lookup.done()
        assert (await asyncio.wait_for(lookup, GUARD_SECONDS))["id"] == generation_id
        async with h.session.get(f"{h.url}/v1/generations/{generation_id}", headers=h.headers()) as resp:
            assert resp.status == 200


async def test_the_admin_apis_org_counts_a_journaled_row_as_spent_not_held(tmp_path, harness, pg_url):
    """The org object read while the settlement waits would show the request's hold and not its cost:
    the replica waits for the settlement, then answers with it spent."""
    async with harness(overrides=pg_store(tmp_path, pg_url)) as h:
        async with settlement_held(h, pg_url):
            read = asyncio.create_task(h.session.get(f"{h.url}/admin/v1/orgs/acme"))
            await asyncio.wait([read], timeout=0.3)  # as the lookup's: a slow machine only weakens it
            assert not read.done()
        async with await asyncio.wait_for(read, GUARD_SECONDS) as resp:
            assert resp.status == 200
            org = await resp.json()
        spent = sum(r["cost"] for r in await h.rows(org="acme"))
        assert org["held"] == 0.0 and org["spent"] == pytest.approx(spent) and spent > 0


async def test_a_request_beside_another_in_progress_waits_for_its_settlement(tmp_path, harness, pg_url):
    """Only the row of a request served alone is journaled: beside an open stream, a request's response
    waits for its row's settlement, as every response did before the journal."""
    spool = tmp_path / "spool.db"
    async with harness(overrides=pg_store(tmp_path, pg_url)) as h:
        await h.row(await complete(h))
        async with h.post("/v1/completions", stalled()) as stream:
            assert stream.status == 200
            await stream.content.readline()  # the stream is open, upstream stalled
            beside = await complete(h)
            assert beside not in journal_ids(spool)
            assert (await h.row(beside))["status"] == 200
        alone = await complete(h)
        assert journal_ids(spool)[-1] == alone


async def test_a_replica_killed_before_a_journaled_rows_settlement_settles_it_at_its_next_start(
        tmp_path, mock_url, pg_url):
    """kill -9 while the settlement waits: the response had ended, the row is only in the journal and
    its hold in PostgreSQL. The replica started again on the same spool settles it: the row once, the
    hold gone, the org charged."""
    a = await replica(tmp_path, "a", mock_url, pg_url)
    again = None
    locker = None
    try:
        async with Ledger(pg_url) as db, aiohttp.ClientSession() as session:
            async def post() -> str:
                async with session.post(f"{a.url}/v1/completions", json=completion_body(),
                                        headers={"Authorization": f"Bearer {KEY}"}) as resp:
                    assert resp.status == 200, await resp.text()
                    return resp.headers[GEN]

            warm = await post()
            async with asyncio.timeout(GUARD_SECONDS):
                while not await db.rows(id=warm):
                    await asyncio.sleep(0.005)
            locker = await lock_rows(pg_url)
            generation_id = await post()
            await settlement_waits(locker)
            assert journal_ids(tmp_path / "a" / "spool.db")[-1] == generation_id
            a.send(signal.SIGKILL)
            await a.wait()
            # its session, waiting for the lock, would still commit once it is free: ended first
            await locker.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                 " WHERE wait_event_type = 'Lock' AND query LIKE '%kiln_settle%'")
            await locker.execute("ROLLBACK")
            assert await db.rows(id=generation_id) == []
            assert [h["id"] for h in await db.holds()] == [generation_id]

            again = await replica(tmp_path, "a", mock_url, pg_url)
            await again.wait_for("stderr", REPLAYED, timeout=GUARD_SECONDS)
            [row] = await db.rows(id=generation_id)
            assert row["status"] == 200 and row["error_code"] is None
            assert await db.holds() == [] and await db.consistent()
            assert (await db.spent())["acme"] == (await db.sums())["acme"] > 0
            assert not journal_ids(tmp_path / "a" / "spool.db")  # emptied once settled
    finally:
        if locker is not None:
            await locker.close()
        await stop_all(a, again)


async def test_a_journal_that_cannot_be_written_leaves_the_response_waiting_for_its_settlement(
        tmp_path, harness, pg_url, caplog):
    """A full disk under ``-rows`` (``/dev/full``): the row is settled before its response ends, as under
    load, and the log says so once."""
    async with harness(overrides=pg_store(tmp_path, pg_url)) as h:
        store = h.gw.ledger
        await h.row(await complete(h))
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, store.journal._fd)
        os.close(full)
        with caplog.at_level(logging.ERROR, "kilnproxy.ledger"):
            locker = await lock_rows(pg_url)
            try:
                request = asyncio.create_task(complete(h))
                await settlement_waits(locker)
                assert not request.done() and not store.journaled
            finally:
                await locker.execute("ROLLBACK")
                await locker.close()
            generation_id = await asyncio.wait_for(request, GUARD_SECONDS)
            assert (await h.row(generation_id))["status"] == 200
            await complete(h)
        assert len([r for r in caplog.records if "No space left" in r.message]) == 1
        assert not store.journal.usable
