"""Upstream health: active checks with the passive marking-down, and balancing by fewest in flight."""

import aiohttp
import pytest
from processes import GatewayProcess, MockProcess, gateway_config
from prometheus_client.parser import text_string_to_metric_families

from kilnproxy.config import parse_config
from kilnproxy.mock_servers.mock_upstream import STATS
from kilnproxy.ops.admin import HEALTH
from kilnproxy.ops.health import check_url
from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import KEY, MODEL, base_config
from kilnproxy.web.server import start_gateway, start_mock

AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def test_check_url_is_taken_from_the_server_root():
    assert check_url("http://10.0.0.7:8000/v1", "/health") == "http://10.0.0.7:8000/health"
    assert check_url("https://gpu.example/api/v1", "/v1/models") == "https://gpu.example/v1/models"


async def test_any_answer_below_500_is_up_and_no_answer_is_down(harness):
    async with harness(overrides={"health": {"interval": 0, "path": "/no/such/path"}}) as h:
        gw, checker = h.app[GATEWAY], h.app[HEALTH]
        upstream = gw.routes[MODEL].upstreams[0]
        upstream.failed()
        await checker.check_all()  # the mock answers 404: it is serving
        assert upstream.is_up(0) and upstream.failures == 0 and checker.failures == {}
        await h.mock.stop()
        await checker.check_all()
        assert not upstream.is_up(__import__("time").monotonic()) and checker.failures == {upstream.base_url: 1}
        async with h.post("/v1/completions", BODY) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "no_backend_available"
        h.mock = await start_mock(port=int(h.mock_url.rsplit(":", 1)[1]))
        await checker.check_all()
        async with h.post("/v1/completions", BODY) as r:
            assert r.status == 200


async def mock_requests(session: aiohttp.ClientSession, mock: MockProcess) -> int:
    async with session.get(f"http://127.0.0.1:{mock.port}/mock/stats") as r:
        return (await r.json())["requests"]


async def upstream_gauges(session: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, float]]:
    """upstream URL -> (up, failures_total)."""
    async with session.get(f"{url}/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    up = {s.labels["upstream"]: s.value for s in families["kilnproxy_upstream_up"].samples}
    failures = {s.labels["upstream"]: s.value for s in families["kilnproxy_upstream_failures"].samples}
    return {u: (up[u], failures[u]) for u in up}


async def test_a_replica_killed_and_restarted_is_marked_down_and_back_up(tmp_path, eventually):
    a = await MockProcess(tmp_path).start()
    b = await MockProcess(tmp_path).start()
    config = gateway_config([a.url, b.url], health={"interval": 0.2, "timeout": 2, "path": "/health"},
                            server={"upstream_down_seconds": 60})
    gw = await GatewayProcess(tmp_path, config).start()
    restarted = None
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json=BODY) as r:
                    assert r.status == 200
            assert await mock_requests(s, a) == 2 and await mock_requests(s, b) == 2

            a.kill()
            await a.wait()
            await gw.wait_for("stderr", f"upstream {a.url} is down")
            assert await upstream_gauges(s, gw.url) == {a.url: (0, 0), b.url: (1, 0)}
            for _ in range(6):  # every request goes to the live replica; the dead one is not even tried
                async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json=BODY) as r:
                    assert r.status == 200
            assert await mock_requests(s, b) == 8
            assert await upstream_gauges(s, gw.url) == {a.url: (0, 0), b.url: (1, 0)}

            b.kill()
            await b.wait()
            await gw.wait_for("stderr", f"upstream {b.url} is down")
            async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json=BODY) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "no_backend_available"

            restarted = await MockProcess(tmp_path, port=a.port).start()
            await gw.wait_for("stderr", f"upstream {a.url} is up again")
            async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json=BODY) as r:
                assert r.status == 200
            assert await mock_requests(s, restarted) == 1
            assert (await upstream_gauges(s, gw.url))[a.url] == (1, 0)
        # the last row reaches the table a moment after its response (a lone row: the row journal)
        await eventually(lambda: [row["status"] for row in gw.rows()] == [200] * 10 + [503, 200])
    finally:
        for p in (gw, a, b, restarted):
            if p is not None:
                await p.stop()


async def test_passive_marking_down_without_active_checks(harness):
    """An upstream that keeps failing is marked down: then 503 at once, not another try."""
    overrides = {"server": {"upstream_max_failures": 2, "upstream_down_seconds": 60}, "health": {"interval": 0}}
    async with harness(overrides=overrides) as h:
        for _ in range(2):
            async with h.post("/v1/completions", {**BODY, "mock": {"fail": "503"}}) as r:
                assert r.status == 502
        async with h.post("/v1/completions", BODY) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "no_backend_available"
        async with h.session.get(f"{h.mock_url}/mock/stats") as r:
            assert (await r.json())["requests"] == 2
        assert await upstream_gauges(h.session, h.url) == {f"{h.mock_url}/v1": (0, 2)}


@pytest.fixture
async def two_mocks():
    mocks = [await start_mock(), await start_mock()]
    yield mocks
    for m in mocks:
        await m.stop()


async def test_balancing_by_fewest_in_flight(tmp_path, two_mocks):
    """Long streams alternate with short requests: each long one goes to the least busy replica,
    where taking turns would pile them all on one."""
    config = base_config(f"{two_mocks[0].url}/v1", tmp_path / "usage.db")
    config["models"][0]["upstreams"] = [f"{m.url}/v1" for m in two_mocks]
    config["health"] = {"interval": 0}
    gw = await start_gateway(parse_config(config, source="<test>"))
    held = []
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                resp = await s.post(f"{gw.url}/v1/completions", headers=AUTH, json={
                    **BODY, "max_tokens": 20, "stream": True, "mock": {"delay": 0.5}})
                held.append(resp)
                assert (await resp.content.readline()).startswith(b"data: ")
                async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json=BODY) as r:
                    assert r.status == 200
            assert [m.app[STATS]["open"] for m in two_mocks] == [2, 2]
            assert sum(m.app[STATS]["requests"] for m in two_mocks) == 8
            for resp in held:
                resp.close()
    finally:
        await gw.stop()
