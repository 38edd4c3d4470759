"""Upstream slots (`max_in_flight` per upstream URL), the queue up to `queue_timeout`, 503 upstream_busy,
a client leaving while queued, SIGHUP changing `max_in_flight` while requests queue, and pooled
connections closed before the model server closes them."""

import asyncio
import signal
import time

import aiohttp
import asyncpg
import pytest
from aiohttp import web
from processes import GatewayProcess, gateway_config

from kilnproxy.config import parse_config
from kilnproxy.mock_servers.mock_upstream import LOG, STATS, create_mock_app
from kilnproxy.testing import KEY, MODEL

SMALL = "small-model"
from kilnproxy.ops.admin import HEALTH
from kilnproxy.web.server import start_app, start_mock

GEN = "X-Neocloud-Generation-Id"


def slotted(slots: int, queue_timeout: float = 0, **model):
    def configure(config):
        m = config["models"][0]
        m.update(upstreams=[{"url": m["upstreams"][0], "max_in_flight": slots}], queue_timeout=queue_timeout,
                 **model)
        for org in config["orgs"]:
            org["max_in_flight"] = 2000
    return configure


def pool(h):
    return h.gw.routes[MODEL].upstreams[0].slots


async def one_holding_one_queued(h, held, eventually) -> tuple[asyncio.Task, asyncio.Task]:
    """A request holding the only slot (``held`` has it), then one queued behind it: their tasks
    (``eventually``: the fixture)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    holder = asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(), json=body))
    await eventually(lambda: held.received == 1)
    queued = asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(), json=body))
    await eventually(lambda: pool(h).queued() == 1)
    return holder, queued



async def test_config_takes_tables_and_strings_and_refuses_two_caps_for_one_url():
    base = {"id": "a", "upstreams": [{"url": "http://gpu1:8000/v1/", "max_in_flight": 4}, "http://gpu2:8000/v1"]}
    config = parse_config({"models": [base]})
    model = config.models[0]
    assert model.upstreams == ("http://gpu1:8000/v1", "http://gpu2:8000/v1")
    assert model.upstream_max_in_flight == (4, None) and model.queue_timeout == 0
    with pytest.raises(Exception, match="max_in_flight = 2 here but 4"):
        parse_config({"models": [base, {"id": "b", "upstreams": [{"url": "http://gpu1:8000/v1", "max_in_flight": 2}]}]})
    with pytest.raises(Exception, match=r"upstreams\[0\]\.max_in_flight: must be greater than 0"):
        parse_config({"models": [{"id": "a", "upstreams": [{"url": "http://x/v1", "max_in_flight": 0}]}]})
    with pytest.raises(Exception, match="unknown key"):
        parse_config({"models": [{"id": "a", "upstreams": [{"url": "http://x/v1", "slots": 2}]}]})
    with pytest.raises(Exception, match="model 'nope' is not in"):
        parse_config({"models": [{"id": "a", "upstreams": ["http://x/v1"], "fallbacks": ["nope"]}]})


async def test_a_thousand_requests_against_two_slots_without_queue(harness):
    async with harness(configure=slotted(2)) as h:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "mock": {"delay": 0.001}}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def one():
                async with s.post(f"{h.url}/v1/completions", json=body, headers=h.headers()) as resp:
                    return resp.status, dict(resp.headers), await resp.read()
            answers = await asyncio.gather(*(one() for _ in range(1000)))
        busy = [a for a in answers if a[0] != 200]
        assert len(answers) - len(busy) >= 2
        for status, headers, raw in busy:
            assert status == 503 and headers["Retry-After"] == "1"
            assert headers["Content-Type"].startswith("application/json")
            assert b'"code":"upstream_busy"' in raw
        for status, _, raw in answers:
            if status == 200:
                assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
        assert h.mock.app[STATS]["max_active"] <= 2
        assert (pool(h).busy, pool(h).queued(), h.gw.routes[MODEL].upstreams[0].in_flight) == (0, 0, 0)
        assert h.gw.admission.count("acme") == 0
        rows = await h.rows()
        assert len(rows) == 1000
        assert sorted({(r["status"], r["error_code"]) for r in rows}) == (
            [(200, None), (503, "upstream_busy")] if busy else [(200, None)])


async def test_a_queued_request_waits_for_the_slot_and_keeps_its_org_slot(harness, eventually):
    async with harness(configure=slotted(1, queue_timeout=30)) as h:
        async with aiohttp.ClientSession() as s:
            holder = await s.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 2, "mock": {"silence": 3600}})
            waiting = asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2}))
            await eventually(lambda: pool(h).queued() == 1)
            assert h.gw.admission.count("acme") == 2  # the waiting request holds its org slot
            holder.close()  # its client leaves: the slot goes to the request waiting
            async with await waiting as second:
                assert second.status == 200
                assert (await second.json())["model"] == MODEL
        assert h.mock.app[STATS]["max_active"] == 1
        await eventually(lambda: (pool(h).busy, pool(h).queued()) == (0, 0))


async def test_the_client_leaving_while_queued(harness, eventually):
    async with harness(configure=slotted(1, queue_timeout=60)) as h:
        async with aiohttp.ClientSession() as s:
            holder = await s.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 4, "mock": {"silence": 3600}})
            queued = asyncio.create_task(s.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2}))
            await eventually(lambda: pool(h).queued() == 1)
            queued.cancel()  # the client gives up while it waits: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await queued
            await eventually(lambda: pool(h).queued() == 0 and h.gw.admission.count("acme") == 1)
            rows = await eventually(lambda: h.rows())
            assert [(r["status"], r["disconnected"], r["error_code"]) for r in rows] == [(499, 1, None)]
            holder.close()
        await eventually(lambda: pool(h).busy == 0 and h.gw.admission.count("acme") == 0)
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200  # nothing leaked: the slot is free
        assert h.mock.app[STATS]["requests"] == 2  # the request that left never reached the upstream
        assert len(await eventually(lambda: h.rows())) == 3


async def minute_tokens(h) -> int:
    """The tokens the org's per-minute window holds: this process' window, or PostgreSQL's entries."""
    url = h.gw.config.storage.url
    if not url:
        return h.gw.admission.minutes.usage("org:acme")[1]
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval("SELECT coalesce(sum(tokens), 0) FROM kiln_minute WHERE org = 'acme'")
    finally:
        await conn.close()


