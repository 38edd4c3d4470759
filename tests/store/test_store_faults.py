"""Several replicas (docs/reference.md) when PostgreSQL answers but misbehaves, or the spool does: what
an operator running replicas on one PostgreSQL meets ("When PostgreSQL cannot take the rows").

Real replicas (``python -m kilnproxy`` processes; an in-process gateway where a test must reach
into the store) on a real PostgreSQL server of the test's own (``PostgresServer``: the shared one
of the other tests is never disturbed), in front of the mock upstream. Faults: the database turns
read-only, refuses new sessions, or another session holds a lock the gateway's statements need;
its sessions are terminated under load; it is stopped and started under load; the spool's disk
fills up, the spool is damaged, holds rows PostgreSQL refuses, or grows through a long outage; a
replica stops while the database is away. For each: what clients get and how fast, what /healthz,
/metrics and the log say, and that every request ends in exactly one row, with no slot nor hold
left over, once the fault clears.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
from pathlib import Path

import aiohttp
import asyncpg
import pytest
from faulty_ledgers import AUTH, GEN, fill, health, metric, mounted, post
from processes import GatewayProcess
from replicas import Ledger, replica, replica_config, stop_all

from kilnproxy.testing import KEY, completion_body
from kilnproxy.testing.postgres import PostgresServer
from kilnproxy.usage import COLUMNS
from kilnproxy.aiohttp_internals import site_sockets

DOWN_LINE = "new requests get 503 store_unavailable"
UP_LINE = "PostgreSQL takes rows again"
GUARD_SECONDS = 30  # a bound on events that come within seconds: a test that hangs fails instead


@pytest.fixture
def own_postgres():
    with PostgresServer() as server:
        yield server


async def streams_begun(session: aiohttp.ClientSession, url: str, count: int,
                        max_tokens: int = 6) -> list[aiohttp.ClientResponse]:
    """``count`` slow streams (a token each 50 ms) whose first line has come."""
    slow = completion_body(stream=True, max_tokens=max_tokens, mock={"delay": 0.05})
    streams = [await session.post(f"{url}/v1/completions", json=slow, headers=AUTH) for _ in range(count)]
    for s in streams:
        await s.content.readline()
    return streams


async def one_done_and_two_under_way(session: aiohttp.ClientSession, url: str,
                                     sent: dict[str, int]) -> list[aiohttp.ClientResponse]:
    """A request answered (its status put in ``sent``), then two slow streams that have begun: returned."""
    status, gen, _ = await post(session, url, completion_body())
    assert status == 200
    sent[gen] = status
    streams = await streams_begun(session, url, 2)
    assert all(s.status == 200 for s in streams)
    return streams


def store_lines(gateway) -> list[str]:
    return [line for line in gateway.lines["stderr"] if "kilnproxy.ledger" in line or "kilnproxy.replicas" in line]


async def cancelled(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def settled_once(url: str, sent: dict[str, int], eventually) -> None:
    """Every request of ``sent`` (generation id -> status) has exactly one row with that status, no
    hold is left, and every org's spending is the sum of its rows."""
    async with Ledger(url) as db:
        async def all_there():
            return len(await db.rows()) >= len(sent) and await db.holds() == []

        await eventually(all_there)
        rows = await db.rows()
        assert sorted(r["id"] for r in rows) == sorted(sent)
        assert {r["id"]: r["status"] for r in rows} == sent
        assert await db.consistent()


async def served_again(session, gateway, sent: dict[str, int]) -> None:
    """After a fault: a new request is served, nothing is in flight, the store is up."""
    status, gen, _ = await post(session, gateway.url, completion_body())
    assert status == 200
    sent[gen] = status
    assert (await health(session, gateway.url)) == ({"status": "ok", "store": "up"}, 200)
    assert await metric(session, gateway.url, "kilnproxy_store_up") == 1
    assert await metric(session, gateway.url, "kilnproxy_store_spooled_rows") == 0
    assert await metric(session, gateway.url, 'kilnproxy_in_flight_requests{org="acme"}') == 0


