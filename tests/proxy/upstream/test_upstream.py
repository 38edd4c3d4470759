"""The response rules (docs/reference.md) for non-streamed answers and upstream failures: pass-through, 502, failover, 503."""


import orjson
import pytest
from closed_ports import refused_port

from kilnproxy.mock_servers.mock_upstream import OPTIONS
from kilnproxy.testing import MODEL
from kilnproxy.web.server import start_mock

GEN = "X-Neocloud-Generation-Id"


async def test_json_answer_gets_catalog_model_and_cost(gw):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4,
                                           "mock": {"cached_tokens": 2}}) as resp:
        assert resp.status == 200
        body = await resp.json()
        gen = resp.headers[GEN]
    assert body["model"] == MODEL
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 2},
                             "cost": (1 * 0.10 + 2 * 0.05 + 4 * 0.30) / 1_000_000}
    row = await gw.row(gen)
    assert (row["status"], row["cost"], row["finish_reason"], row["stream"]) == (200, body["usage"]["cost"],
                                                                                "length", 0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("flavor", ["vllm", "llamacpp", "vllm_old"])
async def test_upstream_400_passes_through_unchanged(gw, stream, flavor):
    body = {"model": MODEL, "prompt": "word " * 5000, "max_tokens": 10, "stream": stream, "mock": {"flavor": flavor}}
    async with gw.session.post(f"{gw.mock_url}/v1/completions", json={**body, "model": "org/Test-Model-7B"}) as d:
        direct_status, direct = d.status, await d.read()
    async with gw.post("/v1/completions", body) as resp:
        assert resp.status == direct_status == 400
        assert await resp.read() == direct
        assert resp.headers["Content-Type"].startswith("application/json")
        gen = resp.headers[GEN]
    assert (await gw.row(gen))["status"] == 400


async def test_vllm_422_passes_through(gw):
    # the mock answers 400 for a bad temperature; 422 is what FastAPI gives for a schema error
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 9}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["message"].startswith("temperature must be")


@pytest.mark.parametrize("fail", ["500", "503", "401", "429", "404", "garbage"])
@pytest.mark.parametrize("stream", [False, True])
async def test_other_upstream_failures_are_502_text_plain(gw, fail, stream):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": stream,
                                           "mock": {"fail": fail}}) as resp:
        assert resp.status == 502
        assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
        text = await resp.text()
        assert text.startswith("Bad gateway")
        gen = resp.headers[GEN]
    assert (await gw.row(gen))["status"] == 502


async def test_reset_before_headers_is_502(gw):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "x", "mock": {"fail": "reset"}}) as resp:
        assert resp.status == 502
        assert resp.headers["Content-Type"].startswith("text/plain")


async def test_hanging_upstream_times_out_as_502(harness):
    async with harness(overrides={"server": {"upstream_idle_timeout": 0.3}}) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "mock": {"fail": "hang"}}) as resp:
            assert resp.status == 502
            assert "timed out" in await resp.text()


async def test_refused_connection_is_502_then_503_once_marked_down(harness):
    dead = f"http://127.0.0.1:{refused_port()}/v1"
    async with harness(configure=lambda c: c["models"][0].update(upstreams=[dead]),
                       overrides={"server": {"upstream_max_failures": 2, "upstream_down_seconds": 60}}) as h:
        statuses = []
        for _ in range(3):
            async with h.post("/v1/completions", {"model": MODEL, "prompt": "x"}) as resp:
                statuses.append(resp.status)
                if resp.status == 503:
                    error = (await resp.json())["error"]
                    assert error["code"] == "no_backend_available"
        assert statuses == [502, 502, 503]
        assert [r["status"] for r in await h.rows()] == [502, 502, 503]


async def test_failover_to_the_next_upstream_before_anything_is_sent(harness):
    dead = f"http://127.0.0.1:{refused_port()}/v1"
    def configure(c):
        c["models"][0]["upstreams"] = [dead, c["models"][0]["upstreams"][0]]
    async with harness(configure=configure) as h:
        client = h.openai()
        for _ in range(6):
            out = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert out.choices[0].text == " Paris is"
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}],
                                                      max_tokens=2, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == " Paris is"
        assert {r["status"] for r in await h.rows()} == {200}