async def test_a_client_leaving_while_queued_pays_nothing_and_its_place_goes_to_the_next(harness, store, eventually):
    """The request never reached a model server: its row charges no token (its per-minute tokens
    settle to 0), and the request queued behind it gets the slot."""
    def configure(config):
        slotted(1, queue_timeout=60)(config)
        config["orgs"][0]["tokens_per_minute"] = 10_000_000
    async with harness(overrides=store, configure=configure) as h:
        async with aiohttp.ClientSession() as s:
            holder = await s.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 4, "mock": {"silence": 3600}})
            leaver = asyncio.create_task(s.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "a long prompt " * 200, "max_tokens": 2}))
            await eventually(lambda: pool(h).queued() == 1)
            behind = asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2}))
            await eventually(lambda: pool(h).queued() == 2)
            leaver.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaver
            await eventually(lambda: pool(h).queued() == 1 and h.gw.admission.count("acme") == 2)
            [row] = await eventually(lambda: h.rows(status=499))
            assert (row["disconnected"], row["error_code"], row["prompt_tokens"], row["completion_tokens"],
                    row["total_tokens"], row["cost"]) == (1, None, 0, 0, 0, 0)
            holder.close()
            async with await behind as resp:
                assert resp.status == 200
                await resp.read()
        await eventually(lambda: (pool(h).busy, pool(h).queued(), h.gw.admission.count("acme")) == (0, 0, 0))
        rows = await eventually(_all_rows(h, 3))
        assert h.mock.app[STATS]["requests"] == 2  # the request that left never reached the upstream
        assert await minute_tokens(h) == sum(r["total_tokens"] for r in rows)