@pytest.mark.parametrize("how", ["database", "server"])
async def test_a_read_only_database_is_a_store_down_that_ends_by_itself(
        tmp_path, mock_url, own_postgres, eventually, how):
    """``default_transaction_read_only`` turned on: for the database (new sessions; the gateway's are
    ended, as a fail-over to a standby would), or for the server (a reload: every session at once).
    The store was taken for up while every statement failed (each request a 503 and an error line,
    the heartbeat a traceback every second, a change of the admin API a 500), and it never came back
    when the database was writable again: its sessions kept the setting they started with. Now: down,
    said once, the admin API's changes 503; writable again, it comes back by itself with every row."""
    pg = own_postgres
    url = pg.url()
    a = await replica(tmp_path, "a", mock_url, url)
    sent: dict[str, int] = {}
    streams = []
    try:
        async with aiohttp.ClientSession() as session:
            streams = await one_done_and_two_under_way(session, a.url, sent)
            if how == "database":
                pg.psql("ALTER DATABASE kiln SET default_transaction_read_only = on;")
                assert pg.terminate_connections("kiln") >= 1
            else:
                pg.psql("ALTER SYSTEM SET default_transaction_read_only = on; SELECT pg_reload_conf();")
            for s in streams:  # admitted streams run to their end; their rows go to the spool
                raw = await asyncio.wait_for(s.read(), GUARD_SECONDS)
                assert raw.endswith(b"data: [DONE]\n\n")
                sent[s.headers[GEN]] = 200
            status, gen, raw = await asyncio.wait_for(post(session, a.url, completion_body()), GUARD_SECONDS)
            assert status == 503 and json.loads(raw)["error"]["code"] == "store_unavailable"
            sent[gen] = status
            await a.wait_for("stderr", DOWN_LINE)
            for body in (completion_body(), completion_body(stream=True)):
                status, gen, raw = await asyncio.wait_for(post(session, a.url, body), GUARD_SECONDS)
                assert status == 503 and json.loads(raw)["error"]["code"] == "store_unavailable"
                sent[gen] = status
            body, ready = await health(session, a.url)
            assert body["store"] == "down" and ready == 503
            assert await metric(session, a.url, "kilnproxy_store_up") == 0
            down = [line for line in a.lines["stderr"] if DOWN_LINE in line]
            assert "read-only" in down[0], down
            async with session.post(f"{a.url}/admin/v1/orgs", json={"id": "beta"}) as resp:  # was a 500
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "store_unavailable"

            if how == "database":
                pg.psql("ALTER DATABASE kiln SET default_transaction_read_only = off;")
            else:
                pg.psql("ALTER SYSTEM RESET default_transaction_read_only; SELECT pg_reload_conf();")
            await a.wait_for("stderr", UP_LINE)
            await eventually(lambda: metric_is(session, a.url, "kilnproxy_store_spooled_rows", 0))
            await served_again(session, a, sent)
        a.send(signal.SIGTERM)
        assert await a.wait() == 0
    finally:
        await stop_all(a)
        for s in streams:
            s.close()
    await settled_once(url, sent, eventually)
    lines = store_lines(a)
    assert len(lines) <= 4, lines  # down once, up once; not a line per request nor per heartbeat
    assert "Traceback" not in "\n".join(a.lines["stderr"])


async def metric_is(session, url: str, name: str, value: float) -> bool:
    return await metric(session, url, name) == value


async def metric_above(session, url: str, name: str, value: float) -> bool:
    return await metric(session, url, name) > value


class Locker:
    """Another session's transaction holding a lock the gateway needs, until ``release()``."""

    def __init__(self, url: str, sql: str):
        self.url, self.sql = url, sql
        self.conn: asyncpg.Connection | None = None

    async def take(self) -> None:
        self.conn = await asyncpg.connect(self.url)
        await self.conn.execute("BEGIN")
        await self.conn.execute(self.sql)

    async def release(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await conn.execute("ROLLBACK")
            await conn.close()


LOCKS = {
    "holds table": "LOCK TABLE kiln_holds IN ACCESS EXCLUSIVE MODE",  # admission and settlement wait
    # settlement waits, and so does the probe of which orgs' rows are locked (one org's row locked alone is
    # that org's matter, not the store's: test_pg_org_lock)
    "orgs table": "LOCK TABLE kiln_orgs IN EXCLUSIVE MODE",
}


@pytest.mark.parametrize("lock", list(LOCKS))
async def test_a_lock_held_by_another_session_bounds_the_wait_and_leaves_no_hold(
        tmp_path, mock_url, own_postgres, eventually, lock):
    """Another session keeps a lock for longer than a statement may wait. Requests got 503 after the
    client-side 3 s, but their statements went on waiting in PostgreSQL, the org's admission lock
    held: each later admission queued behind them and timed out too, a new session every 3 s, and
    when the lock went, the abandoned admissions committed holds no row would ever delete: slots and
    credits of requests long answered, held for as long as the replica lived. Now PostgreSQL itself
    ends a statement that waits (``lock_timeout``), the store is down until a settlement passes
    again (said once), and no hold is left."""
    pg = own_postgres
    url = pg.url()
    a = await replica(tmp_path, "a", mock_url, url)
    locker = Locker(url, LOCKS[lock])
    sent: dict[str, int] = {}
    waiting: list[asyncio.Task] = []
    try:
        async with aiohttp.ClientSession() as session:
            status, gen, _ = await post(session, a.url, completion_body())
            assert status == 200
            sent[gen] = status
            await locker.take()
            loop = asyncio.get_running_loop()
            started = loop.time()
            waiting += [asyncio.create_task(post(session, a.url, completion_body(stream=i % 2 == 1)))
                        for i in range(4)]
            for status, gen, raw in await asyncio.wait_for(asyncio.gather(*waiting), GUARD_SECONDS):
                assert status in (200, 503)
                if status == 503:
                    assert json.loads(raw)["error"]["code"] == "store_unavailable"
                sent[gen] = status
            assert loop.time() - started < 5.0  # the wait was bounded (by the lock timeout: 2 s)
            await a.wait_for("stderr", DOWN_LINE)
            assert "lock" in [line for line in a.lines["stderr"] if DOWN_LINE in line][0]
            # while the lock is held the store stays down (it flapped: up at each heartbeat, down at the next
            # statement), tried again by the heartbeat, and a new request is refused at once
            failures = await metric(session, a.url, "kilnproxy_ledger_commit_failures_total")
            await eventually(lambda: metric_above(session, a.url, "kilnproxy_ledger_commit_failures_total", failures + 1))
            status, gen, raw = await asyncio.wait_for(post(session, a.url, completion_body()), GUARD_SECONDS)
            assert status == 503
            sent[gen] = status
            assert (await health(session, a.url))[0]["store"] == "down"
            await locker.release()
            await a.wait_for("stderr", UP_LINE)
            await eventually(lambda: metric_is(session, a.url, "kilnproxy_store_spooled_rows", 0))
            await served_again(session, a, sent)
            async with Ledger(url) as db:
                await eventually(lambda: no_holds(db))
                waiting_sessions = await db.conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'kilnproxy %'"
                    " AND wait_event_type = 'Lock'")
                assert waiting_sessions == 0
        a.send(signal.SIGTERM)
        assert await a.wait() == 0
    finally:
        await locker.release()
        await cancelled(waiting)
        await stop_all(a)
    await settled_once(url, sent, eventually)
    lines = store_lines(a)
    assert len(lines) <= 4, lines
    assert "Traceback" not in "\n".join(a.lines["stderr"])


