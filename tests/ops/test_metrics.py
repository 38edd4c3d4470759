"""GET /metrics on a real gateway process, parsed with prometheus_client's own parser."""

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from odd_labels import odd_org_and_discovered_models
from processes import GatewayProcess, gateway_config
from prometheus_client.parser import text_string_to_metric_families

from kilnproxy.config import sha256_hex
from kilnproxy.errors import GatewayError
from kilnproxy.ops.admin import check_admin
from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import KEY, MODEL
from kilnproxy.web.server import start_mock
from kilnproxy.aiohttp_internals import site_sockets

AUTH = {"Authorization": f"Bearer {KEY}"}


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape: dict, name: str, **labels) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(session: aiohttp.ClientSession, url: str, **kwargs) -> dict:
    async with session.get(f"{url}/metrics", **kwargs) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return samples(await resp.text())


@pytest.fixture
async def mock():
    running = await start_mock()
    yield running
    await running.stop()


async def test_metrics_change_as_requests_flow(tmp_path, mock):
    gw = await GatewayProcess(tmp_path, gateway_config([f"{mock.url}/v1"])).start()
    try:
        async with aiohttp.ClientSession() as s:
            before = await scrape(s, gw.url)
            assert value(before, "kilnproxy_requests_total", org="acme", model=MODEL, endpoint="completions",
                         status="200") == 0
            assert value(before, "kilnproxy_upstream_up", model=MODEL, upstream=f"{mock.url}/v1") == 1
            assert value(before, "kilnproxy_in_flight_requests", org="acme") == 0

            # one stream held open: the in-flight gauges see it
            held = await s.post(f"{gw.url}/v1/completions", headers=AUTH, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "mock": {"delay": 0.3}})
            assert (await held.content.readline()).startswith(b"data: ")
            during = await scrape(s, gw.url)
            assert value(during, "kilnproxy_in_flight_requests", org="acme") == 1
            assert value(during, "kilnproxy_upstream_in_flight_requests", model=MODEL,
                         upstream=f"{mock.url}/v1") == 1
            assert (await held.read()).endswith(b"data: [DONE]\n\n")
            held.release()

            for stream in (True, False):
                async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json={
                        "model": MODEL, "prompt": "one two three", "max_tokens": 4, "stream": stream}) as r:
                    assert r.status == 200
                    await r.read()
            async with s.post(f"{gw.url}/v1/chat/completions", headers=AUTH, json={
                    "model": "nope", "messages": []}) as r:
                assert r.status == 404
            async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json={
                    "model": MODEL, "prompt": "x", "temperature": 9}) as r:
                assert r.status == 400
            async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json={
                    "model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True,
                    "mock": {"fail": "error_event", "after": 1}}) as r:
                await r.read()

            after = await scrape(s, gw.url)
        labels = dict(org="acme", model=MODEL, endpoint="completions")
        assert value(after, "kilnproxy_requests_total", status="200", **labels) == 4
        assert value(after, "kilnproxy_requests_total", status="400", **labels) == 1
        # a model not in the catalog is counted without its name (clients choose it)
        assert value(after, "kilnproxy_requests_total", org="acme", model="", endpoint="chat/completions",
                     status="404") == 1
        assert value(after, "kilnproxy_request_errors_total", code="model_not_found", org="acme", model="",
                     endpoint="chat/completions") == 1
        assert value(after, "kilnproxy_request_errors_total", code="upstream_error", **labels) == 1
        rows = gw.rows()
        ours = [r for r in rows if r["model"] == MODEL]
        assert value(after, "kilnproxy_completion_tokens_total", org="acme", model=MODEL) == sum(
            r["completion_tokens"] for r in ours)
        assert value(after, "kilnproxy_prompt_tokens_total", org="acme", model=MODEL) == sum(
            r["prompt_tokens"] for r in ours)
        assert value(after, "kilnproxy_cost_usd_total", org="acme", model=MODEL) == pytest.approx(
            sum(r["cost"] for r in ours))
        assert value(after, "kilnproxy_cost_usd_total", org="acme", model=MODEL) > 0
        hist = dict(model=MODEL, endpoint="completions")
        assert value(after, "kilnproxy_request_duration_seconds_count", **hist) == 5
        assert value(after, "kilnproxy_request_duration_seconds_bucket", le="+Inf", **hist) == 5
        # the held stream waited 0.3 s between chunks: not in the 0.25 s bucket
        assert value(after, "kilnproxy_request_duration_seconds_bucket", le="0.25", **hist) <= 4
        assert value(after, "kilnproxy_time_to_first_token_seconds_count", **hist) == 5
        assert value(after, "kilnproxy_in_flight_requests", org="acme") == 0
        assert value(after, "kilnproxy_ledger_commits_total") >= 1
        assert value(after, "kilnproxy_ledger_commit_seconds_count") == value(after, "kilnproxy_ledger_commits_total")
        assert value(after, "kilnproxy_ledger_queue_depth") == 0
        assert value(after, "kilnproxy_org_credits_remaining_usd", org="acme") == pytest.approx(
            100.0 - sum(r["cost"] for r in rows if r["org"] == "acme"))
        assert value(after, "process_resident_memory_bytes") > 0
    finally:
        await gw.stop()


