"""Two gateways on one PostgreSQL database read the same ledger (several replicas (docs/reference.md)): each one's inspector,
``/v1/generations/{id}``, ``/v1/credits`` and ``python -m kilnproxy usage`` see the rows the
other wrote. In-process gateways (``Harness``) for the details, real processes for the whole."""

import asyncio
import contextlib
import json
import sys

import aiohttp
import orjson
import pytest
from processes import GatewayProcess, gateway_config

from kilnproxy.testing import KEY, OTHER_KEY, completion_body, pg_usage_rows
from kilnproxy.web.server import start_mock

GEN = "X-Neocloud-Generation-Id"


@pytest.fixture
async def pair(harness, pg_url, tmp_path):
    """Gateways A and B, each with its own mock upstream, on one database."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(harness(overrides={
            "storage": {"url": pg_url, "spool_path": str(tmp_path / f"spool-{name}.db")}})) for name in "ab"]


async def complete(h, key=None, **extra) -> str:
    async with h.post("/v1/completions", completion_body(**extra), key=key) as resp:
        await resp.read()
        return resp.headers[GEN]


async def get_json(h, path, key=None):
    headers = h.headers(key) if path.startswith("/v1/") else {}
    async with h.session.get(f"{h.url}{path}", headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_each_inspector_lists_the_other_ones_rows(pair):
    a, b = pair
    ids = [await complete(a), await complete(b, stream=True), await complete(a, key=OTHER_KEY),
           await complete(b, model="no-such-model")]
    for h in pair:
        status, page = await get_json(h, "/ui/api/requests")
        assert status == 200 and [r["id"] for r in page["data"]] == ids[::-1]
        status, page = await get_json(h, "/ui/api/requests?status=error")
        assert [r["id"] for r in page["data"]] == [ids[3]]
        for gen in ids:
            status, detail = await get_json(h, f"/ui/api/requests/{gen}")
            assert (status, detail["row"]["id"], detail["in_flight"]) == (200, gen, False)
        status, usage = await get_json(h, "/ui/api/usage?bucket=day")
        assert sum(s["requests"] for s in usage["series"]) == 4


async def test_a_generation_written_by_one_is_served_by_the_other(pair):
    a, b = pair
    gen = await complete(a)
    [row] = await a.rows(id=gen)
    assert await get_json(b, f"/v1/generations/{gen}") == (200, row)
    status, answer = await get_json(b, f"/v1/generations/{gen}", key=OTHER_KEY)
    assert (status, answer["error"]["code"]) == (404, "generation_not_found")  # another org's row stays hidden


async def test_credits_are_the_same_on_both_and_the_sum_of_the_rows(pair):
    a, b = pair
    for h, key, n in ((a, None, 3), (b, None, 2), (b, OTHER_KEY, 1)):
        for i in range(n):
            await complete(h, key=key, stream=bool(i % 2))
    rows = await a.rows()
    assert len(rows) == 6
    for key, org in ((None, "acme"), (OTHER_KEY, "globex")):
        (_, on_a), (_, on_b) = await get_json(a, "/v1/credits", key), await get_json(b, "/v1/credits", key)
        assert on_a == on_b
        assert on_a["spent"] == pytest.approx(sum(r["cost"] for r in rows if r["org"] == org), rel=1e-12)
        assert on_a["spent"] > 0 and on_a["remaining"] == on_a["granted"] - on_a["spent"]


async def test_reads_answer_503_while_the_database_is_out_of_reach(harness, postgres, pg_url, tmp_path, eventually):
    """A JSON 503 ``store_unavailable`` at once, never a 500 or a hang, from the first read after
    the server went away (on a pooled connection it ended); served again once it is back."""
    async with harness(overrides={"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}}) as h:
        gen = await complete(h)
        postgres.stop()
        try:
            for path, key in (("/ui/api/requests", None), (f"/ui/api/requests/{gen}", None),
                              ("/ui/api/usage", None), (f"/v1/generations/{gen}", h.key), ("/v1/credits", h.key)):
                status, answer = await get_json(h, path, key)
                assert (status, answer["error"]["code"]) == (503, "store_unavailable"), path
        finally:
            postgres.start()
        await eventually(lambda: h.gw.ledger.available)  # the heartbeat reaches it again
        status, page = await get_json(h, "/ui/api/requests")
        assert (status, [r["id"] for r in page["data"]]) == (200, [gen])


async def test_two_gateway_processes_read_each_others_rows(pg_url, tmp_path):
    """``python -m kilnproxy`` twice on one database, as replicas run: a row written by A is
    served by B (generation, inspector), credits agree, and ``usage`` sees both replicas' rows."""
    mock = await start_mock()
    replicas = []
    try:
        for name in "ab":
            (tmp_path / name).mkdir()
            config = gateway_config([f"{mock.url}/v1"], storage={"url": pg_url, "spool_path": "spool.db"})
            replicas.append(await GatewayProcess(tmp_path / name, config).start())
        a, b = replicas
        async with aiohttp.ClientSession() as http:
            async def call(method, base, path, key=KEY, **kwargs):
                async with http.request(method, f"{base}{path}", headers={"Authorization": f"Bearer {key}"},
                                        **kwargs) as resp:
                    return resp.status, await resp.json(), resp.headers

            ids = []
            for base, key in ((a.url, KEY), (b.url, KEY), (b.url, OTHER_KEY)):
                status, _, headers = await call("POST", base, "/v1/completions", key, json=completion_body())
                assert status == 200
                ids.append(headers[GEN])
            rows = await pg_usage_rows(pg_url)
            assert sorted(r["id"] for r in rows) == sorted(ids)
            for base in (a.url, b.url):
                assert (await call("GET", base, f"/v1/generations/{ids[0]}"))[:2] == (200, rows[0])
                _, page, _ = await call("GET", base, "/ui/api/requests")
                assert [r["id"] for r in page["data"]] == ids[::-1]
            (_, on_a, _), (_, on_b, _) = [await call("GET", base, "/v1/credits") for base in (a.url, b.url)]
            assert on_a == on_b and on_a["spent"] == pytest.approx(rows[0]["cost"] + rows[1]["cost"], rel=1e-12)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kilnproxy", "usage", "--json",
                                                    "--config", str(a.config_path), stdout=asyncio.subprocess.PIPE)
        totals = json.loads((await proc.communicate())[0])
        assert [(t["org"], t["requests"]) for t in totals] == [("acme", 2), ("globex", 1)]
    finally:
        for replica in replicas:
            await replica.stop()
        await mock.stop()