async def no_holds(db: Ledger) -> bool:
    return await db.holds() == []


@pytest.fixture
def spool_disk(tmp_path):
    """A 4 MB tmpfs for the spool, to fill up: (its folder, fill it, free it)."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: root only")
    with mounted(tmp_path / "disk", "-t", "tmpfs", "-o", "size=4m", "tmpfs") as disk:
        filler: list[Path] = []

        def free() -> None:
            while filler:
                filler.pop().unlink()

        try:
            yield disk, lambda: filler.append(fill(disk)), free
        finally:
            free()


async def test_a_spool_that_cannot_be_written_during_an_outage_refuses_at_once_and_loses_nothing(
        tmp_path, mock_url, own_postgres, spool_disk, eventually):
    """PostgreSQL stopped and the spool's disk full. The 503 of a new request waited for its row to be
    written to the spool, so clients hung for as long as the disk stayed full; the writer tried the
    spool alone again every 0.2 s, a log line each time, and never PostgreSQL, back meanwhile: the
    rows and the responses waiting for them stayed stuck while the database answered. Now a refusal
    does not wait for its row, the log says it once, and rows waiting go to PostgreSQL once it is back."""
    folder, fill_disk, free_disk = spool_disk
    pg = own_postgres
    url = pg.url()
    a = await replica(tmp_path, "a", mock_url, url, storage={"spool_path": str(folder / "spool.db")})
    sent: dict[str, int] = {}
    streams, waiting = [], []
    try:
        async with aiohttp.ClientSession() as session:
            streams = await one_done_and_two_under_way(session, a.url, sent)
            pg.stop("immediate")
            fill_disk()
            waiting = [asyncio.create_task(s.read()) for s in streams]
            await a.wait_for("stderr", "cannot write")  # the streams' rows: neither PostgreSQL nor the spool
            for body in (completion_body(), completion_body(stream=True), completion_body()):
                status, gen, raw = await asyncio.wait_for(post(session, a.url, body), GUARD_SECONDS)
                assert status == 503 and json.loads(raw)["error"]["code"] == "store_unavailable"
                sent[gen] = status
            assert not any(task.done() for task in waiting)  # served, waiting for their rows
            assert (await health(session, a.url))[0]["store"] == "down"

            pg.start()  # the disk still full: the rows waiting go to PostgreSQL
            for s, task in zip(streams, waiting):
                assert (await asyncio.wait_for(task, GUARD_SECONDS)).endswith(b"data: [DONE]\n\n")
                sent[s.headers[GEN]] = 200
            await a.wait_for("stderr", UP_LINE)
            await eventually(lambda: metric_is(session, a.url, "kilnproxy_ledger_queue_depth", 0))
            free_disk()
            await served_again(session, a, sent)
        a.send(signal.SIGTERM)
        assert await a.wait() == 0
    finally:
        await cancelled(waiting)
        await stop_all(a)
        for s in streams:
            s.close()
    await settled_once(url, sent, eventually)
    lines = store_lines(a)
    assert len(lines) <= 5, lines  # down, the spool full, up: once each, not at every retry
    assert "Traceback" not in "\n".join(a.lines["stderr"])


ROW_LINE = "kilnproxy.ledger: usage row not committed: "  # then the row as JSON


async def test_a_stop_while_neither_postgresql_nor_the_spool_takes_rows_logs_them_and_exits_2(
        tmp_path, mock_url, own_postgres, spool_disk):
    """SIGTERM with PostgreSQL stopped and the spool's disk full: the replica never exited (the writer
    tried the spool for ever). Now, as the SQLite ledger does, it tries 5 s more, then writes each
    row it could not keep to the log as JSON and exits 2 saying how many."""
    folder, fill_disk, _ = spool_disk
    pg = own_postgres
    a = await replica(tmp_path, "a", mock_url, pg.url(), storage={"spool_path": str(folder / "spool.db")},
                      server={"drain_seconds": 0, "shutdown_grace_seconds": 1})
    clients: list[asyncio.Task] = []
    try:
        async with aiohttp.ClientSession() as session:
            streams = await streams_begun(session, a.url, 2, max_tokens=6)
            pg.stop("immediate")
            fill_disk()
            clients += [asyncio.create_task(s.read()) for s in streams]
            await a.wait_for("stderr", "cannot write")
            status, refused, _ = await asyncio.wait_for(post(session, a.url, completion_body()), GUARD_SECONDS)
            assert status == 503
            a.send(signal.SIGTERM)
            assert await a.wait(timeout=60) == 2
            await asyncio.gather(*clients, return_exceptions=True)
    finally:
        await cancelled(clients)
        await stop_all(a)
    stderr = a.lines["stderr"]
    assert "Traceback" not in "\n".join(stderr)
    logged = [json.loads(line.split(ROW_LINE, 1)[1]) for line in stderr if ROW_LINE in line]
    assert sorted(r["id"] for r in logged) == sorted([*(s.headers[GEN] for s in streams), refused])
    assert {r["status"] for r in logged if r["id"] != refused} == {200}
    assert all(r["cost"] > 0 for r in logged if r["id"] != refused)
    assert stderr[-1] == (f"kilnproxy: error: stopped with usage rows not committed to the ledger: {len(logged)}; "
                          "each is in the log above, on a line 'usage row not committed: ' and the row as JSON")


async def test_a_replica_stopped_during_an_outage_keeps_the_rows_of_its_streams_for_its_next_run(
        tmp_path, mock_url, own_postgres, eventually):
    """PostgreSQL stopped (``pg_ctl stop -m fast``) with streams under way, then SIGTERM: the streams end
    within the grace period, the replica exits 0 with their rows in its spool, and its next run, once
    PostgreSQL is back, settles them, each once."""
    pg = own_postgres
    url = pg.url()
    a = await replica(tmp_path, "a", mock_url, url, server={"drain_seconds": 0, "shutdown_grace_seconds": 10})
    sent: dict[str, int] = {}
    try:
        async with aiohttp.ClientSession() as session:
            streams = await streams_begun(session, a.url, 3, max_tokens=20)
            pg.stop("fast")
            status, gen, _ = await asyncio.wait_for(post(session, a.url, completion_body()), GUARD_SECONDS)
            assert status == 503
            sent[gen] = status
            a.send(signal.SIGTERM)
            for s in streams:
                assert (await asyncio.wait_for(s.read(), GUARD_SECONDS)).endswith(b"data: [DONE]\n\n")
                sent[s.headers[GEN]] = 200
            assert await a.wait() == 0
    finally:
        await stop_all(a)
    assert "Traceback" not in "\n".join(a.lines["stderr"])
    pg.start()
    again = await replica(tmp_path, "a", mock_url, url)  # the same folder: the same spool
    try:
        await again.wait_for("stderr", "4 usage rows spooled by an earlier run")
        await settled_once(url, sent, eventually)
    finally:
        await stop_all(again)


async def test_rows_of_refusals_wait_up_to_a_bound_then_refusals_have_none(
        harness, tmp_path, own_postgres, eventually):
    """During an outage every refusal's row went to the spool, without bound: a client retrying in a
    loop through a long outage filled the spool's disk. Now, as on SQLite, past ``max_waiting_rows``
    rows waiting (in memory and in the spool) a refusal has no row and no generation id, and is
    counted; the answers never wait for their rows."""
    pg = own_postgres
    storage = {"url": pg.url(), "spool_path": str(tmp_path / "spool.db"), "replica_timeout_seconds": 2.0}
    async with harness(overrides={"storage": storage}) as h:
        ledger = h.gw.ledger
        ledger.max_waiting_rows = 4
        pg.stop("immediate")
        answers = [await asyncio.wait_for(post(h.session, h.url, completion_body(stream=i % 2 == 1)), GUARD_SECONDS)
                   for i in range(6)]
        assert [status for status, _, _ in answers] == [503] * 6
        assert {json.loads(raw)["error"]["code"] for _, _, raw in answers} == {"store_unavailable"}
        with_row = [gen for _, gen, _ in answers if gen is not None]
        assert len(with_row) == 4 and [gen for _, gen, _ in answers[4:]] == [None, None]
        assert await metric(h.session, h.url, "kilnproxy_ledger_refused_unrecorded_total") == 2
        pg.start()
        async with Ledger(pg.url()) as db:
            await eventually(lambda: ids_are(db, with_row))


async def ids_are(db: Ledger, ids: list[str]) -> bool:
    return sorted(r["id"] for r in await db.rows()) == sorted(ids)


@pytest.mark.parametrize("damage", ["not a database", "truncated", "overwritten"])
async def test_a_damaged_spool_stops_the_start_with_one_line_saying_what_to_do(
        tmp_path, mock_url, own_postgres, damage):
    """A spool file damaged while the replica was stopped (a disk error, a copy cut short): start-up
    said "check [storage] spool_path and its permissions", which is not the problem. Now the line
    says the file is damaged and what to do; the file is left as it is (its rows are not given up)."""
    pg = own_postgres
    url = pg.url()
    a = await replica(tmp_path, "a", mock_url, url)
    async with aiohttp.ClientSession() as session:
        pg.stop("immediate")
        for _ in range(300):  # enough rows for a few pages
            status, _, _ = await post(session, a.url, completion_body())
            assert status == 503
    a.send(signal.SIGTERM)
    assert await a.wait() == 0
    spool = tmp_path / "a" / "spool.db"
    data = spool.read_bytes()
    damaged = {"not a database": b"\x00garbage" * 1000, "truncated": data[:len(data) // 2 + 100],
               "overwritten": data[:4096] + b"\xff" * 4096 + data[8192:]}[damage]
    spool.write_bytes(damaged)
    pg.start()
    again = GatewayProcess(tmp_path / "a", replica_config(mock_url, url))
    await again.start_without_banner()
    assert await again.wait() == 2
    err = [line for line in again.lines["stderr"] if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"kilnproxy: error: the spool {str(spool)!r} is damaged (")
    assert "move it aside" in err[0] and "permissions" not in err[0]
    assert spool.read_bytes() == damaged


async def two_replicas_of_acme(tmp_path, mock_url: str, url: str):
    """Replicas ``a`` and ``b`` on ``url``, one org ``acme`` (100 credits, 64 in flight) with the key ``k``."""
    orgs = [{"id": "acme", "credits": 100.0, "max_in_flight": 64}]
    keys = [{"key": KEY, "org": "acme", "id": "k"}]
    return await asyncio.gather(*(replica(tmp_path, name, mock_url, url, orgs=orgs, keys=keys) for name in "ab"))


async def test_sessions_terminated_under_load_on_two_replicas_leave_exact_rows_credits_and_slots(
        tmp_path, mock_url, own_postgres, eventually):
    """``pg_terminate_backend`` of every session of two replicas, again and again while both serve
    streamed and JSON requests (admissions and settlements cut mid-statement): each request gets 200
    or 503 (never a 500), has exactly one row, no hold is left, each org's spending is the sum of
    its rows and both replicas say so in ``/v1/credits``, and neither counts a request in flight. (Each
    termination puts a replica's store down for a round trip, so the spool is written and flushed at
    once: it failed now and then, "cannot start a transaction within a transaction", ``test_spool``.)"""
    pg = own_postgres
    url = pg.url()
    a, b = await two_replicas_of_acme(tmp_path, mock_url, url)
    sent: dict[str, int] = {}
    terminated = 0

    async def client(session, gateway, n: int):
        nonlocal terminated
        for i in range(n):
            body = completion_body(stream=i % 2 == 0, max_tokens=4)
            status, gen, raw = await post(session, gateway.url, body)
            assert status in (200, 503), raw
            if status == 503:
                assert json.loads(raw)["error"]["code"] == "store_unavailable"
            sent[gen] = status
            if status == 200 and list(sent.values()).count(200) % 8 == 0:
                answered.set()

    async def killer(load: asyncio.Future):
        nonlocal terminated
        conn = await asyncpg.connect(url)  # the same role may end its own sessions
        try:
            while not load.done():  # after every 8 served, while the other clients' requests are in flight
                await asyncio.wait([asyncio.ensure_future(answered.wait()), load], return_when=asyncio.FIRST_COMPLETED)
                answered.clear()
                terminated += await conn.fetchval(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE application_name LIKE 'kilnproxy %'")
        finally:
            await conn.close()

    answered = asyncio.Event()

    try:
        async with aiohttp.ClientSession() as session:
            load = asyncio.gather(*(client(session, (a, b)[i % 2], 30) for i in range(8)))
            await asyncio.gather(load, killer(load))
            assert terminated > 0
            for gateway in (a, b):
                await eventually(lambda g=gateway: metric_is(session, g.url, "kilnproxy_store_spooled_rows", 0))
                await served_again(session, gateway, sent)
            await settled_once(url, sent, eventually)
            async with Ledger(url) as db:
                sums = await db.sums()
            for gateway in (a, b):
                async with session.get(f"{gateway.url}/v1/credits", headers=AUTH) as resp:
                    assert abs((await resp.json())["spent"] - sums["acme"]) <= 1e-9
    finally:
        await stop_all(a, b)
    for gateway in (a, b):
        assert "Traceback" not in "\n".join(gateway.lines["stderr"])
        assert not any("to the spool" in line for line in gateway.lines["stderr"])  # it never failed


@pytest.fixture
async def odd_codes_upstream():
    """An upstream whose rejection (a 400) and mid-stream error event carry an error code with a NUL
    in it: the URL of its ``/v1``."""
    from aiohttp import web

    code = "bad\x00code"

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"error": {"message": "no", "type": "invalid_request_error", "code": code}},
                                     status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
                 "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps({"error": {"message": "boom", "code": code}}).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site_sockets(site)[0].getsockname()[1]}/v1"
    await runner.cleanup()


async def test_an_upstream_error_code_holding_a_nul_is_settled_and_blocks_nothing(
        tmp_path, odd_codes_upstream, pg_url, eventually):
    """An upstream's error code went into the row as it came: with a NUL in it, PostgreSQL refused the
    whole settlement ("unsupported Unicode escape sequence"), so that row and the others of its batch
    went to the spool, and the flush tried them at every heartbeat for ever (an error line each
    time), every spooled row behind them stuck, their holds (slots, credits) kept for as long as the
    replica lived. The code is now stored as the model and finish reason are: a NUL as U+FFFD."""
    a = await replica(tmp_path, "a", odd_codes_upstream, pg_url)
    sent: dict[str, int] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for body in (completion_body(), completion_body(stream=True)):
                status, gen, raw = await post(session, a.url, body)
                sent[gen] = status
            assert sorted(sent.values()) == [200, 400]
            assert await metric(session, a.url, "kilnproxy_store_spooled_rows") == 0
        await settled_once(pg_url, sent, eventually)
        async with Ledger(pg_url) as db:
            assert {r["error_code"] for r in await db.rows()} == {"bad\ufffdcode"}
    finally:
        await stop_all(a)
    assert not [line for line in a.lines["stderr"] if "kilnproxy.ledger" in line]


async def test_the_watch_of_runtime_orgs_and_keys_says_an_outage_once_not_at_every_check(caplog):
    """While PostgreSQL was away, the watch of runtime orgs and keys logged two lines at every check
    (every 5 s, for as long as the outage lasted). Now one line for each thing that fails, and one
    when it works again."""
    import logging

    from kilnproxy.store.tenancy.watch import ChangeWatch

    checks, down, enough = [], True, asyncio.Event()
    wanted = 30

    async def on_change():
        checks.append(1)
        if len(checks) >= wanted:
            enough.set()
        if down:
            raise ConnectionRefusedError(111, "Connection refused")

    watch = ChangeWatch(on_change, "postgresql://kiln:x@127.0.0.1:1/kiln")  # nothing listens on port 1
    watch.poll = 0.01
    caplog.set_level(logging.INFO, "kilnproxy.tenancy")
    watch.start()
    try:
        await asyncio.wait_for(enough.wait(), GUARD_SECONDS)  # 30 checks while down
        down, wanted = False, len(checks) + 3
        enough.clear()
        await asyncio.wait_for(enough.wait(), GUARD_SECONDS)  # and 3 once it answers
    finally:
        await watch.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "kilnproxy.tenancy"]
    assert len(lines) == 3, lines
    assert lines[0].startswith("cannot listen for changes of orgs and keys: ")
    assert lines[1].startswith("cannot read runtime orgs and keys from the store: ")
    assert lines[2].startswith("can read runtime orgs and keys from the store again after ")


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_postgresql_stopped_and_started_under_load_ends_every_request_in_one_row(
        tmp_path, mock_url, own_postgres, eventually, mode):
    """``pg_ctl stop -m fast`` (or ``immediate``: a crash), then ``start``, while two replicas serve streamed and JSON requests
    without pause: answers are 200 or 503 ``store_unavailable`` (none hangs, never a 500), both
    replicas come back by themselves, and once the spools are flushed every request has exactly one
    row, no hold is left, spending is the sum of the rows and nothing is counted in flight."""
    pg = own_postgres
    url = pg.url()
    a, b = await two_replicas_of_acme(tmp_path, mock_url, url)
    sent: dict[str, int] = {}
    running = True
    served = asyncio.Condition()

    async def client(session, gateway, i: int):
        while running:
            body = completion_body(stream=i % 2 == 0, max_tokens=4, mock={"delay": 0.01})
            status, gen, raw = await asyncio.wait_for(post(session, gateway.url, body), GUARD_SECONDS)
            assert status in (200, 503), raw
            if status == 503:
                assert json.loads(raw)["error"]["code"] == "store_unavailable"
            sent[gen] = status
            async with served:
                served.notify_all()

    async def answers(status: int, n: int) -> None:
        """Wait until ``n`` more answers of ``status`` have come."""
        target = list(sent.values()).count(status) + n
        async with served:
            await asyncio.wait_for(served.wait_for(lambda: list(sent.values()).count(status) >= target),
                                   GUARD_SECONDS)

    try:
        async with aiohttp.ClientSession() as session:
            load = asyncio.gather(*(client(session, (a, b)[i % 2], i) for i in range(6)))
            try:
                await answers(200, 20)
                await asyncio.to_thread(pg.stop, mode)
                for gateway in (a, b):
                    await gateway.wait_for("stderr", DOWN_LINE)
                await answers(503, 1000)
                await asyncio.to_thread(pg.start)
                for gateway in (a, b):
                    await gateway.wait_for("stderr", UP_LINE)
                await answers(200, 20)
            finally:
                running = False
                await load
            for gateway in (a, b):
                await eventually(lambda g=gateway: metric_is(session, g.url, "kilnproxy_store_spooled_rows", 0))
                await served_again(session, gateway, sent)
        await settled_once(url, sent, eventually)
    finally:
        running = False
        await stop_all(a, b)
    for gateway in (a, b):
        assert "Traceback" not in "\n".join(gateway.lines["stderr"])
        assert len(store_lines(gateway)) <= 6, store_lines(gateway)


async def test_a_long_flush_of_the_spool_does_not_make_a_live_replica_look_dead(
        tmp_path, mock_url, own_postgres, eventually):
    """After an outage under traffic the spool holds thousands of refusals' rows (4,000 here, settled
    slowly by a trigger of the test's: as 20,000 or more on a loaded machine). The heartbeat flushed
    them itself, beating no more until it was done: after a flush longer than ``replica_timeout_seconds``
    the replica's next reaping (it, or another replica) took its own requests still in flight for
    those of a dead replica: ``replica_lost`` rows, their slots and holds freed while they ran. Now
    the flush runs beside the heartbeat."""
    pg = own_postgres
    url = pg.url()
    timeout = {"storage": {"replica_timeout_seconds": 1.0}}
    a, b = await asyncio.gather(replica(tmp_path, "a", mock_url, url, **timeout),
                                replica(tmp_path, "b", mock_url, url, **timeout))
    # every settlement takes 0.3 s more: the flush of 4,000 rows (8 batches) outlasts the timeout
    pg.psql("CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.3);"
            " RETURN NULL; END $$; CREATE TRIGGER slow AFTER INSERT ON usage_events"
            " FOR EACH STATEMENT EXECUTE FUNCTION slow();", database="kiln")
    try:
        async with aiohttp.ClientSession() as session:
            stream = await session.post(f"{a.url}/v1/completions", headers=AUTH,
                                        json=completion_body(stream=True, mock={"fail": "stall", "after": 1}))
            assert stream.status == 200
            await stream.content.readline()  # in flight on a, its hold in the database
            pg.stop("fast")  # (a crash may lose a hold committed in the last moments: holds are not fsynced)
            refused = 0

            async def client():
                nonlocal refused
                while refused < 4000:
                    refused += 1
                    status, _, _ = await post(session, a.url, completion_body())
                    assert status == 503

            await asyncio.gather(*(client() for _ in range(16)))
            pg.start()
            await a.wait_for("stderr", "settled every spooled usage row", timeout=GUARD_SECONDS)
            await eventually(lambda: metric_is(session, b.url, "kilnproxy_store_up", 1))
            async with Ledger(url) as db:
                assert len(await db.holds()) == 1  # the stream's, still in flight
                assert await db.rows(error_code="replica_lost") == []
            assert await metric(session, b.url, "kilnproxy_store_replica_lost_rows_total") == 0
            stream.close()
            async with Ledger(url) as db:
                await eventually(lambda: no_holds(db))
                assert await db.rows(error_code="replica_lost") == []
    finally:
        await stop_all(a, b)
    for gateway in (a, b):
        assert not [line for line in gateway.lines["stderr"] if "replica_lost" in line]


async def test_rows_postgresql_refuses_do_not_hold_up_the_spool(tmp_path, mock_url, pg_url, eventually):
    """A spool holding a row PostgreSQL refuses (a NUL in a text, as a release before this one could
    spool; a value of the wrong type) with good rows behind it: the flush failed on their batch at
    every heartbeat, a log line each time, and none of them ever settled. Now the batch is settled row
    by row: the NUL becomes U+FFFD, the row that cannot be settled stays in the spool, said once."""
    a = await replica(tmp_path, "a", mock_url, pg_url)
    await stop_all(a)
    spool = tmp_path / "a" / "spool.db"
    rows = [{**dict.fromkeys(COLUMNS), "id": f"gen-{i}", "created_at": "2026-12-01T21:00:00.000+00:00",
             "org": "acme", "key_id": "acme-key", "endpoint": "completions", "stream": 0, "status": 502,
             "prompt_tokens": 1, "completion_tokens": 0, "cached_tokens": 0, "total_tokens": 1, "cost": 0.25,
             "disconnected": 0} for i in range(5)]
    rows[1]["error_code"] = "bad\x00code"
    rows[2]["stream"] = "not a number"
    db = sqlite3.connect(spool)
    with db:
        db.executemany(f"INSERT INTO usage_events ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                       [[r[c] for c in COLUMNS] for r in rows])
    db.close()
    a = await replica(tmp_path, "a", mock_url, pg_url)
    try:
        async with Ledger(pg_url) as ledger:
            await eventually(lambda: ids_are(ledger, ["gen-0", "gen-1", "gen-3", "gen-4"]))
            assert (await ledger.rows(id="gen-1"))[0]["error_code"] == "bad\ufffdcode"
            assert (await ledger.spent())["acme"] == 1.0
            seen = await ledger.conn.fetchval("SELECT max(seen_at) FROM kiln_replicas")
            for _ in range(3):  # three heartbeats more: the row set aside is not tried again
                await eventually(lambda: beat_since(ledger, seen))
                seen = await ledger.conn.fetchval("SELECT max(seen_at) FROM kiln_replicas")
        async with aiohttp.ClientSession() as session:
            assert await metric(session, a.url, "kilnproxy_store_spooled_rows") == 1
    finally:
        await stop_all(a)
    refused = [line for line in a.lines["stderr"] if "gen-2" in line]
    assert len(refused) == 1 and "stays in the spool" in refused[0]
    assert len(store_lines(a)) <= 5, "\n".join(store_lines(a))


async def beat_since(ledger: Ledger, seen) -> bool:
    return await ledger.conn.fetchval("SELECT max(seen_at) FROM kiln_replicas") > seen


REFUSALS = {  # a fault for the gateway's sessions (all ended), and its end
    "password changed": ("ALTER ROLE kiln PASSWORD 'another';",
                         f"ALTER ROLE kiln PASSWORD '{PostgresServer.PASSWORD}';", "InvalidPasswordError"),
    "connection limit": ("ALTER DATABASE kiln CONNECTION LIMIT 0;", "ALTER DATABASE kiln CONNECTION LIMIT -1;",
                         "TooManyConnectionsError"),
}


@pytest.mark.parametrize("fault", list(REFUSALS))
async def test_a_database_refusing_new_sessions_is_a_store_down_that_ends_by_itself(
        tmp_path, mock_url, own_postgres, eventually, fault):
    """The role's password changed, or the database's connection limit reached, and the gateway's
    sessions ended: it was taken for up (each request a 503 and a line, the heartbeat a traceback a
    second). Now it is down, says why once, and is up again once the database lets it in."""
    pg = own_postgres
    url = pg.url()
    start, end, why = REFUSALS[fault]
    a = await replica(tmp_path, "a", mock_url, url)
    sent: dict[str, int] = {}
    try:
        async with aiohttp.ClientSession() as session:
            pg.psql(start)
            pg.terminate_connections("kiln")
            status, gen, _ = await asyncio.wait_for(post(session, a.url, completion_body()), GUARD_SECONDS)
            assert status == 503
            sent[gen] = status
            await a.wait_for("stderr", DOWN_LINE)
            assert why in [line for line in a.lines["stderr"] if DOWN_LINE in line][0]
            assert (await health(session, a.url))[0]["store"] == "down"
            pg.psql(end)
            await a.wait_for("stderr", UP_LINE)
            await served_again(session, a, sent)
        a.send(signal.SIGTERM)  # a clean stop: the last request's settlement may follow its response
        assert await a.wait() == 0
    finally:
        await stop_all(a)
    await settled_once(url, sent, eventually)
    assert len(store_lines(a)) <= 4, store_lines(a)
    assert "Traceback" not in "\n".join(a.lines["stderr"])


async def test_a_spool_that_cannot_be_opened_stops_the_start_with_one_line(tmp_path, mock_url, pg_url):
    """A ``spool_path`` whose folder cannot be made (a file stands where it should be): one line naming
    the file and what to check, exit status 2, no traceback."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "taken").write_text("a file, not a folder")
    gateway = GatewayProcess(tmp_path / "a", replica_config(mock_url, pg_url, storage={"spool_path": "taken/spool.db"}))
    await gateway.start_without_banner()
    assert await gateway.wait() == 2
    err = [line for line in gateway.lines["stderr"] if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"kilnproxy: error: cannot open the spool {str(tmp_path / 'a' / 'taken' / 'spool.db')!r}: ")
    assert err[0].endswith("(check [storage] spool_path and its permissions)")


async def test_a_read_that_runs_too_long_is_its_own_503_and_leaves_the_store_up(harness, tmp_path, pg_url):
    """A read of the inspector (its usage chart over a long span of a large table, say) that runs past
    the statement timeout took the whole store down: every client 503 ``store_unavailable`` until the
    next heartbeat, the log saying PostgreSQL was out of reach. Now that read alone is a 503 saying it
    took too long; the store stays up."""
    from kilnproxy.errors import GatewayError

    storage = {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}
    async with harness(overrides={"storage": storage}) as h:
        store = h.gw.ledger
        with pytest.raises(GatewayError) as refused:
            await store.fetch("SELECT pg_sleep(5)")
        assert refused.value.status == 503 and refused.value.code == "store_unavailable"
        assert "did not answer this query within" in refused.value.message
        assert store.available and not store.refuses_requests
        status, _, _ = await post(h.session, h.url, completion_body())
        assert status == 200