async def test_openmetrics_when_the_scraper_asks_for_it(harness):
    async with harness() as h:
        async with h.session.get(f"{h.url}/metrics", headers={
                "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
            text = await r.text()
        assert text.endswith("# EOF\n") and "# TYPE kilnproxy_requests counter" in text


async def test_admin_token_guards_metrics_and_reload(tmp_path, mock):
    config = gateway_config([f"{mock.url}/v1"], admin={"token": "adm-secret", "allow_loopback": False})
    gw = await GatewayProcess(tmp_path, config).start()
    try:
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer wrong"}, AUTH):
                async with s.get(f"{gw.url}/metrics", headers=headers) as r:
                    assert r.status == 401
                    assert (await r.json())["error"]["code"] == "invalid_admin_token"
                async with s.post(f"{gw.url}/admin/reload", headers=headers) as r:
                    assert r.status == 401
            await scrape(s, gw.url, headers={"Authorization": "Bearer adm-secret"})
    finally:
        await gw.stop()


def _request(app, remote: str, headers: dict | None = None):
    class Transport:
        def get_extra_info(self, name, default=None):
            return (remote, 40000) if name == "peername" else default

        def is_closing(self):
            return False

    return make_mocked_request("GET", "/metrics", headers={"Host": "127.0.0.1:8080", **(headers or {})}, app=app,
                               transport=Transport())


async def test_loopback_only_by_default_and_token_for_others(harness):
    async with harness() as h:
        check_admin(_request(h.app, "127.0.0.1"))
        check_admin(_request(h.app, "::1"))
        with pytest.raises(GatewayError) as err:
            check_admin(_request(h.app, "10.1.2.3"))
        assert (err.value.status, err.value.code) == (403, "forbidden")
    async with harness(overrides={"admin": {"token_sha256": sha256_hex("t0k")}}) as h:
        assert h.app[GATEWAY].config.admin.allow_loopback
        check_admin(_request(h.app, "10.1.2.3", {"Authorization": "Bearer t0k"}))
        with pytest.raises(GatewayError) as err:
            check_admin(_request(h.app, "10.1.2.3", {"Authorization": "Bearer t0"}))
        assert (err.value.status, err.value.code) == (401, "invalid_admin_token")


async def test_metrics_switched_off(harness):
    async with harness(overrides={"metrics": {"enabled": False}}) as h:
        async with h.session.get(f"{h.url}/metrics") as r:
            assert r.status == 404
        async with h.post("/v1/completions", {"model": h.model, "prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200
        assert [type(o).__name__ for o in h.app[GATEWAY].row_observers] == ["AccessLog"]


async def test_each_gateway_has_its_own_registry(harness, tmp_path):
    async with harness() as a:
        async with a.post("/v1/completions", {"model": a.model, "prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200
        from kilnproxy.testing import Harness
        async with Harness(tmp_path / "b") as b:
            async with b.session.get(f"{b.url}/metrics") as r:
                other = samples(await r.text())
            async with a.session.get(f"{a.url}/metrics") as r:
                mine = samples(await r.text())
        labels = dict(org="acme", model=MODEL, endpoint="completions", status="200")
        assert value(mine, "kilnproxy_requests_total", **labels) == 1
        assert value(other, "kilnproxy_requests_total", **labels) == 0


# -- label values that come from clients, upstreams and the admin API ---------------------------------------


def series(text: str, name: str) -> list[dict]:
    """The label sets of ``name``'s samples in a scrape."""
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


async def metrics_text(h) -> str:
    async with h.session.get(f"{h.url}/metrics") as r:
        assert r.status == 200
        return await r.text()


async def test_model_and_org_label_values_are_escaped_and_read_back_whole(harness):
    """Catalog ids come from the config and from the upstreams' own lists (any character but controls), org
    ids from the config or the admin API: quotes, backslashes and other characters are escaped as the format
    says, so a scrape parses back to the very same values and no value writes a line of its own."""
    odd = ('q"uote\\back\\nslash', 'ünï/cödé}', 'evil"} 1\nkilnproxy_fake_total 1')

    async with harness(mock_options={"served_models": odd}, configure=odd_org_and_discovered_models) as h:
        for model, key in ((odd[0], None), (odd[1], "sk-odd")):
            async with h.post("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}, key=key) as r:
                assert r.status == 200
        text = await metrics_text(h)
    assert "kilnproxy_fake" not in text  # the id with a newline is not served (discovery refuses it)
    assert all(line.startswith(("#", "kilnproxy_", "process_")) for line in text.splitlines())
    requests = series(text, "kilnproxy_requests_total")
    assert sorted((s["org"], s["model"]) for s in requests) == sorted([("acme", odd[0]), ('or"g\\x', odd[1])])
    assert 'model="q\\"uote\\\\back\\\\nslash"' in text and 'org="or\\"g\\\\x"' in text
    assert {s["model"] for s in series(text, "kilnproxy_upstream_up")} == {odd[0], odd[1]}
    assert {s["org"] for s in series(text, "kilnproxy_org_credits_remaining_usd")} == {"acme", "globex", 'or"g\\x'}


async def test_models_a_client_names_outside_the_catalog_are_one_series(harness):
    async with harness() as h:
        for n in range(50):
            async with h.post("/v1/completions", {"model": f"nope-{n}\n\"", "prompt": "hi"}) as r:
                assert r.status == 404
        text = await metrics_text(h)
    assert series(text, "kilnproxy_requests_total") == [
        {"org": "acme", "model": "", "endpoint": "completions", "status": "404"}]
    assert [s for s in series(text, "kilnproxy_request_duration_seconds_count")] == [
        {"model": "", "endpoint": "completions"}]


async def echoing_upstream(request: web.Request) -> web.Response:
    """An upstream that refuses every request with an error code made of the client's prompt."""
    body = await request.json()
    return web.json_response({"error": {"message": "no", "type": "invalid_request_error",
                                        "code": body["prompt"]}}, status=400)


async def test_error_codes_an_upstream_makes_of_what_clients_send_are_bounded(harness):
    """The ``code`` label is the request's error code: the gateway's own, or the upstream's. An upstream can
    make one of the client's text: past MAX_ERROR_CODES codes, or for one that does not look like a code
    (at most 64 letters, digits and ``_.:-``), the requests are counted under ``code="other"``; the usage
    row keeps the code."""
    from kilnproxy.ops.metrics import MAX_ERROR_CODES
    app = web.Application()
    app.router.add_post("/v1/completions", echoing_upstream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site_sockets(site)[0].getsockname()[1]}/v1"
    odd = ["x" * 65, 'quo"te', "new\nline", "é"]
    try:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
            for prompt in [*odd, *(f"code-{n}" for n in range(MAX_ERROR_CODES + 20))]:
                async with h.post("/v1/completions", {"model": MODEL, "prompt": prompt}) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["code"] == prompt
            text = await metrics_text(h)
            rows = await h.rows()
    finally:
        await runner.cleanup()
    assert [r["error_code"] for r in rows] == [*odd, *(f"code-{n}" for n in range(MAX_ERROR_CODES + 20))]
    codes = {s.labels["code"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "kilnproxy_request_errors_total"}
    assert len(codes) == MAX_ERROR_CODES + 1
    assert codes["other"] == len(odd) + 20
    assert sorted(c for c in codes if c != "other") == sorted(f"code-{n}" for n in range(MAX_ERROR_CODES))
