"""The inspector's live feed across replicas on one PostgreSQL database: a subscriber of
replica A's ``/ui/api/events`` sees the rows replica B commits, as they are committed
(``NOTIFY kiln_rows`` in B's settlement, ``LISTEN`` on A: kilnproxy.inspector.replica_feed)."""

import asyncio
import contextlib
import json

import aiohttp
import asyncpg
import pytest
from processes import GatewayProcess, gateway_config

from kilnproxy.store.postgres.settlement import NOTICE_BYTES, row_notices
from kilnproxy.testing import KEY, completion_body
from kilnproxy.web.server import start_mock

GEN = "X-Neocloud-Generation-Id"
DEADLINE = 10.0  # seconds: a guard against hanging, never a wait


@pytest.fixture
async def pair(harness, pg_url, tmp_path):
    """Gateways A and B, each with its own mock upstream, on one database."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(harness(overrides={
            "storage": {"url": pg_url, "spool_path": str(tmp_path / f"spool-{name}.db")}})) for name in "ab"]


class Feed:
    """An open ``/ui/api/events`` stream: its events, read as they come."""

    def __init__(self, resp: aiohttp.ClientResponse):
        self.resp = resp
        self.buffer = b""

    async def next(self) -> dict:
        async with asyncio.timeout(DEADLINE):
            while b"\n\n" not in self.buffer:
                chunk = await self.resp.content.readany()
                assert chunk, "the live feed ended"
                self.buffer += chunk
        frame, self.buffer = self.buffer.split(b"\n\n", 1)
        if frame.startswith(b":"):  # a keep-alive comment
            return await self.next()
        assert frame.startswith(b"data: "), frame
        return json.loads(frame[6:])

    async def rows(self, count: int) -> list[dict]:
        """The next ``count`` rows (``request`` events), in order."""
        rows = []
        while len(rows) < count:
            event = await self.next()
            assert event["type"] == "request", event
            rows.append(event["row"])
        return rows


@contextlib.asynccontextmanager
async def feed_of(session: aiohttp.ClientSession, url: str):
    async with session.get(f"{url}/ui/api/events") as resp:
        feed = Feed(resp)
        assert (await feed.next())["type"] == "hello"
        yield feed


async def complete(h, **extra) -> str:
    async with h.post("/v1/completions", completion_body(**extra)) as resp:
        await resp.read()
        return resp.headers[GEN]


async def test_each_replica_feed_shows_the_others_rows_once_as_committed(pair):
    a, b = pair
    async with feed_of(a.session, a.url) as on_a, feed_of(b.session, b.url) as on_b:
        gen_b = await complete(b, stream=True)
        [row] = await on_a.rows(1)
        assert row == {**await b.row(gen_b), "captured": False}  # the committed row, as the list shows it
        assert (await on_b.rows(1))[0]["id"] == gen_b
        gen_a = await complete(a, model="no-such-model")
        gen_b2 = await complete(b)
        # A sees its own row once (from its writer, not also from its own NOTIFY), then B's next one
        assert [r["id"] for r in await on_a.rows(2)] == [gen_a, gen_b2]
        # B's own row may overtake A's, which B reads once told of it
        assert sorted(r["id"] for r in await on_b.rows(2)) == sorted([gen_a, gen_b2])


async def test_a_settlement_too_big_for_one_notice_reaches_the_other_feed_whole(pair):
    a, b = pair
    template = await b.row(await complete(b))
    ids = [f"gen-feed{i:020d}" for i in range(700)]  # ~20 kB of ids: three notices at least
    async with feed_of(a.session, a.url) as on_a:
        await asyncio.gather(*(b.gw.ledger.submit({**template, "id": i}, None) for i in ids))
        seen = [r["id"] for r in await on_a.rows(len(ids))]
    assert sorted(seen) == ids
    assert len(await a.rows()) == 701


def test_notices_stay_under_the_payload_limit_and_carry_every_id():
    ids = [f"gen-{i:024x}" for i in range(1000)]
    notices = row_notices("host-1-abcd", ids)
    assert len(notices) == 4 and all(len(n.encode()) <= NOTICE_BYTES < 8000 for n in notices)
    assert all(n.split()[0] == "host-1-abcd" for n in notices)
    assert [i for n in notices for i in n.split()[1:]] == ids
    assert row_notices("r", []) == ["r"]


async def test_a_lost_listener_reconnects_and_tells_pages_to_reload(pair, pg_url):
    """Notifications sent while A's listening connection is down are lost: when it comes back,
    A's subscribers get ``reset`` (the page reloads its list), then rows flow again."""
    a, b = pair
    async with feed_of(a.session, a.url) as on_a:
        conn = await asyncpg.connect(pg_url)
        try:
            killed = await conn.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
                f"kilnproxy inspector {a.gw.ledger.replica}")
        finally:
            await conn.close()
        assert killed == 1
        assert await on_a.next() == {"type": "reset"}
        gen = await complete(b)
        assert [r["id"] for r in await on_a.rows(1)] == [gen]


async def test_two_gateway_processes_see_each_others_rows_live(pg_url, tmp_path):
    """``python -m kilnproxy`` twice on one database: A's live feed shows what B commits."""
    mock = await start_mock()
    replicas = []
    try:
        for name in "ab":
            (tmp_path / name).mkdir()
            config = gateway_config([f"{mock.url}/v1"], storage={"url": pg_url, "spool_path": "spool.db"})
            replicas.append(await GatewayProcess(tmp_path / name, config).start())
        a, b = replicas
        async with aiohttp.ClientSession() as http, feed_of(http, a.url) as on_a:
            async with http.post(f"{b.url}/v1/completions", json=completion_body(stream=True),
                                 headers={"Authorization": f"Bearer {KEY}"}) as resp:
                await resp.read()
                gen = resp.headers[GEN]
            [row] = await on_a.rows(1)
            assert (row["id"], row["status"], row["org"]) == (gen, 200, "acme")
    finally:
        for replica in replicas:
            await replica.stop()
        await mock.stop()
