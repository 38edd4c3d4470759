"""Several replicas (docs/reference.md) when PostgreSQL is out of reach, and start-up against a wrong database.

These tests stop and start a PostgreSQL server of their own (``PostgresServer``),
so the shared one of the other tests is never disturbed.
"""

import asyncio
import signal

import aiohttp
import pytest
from processes import GatewayProcess
from replicas import Ledger, replica, replica_config, stop_all

from kilnproxy.testing import KEY, completion_body
from kilnproxy.testing.postgres import PostgresServer

GEN = "X-Neocloud-Generation-Id"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def own_postgres():
    with PostgresServer() as server:
        yield server


async def metric(session, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_database_stopped_mid_stream_then_started_nothing_lost_nothing_twice(
        tmp_path, mock_url, own_postgres, eventually):
    url = own_postgres.url()
    a = await replica(tmp_path, "a", mock_url, url)
    try:
        async with aiohttp.ClientSession() as session:
            slow = completion_body(stream=True, max_tokens=30, mock={"delay": 0.1})
            streams = [await session.post(f"{a.url}/v1/completions", json=slow, headers=AUTH) for _ in range(3)]
            for s in streams:
                assert s.status == 200
                await s.content.readline()
            own_postgres.stop("immediate")

            async with session.post(f"{a.url}/v1/completions", json=completion_body(), headers=AUTH) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "store_unavailable"
                refused = resp.headers[GEN]
            async with session.get(f"{a.url}/healthz") as resp:
                assert resp.status == 200 and (await resp.json())["store"] == "down"
            async with session.get(f"{a.url}/healthz?ready") as resp:
                assert resp.status == 503
            assert await metric(session, a.url, "kilnproxy_store_up") == 0

            ended = []
            for s in streams:  # admitted streams run to their end
                body = await s.read()
                assert body.endswith(b"data: [DONE]\n\n")
                ended.append(s.headers[GEN])
            assert await metric(session, a.url, "kilnproxy_store_spooled_rows") == 4

            own_postgres.start()
            async with Ledger(url) as db:
                async def all_there():
                    return {r["id"] for r in await db.rows()} == {*ended, refused}

                await eventually(all_there)
                rows = await db.rows()
                assert len(rows) == 4
                assert {r["status"] for r in rows if r["id"] in ended} == {200}
                assert await db.consistent() and await db.holds() == []
            await eventually(lambda: metric_is(session, a.url, "kilnproxy_store_up", 1))
            async with session.post(f"{a.url}/v1/completions", json=completion_body(), headers=AUTH) as resp:
                assert resp.status == 200
    finally:
        await stop_all(a)


async def metric_is(session, url, name, value) -> bool:
    return await metric(session, url, name) == value


async def test_rows_spooled_before_a_restart_are_written_by_the_next_run(tmp_path, mock_url, own_postgres, eventually):
    url = own_postgres.url()
    a = await replica(tmp_path, "a", mock_url, url)
    async with aiohttp.ClientSession() as session:
        own_postgres.stop("immediate")
        ids = []
        for _ in range(3):
            async with session.post(f"{a.url}/v1/completions", json=completion_body(), headers=AUTH) as resp:
                assert resp.status == 503
                ids.append(resp.headers[GEN])
    a.send(signal.SIGTERM)
    assert await a.wait() == 0
    own_postgres.start()
    again = await GatewayProcess(a.tmp_path, replica_config(mock_url, url)).start()  # same folder, same spool
    try:
        async with Ledger(url) as db:
            async def flushed():
                return sorted(r["id"] for r in await db.rows()) == sorted(ids)

            await eventually(flushed)
            assert {r["error_code"] for r in await db.rows()} == {"store_unavailable"}
    finally:
        await stop_all(again)


@pytest.mark.parametrize("problem", ["password", "port", "database"])
async def test_a_wrong_database_url_is_one_line_and_exit_2_without_the_password(
        tmp_path, mock_url, postgres, problem):
    url = {"password": postgres.url(password="not-the-password"),
           "port": postgres.url().replace(f":{postgres.port}/", ":1/"),
           "database": postgres.url(database="no_such_db")}[problem]
    gateway = GatewayProcess(tmp_path, replica_config(mock_url, url))
    await gateway.start_without_banner()
    assert await gateway.wait() == 2
    err = [line for line in gateway.lines["stderr"] if line.strip()]
    assert len(err) == 1, err
    assert "cannot connect to PostgreSQL" in err[0]
    assert "not-the-password" not in err[0] and PostgresServer.PASSWORD not in err[0]
    assert "Traceback" not in "\n".join(gateway.lines["stderr"] + gateway.lines["stdout"])


async def test_a_database_of_a_newer_schema_is_refused_at_start_up(tmp_path, mock_url, pg_url):
    a = await replica(tmp_path, "a", mock_url, pg_url)
    await stop_all(a)
    async with Ledger(pg_url) as db:
        await db.conn.execute("INSERT INTO kiln_schema (version) VALUES (99)")
    gateway = GatewayProcess(tmp_path / "a", replica_config(mock_url, pg_url))
    await gateway.start_without_banner()
    assert await gateway.wait() == 2
    assert "newer than this kilnproxy knows" in "\n".join(gateway.lines["stderr"])


async def test_connections_dropped_under_load_lose_no_row_and_charge_none_twice(
        tmp_path, mock_url, postgres, pg_url, eventually):
    orgs = [{"id": "acme", "credits": 100.0, "max_in_flight": 64}]
    a = await replica(tmp_path, "a", mock_url, pg_url, orgs=orgs, keys=[{"key": KEY, "org": "acme", "id": "k"}])
    database = pg_url.rsplit("/", 1)[1]
    sent = []

    async def client(session):
        for i in range(40):
            body = completion_body(stream=i % 2 == 0, max_tokens=4)
            async with session.post(f"{a.url}/v1/completions", json=body, headers=AUTH) as resp:
                await resp.read()
                sent.append((resp.headers[GEN], resp.status))
            if len(sent) % 40 == 0:  # every 40 responses, while the others are in flight
                postgres.psql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                              f" WHERE datname = '{database}' AND application_name LIKE 'kilnproxy %';")

    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(client(session) for _ in range(8)))
        assert {status for _, status in sent} <= {200, 503}
        async with Ledger(pg_url) as db:
            async def all_there():
                return len(await db.rows()) == len(sent) and await db.holds() == []

            await eventually(all_there)
            assert {r["id"] for r in await db.rows()} == {gen for gen, _ in sent}
            assert await db.consistent()
    finally:
        await stop_all(a)


def test_asyncpgs_reconnect_warnings_are_one_line(caplog):
    """While PostgreSQL is away asyncpg's pool retries and logs each failure with a traceback; the
    gateway keeps those to one line each (its own line says what happens to requests)."""
    import logging

    import kilnproxy.store.postgres.store  # noqa: F401  (puts the filter on asyncpg's logger)
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except ConnectionRefusedError:
        logging.getLogger("asyncpg.pool").warning("Failed to restore the pool connection floor; retrying",
                                                  exc_info=True)
    [record] = [r for r in caplog.records if r.name == "asyncpg.pool"]
    assert caplog.text.count("\n") == 1 and "Traceback" not in caplog.text
    assert record.getMessage() == ("Failed to restore the pool connection floor; retrying: "
                                   "ConnectionRefusedError: [Errno 111] Connection refused")