def _all_rows(h, n):
    async def rows():
        found = await h.rows()
        return found if len(found) == n else None
    return rows


async def test_queue_timeout_then_503_upstream_busy(harness):
    async with harness(configure=slotted(1, queue_timeout=0.05)) as h:
        async with aiohttp.ClientSession() as s:
            holder = await s.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 4, "mock": {"silence": 3600}})
            async with s.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                    "model": MODEL, "prompt": "hi"}) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "upstream_busy"
                row = await h.row(resp.headers[GEN])
            assert (row["status"], row["error_code"], row["model"]) == (503, "upstream_busy", MODEL)
            holder.close()


class HeldServer:
    """A model server whose answers wait until ``answer(status)``; ``GET /probe`` answers ``probe``."""

    def __init__(self):
        self.received = 0
        self.probe = 200
        self.status: asyncio.Future[int] | None = None
        self.running = None

    async def start(self) -> "HeldServer":
        self.status = asyncio.get_running_loop().create_future()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/probe", self._probe)
        self.running = await start_app(app, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        return f"{self.running.url}/v1"

    async def _completions(self, request):
        await request.read()
        self.received += 1
        status = await asyncio.shield(self.status)
        if status == 0:  # hang up without answering
            request.transport.abort()
            raise ConnectionResetError
        return web.json_response({"error": {"message": "overloaded", "type": "server_error"}}, status=status)

    async def _probe(self, request):
        return web.Response(status=self.probe)

    def answer(self, status: int) -> None:
        """Answer every request (those to come too) with HTTP ``status``; 0: hang up instead."""
        self.status.set_result(status)


@pytest.fixture
async def held():
    server = await HeldServer().start()
    yield server
    if not server.status.done():
        server.answer(503)
    await server.running.stop()


def held_first(url: str, fallback: bool = False, **server):
    """The test model on ``url`` (one slot, a long queue), falling back (or not) to SMALL on the mock."""
    def configure(config):
        m = config["models"][0]
        config["models"].append({**m, "id": SMALL, "upstream_model": "org/Small-1B"})
        m.update(upstreams=[{"url": url, "max_in_flight": 1}], queue_timeout=3600,
                 fallbacks=[SMALL] if fallback else [])
        config["server"].update(server)
        config["health"] = {"interval": 0, "path": "/probe"}
    return configure


@pytest.mark.parametrize("fallback", [False, True])
async def test_a_request_queued_for_an_upstream_a_health_check_marks_down_stops_waiting(harness, held, eventually,
                                                                                       fallback):
    """It gets what a request arriving now gets (503 no_backend_available, or the fallback) at once, not
    503 upstream_busy once its queue_timeout has passed, nor the slot of a server marked down."""
    async with harness(configure=held_first(held.url, fallback)) as h:
        holder, queued = await one_holding_one_queued(h, held, eventually)
        held.probe = 503
        await h.app[HEALTH].check_all()
        async with asyncio.timeout(20):  # a guard only: the queue_timeout is an hour
            async with await queued as resp:
                answer = await resp.json()
                row = await h.row(resp.headers[GEN])
        if fallback:
            assert (resp.status, answer["model"]) == (200, SMALL)
            assert (row["status"], row["model"], row["requested_model"]) == (200, SMALL, MODEL)
        else:
            assert (resp.status, answer["error"]["code"]) == (503, "no_backend_available")
            assert (row["status"], row["error_code"], row["model"]) == (503, "no_backend_available", MODEL)
        assert (pool(h).busy, pool(h).queued(), len(pool(h).waiters)) == (1, 0, 0)  # the holder's slot only
        held.answer(503)
        async with await holder as resp:
            assert resp.status == (200 if fallback else 502)  # an upstream's 503 falls back too
        await eventually(lambda: (pool(h).busy, h.gw.admission.count("acme")) == (0, 0))
        assert held.received == 1


@pytest.mark.parametrize("failure", [503, 0])
async def test_a_request_queued_for_an_upstream_its_failures_mark_down_is_not_sent_there(harness, held, eventually,
                                                                                         failure):
    """The request holding the only slot fails (HTTP 503, or a reset) and so marks the upstream down: the
    slot it frees does not send the request queued behind it to a server marked down."""
    async with harness(configure=held_first(held.url, upstream_max_failures=1, upstream_down_seconds=3600)) as h:
        holder, queued = await one_holding_one_queued(h, held, eventually)
        held.answer(failure)
        async with await holder as resp:
            assert resp.status == 502
        async with await queued as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_backend_available"
        assert held.received == 1
        await eventually(lambda: (pool(h).busy, pool(h).queued(), h.gw.admission.count("acme")) == (0, 0, 0))
        rows = await eventually(_all_rows(h, 2))
        assert sorted((r["status"], r["error_code"]) for r in rows) == [
            (502, "upstream_error" if failure else "upstream_unreachable"), (503, "no_backend_available")]


async def test_a_request_answered_after_a_health_check_marked_its_upstream_down_does_not_bring_it_back(
        harness, held, eventually):
    """Marked down by a failing health check, an upstream stays down until a check succeeds (docs): the
    answer of a request sent to it before (a JSON answer comes whole, at the end) did not count as one."""
    def configure(config):
        held_first(held.url)(config)
        config["models"][0]["queue_timeout"] = 0
    async with harness(configure=configure) as h:
        before = asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(), json={
            "model": MODEL, "prompt": "hi", "max_tokens": 2}))
        await eventually(lambda: held.received == 1)
        held.probe = 503
        await h.app[HEALTH].check_all()
        held.answer(200)  # the request sent before the check is answered now
        async with await before as resp:
            assert resp.status == 200
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_backend_available"
        assert held.received == 1
        held.probe = 200
        await h.app[HEALTH].check_all()
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200
        assert held.received == 2