async def test_requests_are_spread_across_upstreams(harness):
    second = await start_mock()
    try:
        def configure(c):
            c["models"][0]["upstreams"].append(f"{second.url}/v1")
        async with harness(configure=configure) as h:
            for _ in range(10):
                async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
                    assert r.status == 200
            async with h.session.get(f"{second.url}/mock/stats") as r:
                on_second = (await r.json())["requests"]
            on_first = len(await h.mock_requests())
            assert on_first + on_second == 10 and on_first >= 3 and on_second >= 3
    finally:
        await second.stop()


async def test_a_5xx_replica_is_skipped_for_a_healthy_one(harness):
    bad = await start_mock()
    try:
        def configure(c):
            c["models"][0]["upstreams"].insert(0, f"{bad.url}/v1")
        async with harness(configure=configure) as h:
            bad.app[OPTIONS]["fail"] = "503"  # every request to the first replica fails
            for _ in range(4):
                async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
                    assert r.status == 200
    finally:
        await bad.stop()


async def test_json_error_bodies_never_leak_tracebacks(gw):
    async with gw.post("/v1/completions", data=b"\xff\xfe", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        text = await r.text()
        assert "Traceback" not in text
        assert orjson.loads(text)["error"]["code"] == "invalid_request"


async def test_a_plain_500_fails_the_request_but_never_marks_the_server_down(harness):
    # llama.cpp answers 500 for failures the request itself causes: one client must not
    # take the model offline for everyone
    async with harness(overrides={"server": {"upstream_max_failures": 2}}) as h:
        for _ in range(4):
            async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "mock": {"fail": "500"}}) as r:
                assert r.status == 502
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 200
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "mock": {"fail": "503"}}) as r:
            assert r.status == 502
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "mock": {"fail": "503"}}) as r:
            assert r.status == 502
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 503  # two 503s in a row: marked down


async def test_a_cookie_an_upstream_sets_is_never_sent_back(harness):
    """The upstream session keeps no cookies: one client's answer must not shape another's request
    (by host name: aiohttp's jar ignores cookies of a bare IP address anyway)."""
    from aiohttp import web

    from kilnproxy.web.server import start_app

    seen = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        body = await request.json()
        resp = web.json_response({"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                                  "choices": [{"index": 0, "text": " x", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        resp.set_cookie("session", f"client-{len(seen)}")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    upstream = await start_app(app, "127.0.0.1", 0)
    try:
        by_name = f"http://localhost:{upstream.port}/v1"
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[by_name])) as h:
            for _ in range(3):
                async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi"}) as resp:
                    assert resp.status == 200
    finally:
        await upstream.stop()
    assert seen == [None, None, None]


@pytest.mark.parametrize("status", [429, 503])
async def test_an_upstream_asking_to_retry_after_is_skipped_or_502_never_passed_on(harness, status):
    """An upstream's 429 or 503 with Retry-After: the next upstream is tried; when it was the last, the
    client gets 502 text/plain without the upstream's Retry-After. A 503 counts toward marking it
    down, a 429 does not (the server is up, only busy)."""
    from aiohttp import web

    from kilnproxy.web.server import start_app

    async def busy(request):
        await request.read()
        return web.json_response({"error": {"message": "busy", "type": "server_error"}}, status=status,
                                 headers={"Retry-After": "7"})
    app = web.Application()
    app.router.add_post("/v1/completions", busy)
    busy_server = await start_app(app, "127.0.0.1", 0)
    url = f"{busy_server.url}/v1"
    try:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
            async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}) as resp:
                assert resp.status == 502 and "Retry-After" not in resp.headers
                assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
                assert await resp.text() == f"Bad gateway: {url} answered HTTP {status} on /completions\n"
                row = await h.row(resp.headers[GEN])
            assert (row["status"], row["error_code"]) == (502, "upstream_error")
            assert h.gw.routes[MODEL].upstreams[0].failures == (1 if status == 503 else 0)

        def two(c):
            c["models"][0]["upstreams"] = [url, c["models"][0]["upstreams"][0]]
        async with harness(configure=two) as h:
            for _ in range(4):  # whichever the balancing picks first, the answer comes from the mock
                async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}) as resp:
                    assert resp.status == 200 and (await resp.json())["model"] == MODEL
    finally:
        await busy_server.stop()