async def test_requests_queued_while_an_upstream_was_down_are_served_by_it_once_it_is_back(harness, eventually):
    """The model's other upstream is down; requests queue for the one left, whose only slot is taken.
    A health check finds the first back: the queued requests are sent there at once, oldest first,
    not kept waiting behind the busy one (nor overtaken by requests arriving then)."""
    probe = {"status": 503}

    async def answer_probe(request):
        return web.Response(status=probe["status"])
    app = create_mock_app()
    app.router.add_get("/probe", answer_probe)
    back = await start_app(app, "127.0.0.1", 0)

    def configure(config):
        m = config["models"][0]
        m.update(upstreams=[{"url": m["upstreams"][0], "max_in_flight": 1}, {"url": f"{back.url}/v1",
                                                                            "max_in_flight": 2}],
                 queue_timeout=3600)
        config["health"] = {"interval": 0, "path": "/probe"}
    try:
        async with harness(configure=configure) as h:
            busy, returning = (u.slots for u in h.gw.routes[MODEL].upstreams)
            await h.app[HEALTH].check_all()  # the mock answers 404 to /probe (up); `back` 503 (down)
            assert [u.is_up(time.monotonic()) for u in h.gw.routes[MODEL].upstreams] == [True, False]
            holder = await h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                      "stream": True, "mock": {"silence": 3600}}).__aenter__()
            queued = [asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": f"request {i}", "max_tokens": 2})) for i in range(3)]
            await eventually(lambda: busy.queued() == 3)
            probe["status"] = 200
            await h.app[HEALTH].check_all()
            # its two slots went to the two oldest; the third waits for a slot of either upstream
            assert (returning.busy, returning.queued(), busy.queued()) == (2, 1, 1)
            async with asyncio.timeout(20):  # a guard only: the queue_timeout is an hour
                served = [await task for task in queued]
            assert [r.status for r in served] == [200, 200, 200]
            assert [r["body"]["prompt"] for r in back.app[LOG]] == ["request 0", "request 1", "request 2"]
            assert busy.busy == 1 and holder.status == 200  # the holder kept its slot throughout
            holder.close()
            await eventually(lambda: (busy.busy, returning.busy, h.gw.admission.count("acme")) == (0, 0, 0))
    finally:
        await back.stop()


async def test_slots_are_shared_by_the_models_that_list_a_url(harness):
    def configure(config):
        slotted(1, queue_timeout=30)(config)
        m = config["models"][0]
        config["models"].append({**m, "id": "other-model", "upstreams": [m["upstreams"][0]["url"]]})
    async with harness(configure=configure) as h:
        assert pool(h) is h.gw.routes["other-model"].upstreams[0].slots
        answers = await asyncio.gather(*(h.session.post(f"{h.url}/v1/completions", headers=h.headers(), json={
            "model": model, "prompt": "hi", "max_tokens": 2, "stream": True, "mock": {"delay": 0.01}})
            for model in [MODEL, "other-model"] * 5))
        for resp in answers:
            assert resp.status == 200
            await resp.read()
            resp.release()
        assert h.mock.app[STATS]["max_active"] == 1


def _toml_slots(url: str, slots: int) -> list:
    return [{"url": url, "max_in_flight": slots}]


async def test_sighup_raising_max_in_flight_serves_the_queue(tmp_path):
    mock = await start_mock()
    url = f"{mock.url}/v1"
    config = gateway_config([url])
    config["models"][0].update(upstreams=_toml_slots(url, 1), queue_timeout=60)
    gw = await GatewayProcess(tmp_path, config).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            holder = await s.post(f"{gw.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
                "model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 4, "mock": {"silence": 3600}})
            queued = [asyncio.create_task(s.post(f"{gw.url}/v1/completions", headers={
                "Authorization": f"Bearer {KEY}"}, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}))
                for _ in range(3)]
            while b'kilnproxy_upstream_queued_requests{upstream="' + url.encode() + b'"} 3.0' not in (
                    await (await s.get(f"{gw.url}/metrics")).read()):
                await asyncio.sleep(0.01)
            config["models"][0]["upstreams"] = _toml_slots(url, 4)
            gw.write_config(config)
            gw.send(signal.SIGHUP)
            answers = await asyncio.gather(*queued)
            assert [r.status for r in answers] == [200, 200, 200]
            for r in answers:
                await r.read()
            assert mock.app[STATS]["max_active"] <= 4
            holder.close()
            async with s.get(f"{mock.url}/mock/wait", params={"hangups": 1}) as resp:
                assert (await resp.json())["hangups"] == 1
        await gw.wait_for("stderr", "config reloaded")
        deadline = asyncio.get_running_loop().time() + 20
        while len(gw.rows()) < 4:  # the left stream's row is committed just after its upstream is hung up on
            assert asyncio.get_running_loop().time() < deadline, gw.rows()
            await asyncio.sleep(0.02)
    finally:
        await gw.stop()
        await mock.stop()
    rows = gw.rows()
    assert sorted((r["status"], r["disconnected"]) for r in rows) == [(200, 0)] * 3 + [(200, 1)]


async def test_idle_upstream_connections_close_before_the_servers_do(harness, eventually):
    """The model server closes idle connections after 0.5 s, the gateway after 0.1 s: every POST
    goes out on a fresh connection, none on one the server is closing."""
    runner = web.AppRunner(create_mock_app(), keepalive_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    try:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url]),
                           overrides={"server": {"upstream_keepalive_timeout": 0.1}}) as h:
            pools = h.gw.upstream_client.pools
            for _ in range(5):
                async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
                    assert resp.status == 200
                # the gateway dropped its idle connection
                await eventually(lambda: not any(pool.open for pool in pools.values()))
            ports = [r["port"] for r in runner.app[LOG]]
            assert len(set(ports)) == 5
    finally:
        await runner.cleanup()
