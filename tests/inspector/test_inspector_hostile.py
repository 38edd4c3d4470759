"""The inspector when what it shows is hostile or odd: model names, prompts, streams, finish reasons, key
names and references chosen by clients and upstreams, and the numbers and NULs of its own query strings.

Each test holds one defect a bug hunt found to the fixed behaviour: API answers through a real gateway
(raw query strings, both stores), the page in Debian's chromium (as tests/inspector/test_inspector_browser.py).
"""

import base64
import json
import secrets

import orjson
import pytest
import yarl
from aiohttp import web
from browser import chromium_page
from raw_upstreams import answering, http

from kilnproxy.testing import MODEL
from kilnproxy.aiohttp_internals import site_sockets

CAPTURE = {"inspector": {"capture": True}}
XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=1</script>'


async def get(h, path, **kwargs):
    """``path`` sent exactly as written (``%00`` stays a NUL, ``%C2%B2`` a "²"): status, headers, body."""
    async with h.session.get(yarl.URL(f"{h.url}{path}", encoded=True), allow_redirects=False, **kwargs) as resp:
        return resp.status, resp.headers, await resp.read()


def error_of(body: bytes) -> tuple[str, str | None]:
    error = orjson.loads(body)["error"]
    return error["code"], error["param"]


def stream_of(*events: bytes, comments: int = 0) -> bytes:
    """A raw upstream answer: ``comments`` lines of ``:``, the events, ``[DONE]``."""
    frames = b":\n" * comments + b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return http(frames, Content_Type="text/event-stream")


def chunk(text: str = "w", finish_reason: str | None = None) -> bytes:
    return orjson.dumps({"id": "cmpl-1", "object": "text_completion", "model": "up",
                         "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]})


USAGE = orjson.dumps({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})


# -- the JSON API ------------------------------------------------------------------------------------


def cursor(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize("query, param", [
    ("limit=%C2%B2", "limit"),  # "²": str.isdigit() says yes, int() says no
    ("limit=" + "9" * 5000, "limit"),  # more digits than int() reads
    ("status=%C2%B2%C2%B2%C2%B2", "status"),
    ("before=" + cursor("2026-12-01T00:00:00.000+00:00~\u00b2"), "before"),
    ("before=" + cursor("2026-12-01T00:00:00.000+00:00~" + "1" * 5000), "before"),
])
async def test_numbers_in_digits_int_cannot_read_get_400_not_500(gw, query, param):
    status, _, body = await get(gw, f"/ui/api/requests?{query}")
    assert (status, error_of(body)) == (400, ("invalid_request", param))


async def test_a_nul_in_a_filter_an_id_or_a_change_is_answered_alike_on_both_stores(harness, store):
    """PostgreSQL's text holds no NUL and refuses a parameter with one: each of these was a 500 there."""
    async with harness(overrides=store) as h:
        assert (await get(h, "/ui/api/requests?org=acme%00"))[2] == b'{"data":[],"next":null}'
        assert (await get(h, "/ui/api/requests?model=test-model%00"))[2] == b'{"data":[],"next":null}'
        status, _, body = await get(h, "/ui/api/requests?before=" + cursor("2026\x00~1"))
        assert (status, error_of(body)) == (400, ("invalid_request", "before"))  # a cursor's time is ISO text
        status, _, body = await get(h, "/ui/api/usage?org=%00&model=%00")
        assert status == 200 and orjson.loads(body)["series"] == []
        for path, param in (("/ui/api/requests/gen-%00", None), ("/ui/api/keys?org=acme%00", "org"),
                            ("/ui/api/orgs/acme%00/grants", None)):
            status, _, body = await get(h, path)
            assert (status, error_of(body)) == (404, ("not_found", param)), path
        async with h.session.delete(yarl.URL(f"{h.url}/ui/api/keys/key_%00", encoded=True)) as resp:
            assert (resp.status, error_of(await resp.read())) == (404, ("not_found", None))
        for path, body, param in (("/ui/api/keys", {"org": "acme", "name": "ci\x00"}, "name"),
                                  ("/ui/api/keys", {"org": "acme\x00", "name": "ci"}, "org"),
                                  ("/ui/api/orgs/acme/grants", {"amount": 1, "reference": "inv\x00"}, "reference")):
            async with h.session.post(f"{h.url}{path}", json=body) as resp:
                assert (resp.status, error_of(await resp.read())) == (400, ("invalid_request", param))
        assert await h.gw.tenancy.list_keys() == [] and await h.gw.tenancy.list_grants("acme") == []


async def test_a_clients_model_and_an_upstreams_finish_reason_become_rows_both_stores_keep(
        harness, store, committed):
    """On PostgreSQL a NUL, or a model name too long for its index, failed the row's settlement (and its
    batch's) for good: spooled, retried and refused for ever, and the inspector never listed the request.
    On SQLite a 4 MB model name was kept in every row and sent in every page of the list."""
    long_model = secrets.token_hex(3000)  # 6,000 characters that do not compress
    raw = stream_of(chunk(), chunk("", "stop\x00" + "x" * 1000), USAGE)
    async with answering(raw) as url, \
            harness(overrides={**store, **CAPTURE}, configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
        ids = []
        for model, stream in (("bad\x00model", False), (long_model, False), (MODEL, True)):
            async with h.post("/v1/completions", {"model": model, "prompt": "hi", "stream": stream}) as resp:
                await resp.read()
                ids.append(resp.headers["X-Neocloud-Generation-Id"])
        await committed(h, 3)
        rows = {r["id"]: r for r in await h.rows()}
        assert rows[ids[0]]["model"] == "bad\ufffdmodel"
        assert rows[ids[1]]["model"] == long_model[:255] + "…"
        assert rows[ids[2]]["finish_reason"] == "stop\ufffd" + "x" * 250 + "…"
        status, _, body = await get(h, "/ui/api/requests")
        assert status == 200 and [r["id"] for r in orjson.loads(body)["data"]] == ids[::-1]
        assert len(body) < 4000


async def test_a_stream_of_half_a_million_events_is_listed_by_its_ends(harness):
    """A capture of tiny events (1 MiB holds half a million ``:`` lines) was a 20 MB answer, built on
    the event loop for most of a second, and a page no browser could draw."""
    raw = stream_of(chunk("first"), *[chunk("w")] * 5, chunk("last", "stop"), USAGE, comments=300_000)
    whole = {"inspector": {"capture": True, "capture_bytes": 4 << 20}}  # both streams, not truncated
    async with answering(raw) as url, \
            harness(overrides=whole, configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}) as resp:
            assert resp.status == 200
            await resp.read()
            generation = resp.headers["X-Neocloud-Generation-Id"]
        status, _, body = await get(h, f"/ui/api/requests/{generation}")
        assert status == 200 and len(body) < 500_000 and not orjson.loads(body)["capture"]["truncated"]
        events = orjson.loads(body)["capture"]["upstream_events"]
        assert len(events) == 2001
        assert [e["kind"] for e in events[999:1002]] == ["comment", "omitted", "comment"]
        assert events[1000]["count"] == 300_000 + 9 - 2000  # the comments, 8 events and [DONE], less those listed
        assert [json.loads(e["data"])["choices"][0]["text"] for e in events[-9:-3]] == ["first", *["w"] * 5]
        assert events[-1]["data"] == "[DONE]"
        timing = orjson.loads(body)["capture"]["timing"]
        assert timing["first_event_ms"] is not None and timing["last_event_ms"] >= timing["first_event_ms"]


async def test_every_inspector_answer_carries_the_headers_of_an_admin_page(harness):
    async with harness(overrides={"inspector": {"token": "s3cret"}}) as h:
        auth = {"Authorization": "Bearer s3cret"}
        answers = {path: await get(h, path, headers=auth) for path in (
            "/ui/", "/ui/static/app.js", "/ui/api/meta", "/ui/api/requests", "/ui/api/requests/gen-none",
            "/ui/api/orgs", "/ui/api/upstreams", "/ui/static/upstreams.js")}
        answers["401"] = await get(h, "/ui/api/requests")
        assert [status for status, _, _ in answers.values()] == [200, 200, 200, 200, 404, 200, 200, 200, 401]
        async with h.session.get(f"{h.url}/ui/api/events", headers=auth) as resp:
            answers["/ui/api/events"] = (resp.status, resp.headers, b"")
        for name, (_, headers, _) in answers.items():
            policy = dict(d.strip().split(" ", 1) for d in headers["Content-Security-Policy"].split(";"))
            assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'", name
            assert policy["frame-ancestors"] == "'none'" and policy["default-src"] == "'none'", name
            assert headers["X-Frame-Options"] == "DENY" and headers["X-Content-Type-Options"] == "nosniff", name
            assert headers["Referrer-Policy"] == "no-referrer", name
            expected = "no-cache" if name.startswith("/ui/static") or name == "/ui/" or "events" in name else "no-store"
            assert headers["Cache-Control"] == expected, name


def assert_admin_page_headers(headers, name):
    policy = dict(d.strip().split(" ", 1) for d in headers["Content-Security-Policy"].split(";"))
    assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'", name
    assert policy["frame-ancestors"] == "'none'" and policy["default-src"] == "'none'", name
    assert headers["X-Frame-Options"] == "DENY" and headers["X-Content-Type-Options"] == "nosniff", name
    assert headers["Referrer-Policy"] == "no-referrer", name


async def test_the_inspectors_fallback_answers_carry_the_headers_of_its_pages(harness, monkeypatch):
    """No route's own refusals: a path under /ui that no route serves (404), a method none takes (405),
    a body over the limit (413), a handler that fails (500)."""
    from kilnproxy.inspector.queries import InspectorStore

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(InspectorStore, "usage", broken)
    async with harness(overrides={"inspector": {"token": "s3cret"}, "server": {"max_request_bytes": 1000}}) as h:
        auth = {"Authorization": "Bearer s3cret"}
        answers = {}
        for method, path, body, status, code in (
                ("GET", "/ui/nothing", None, 404, "not_found"),
                ("GET", "/ui/api/nothing/%0Aat%20all", None, 404, "not_found"),
                ("GET", "/ui/static", None, 404, "not_found"),
                ("POST", "/ui/", b"{}", 405, "method_not_allowed"),
                ("PUT", "/ui", b"{}", 405, "method_not_allowed"),
                ("DELETE", "/ui/api/meta", None, 405, "method_not_allowed"),
                ("POST", "/ui/api/keys", b'{"org": "' + b"x" * 2000 + b'"}', 413, None),
                ("GET", "/ui/api/usage", None, 500, "internal_error")):
            async with h.session.request(method, yarl.URL(f"{h.url}{path}", encoded=True), data=body,
                                         headers={**auth, "Content-Type": "application/json"},
                                         allow_redirects=False) as resp:
                answers[f"{method} {path}"] = resp.status, resp.headers, await resp.read()
                assert resp.status == status, (method, path, resp.status)
                if code is not None:
                    assert error_of(await resp.read())[0] == code, (method, path)
        for name, (_, headers, _) in answers.items():
            assert_admin_page_headers(headers, name)
            assert headers["Cache-Control"] == "no-store", name
        status, headers, _ = await get(h, "/uinothing")  # not under /ui: the gateway's plain 404
        assert status == 404 and "Content-Security-Policy" not in headers
        status, headers, _ = await get(h, "/v1/nothing")
        assert status == 404 and "Content-Security-Policy" not in headers


# -- the page ------------------------------------------------------------------------------------


async def test_another_site_cannot_frame_the_page(harness):
    """Without a token the page answers loopback clients, and a browser on the gateway's machine (or an
    SSH tunnel to it) is one: a site it visits could frame "Orgs & keys" under a decoy and have the
    operator click "revoke"."""
    async with harness() as h, chromium_page() as page:
        async def decoy_page(request):
            return web.Response(text=f'<p>win a prize</p><iframe src="{h.url}/ui/#/orgs/acme" width=1200 '
                                     'height=600></iframe>', content_type="text/html")

        decoy = web.Application()
        decoy.router.add_get("/", decoy_page)
        runner = web.AppRunner(decoy)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            port = site_sockets(site)[0].getsockname()[1]
            await page.goto(f"http://localhost:{port}/")  # another origin than the gateway's
            await page.wait_for_timeout(1000)
            [frame] = [f for f in page.frames if f != page.main_frame]
            assert not frame.url.startswith(h.url)  # chromium's error page instead
            assert await frame.query_selector("#orgs-table") is None
            page.kiln_errors[:] = [e for e in page.kiln_errors if "frame-ancestors 'none'" not in e]  # the refusal
        finally:
            await runner.cleanup()


async def test_text_from_clients_and_upstreams_is_shown_as_text(harness):
    """A guard rather than a defect found: every field is set with textContent, and the Content-Security-Policy
    would refuse an inline script anyway."""
    raw = stream_of(chunk(XSS), chunk("", XSS), USAGE)
    async with answering(raw) as url, harness(overrides=CAPTURE, configure=lambda c: c["models"][0].update(
            upstreams=[url])) as h, chromium_page() as page:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": XSS, "stream": True}) as resp:
            await resp.read()
            generation = resp.headers["X-Neocloud-Generation-Id"]
        async with h.post("/v1/completions", {"model": XSS, "prompt": "hi"}) as resp:
            assert resp.status == 404
            await resp.read()
        async with h.session.post(f"{h.url}/ui/api/keys", json={"org": "acme", "name": XSS}) as resp:
            assert resp.status == 201
        async with h.session.post(f"{h.url}/ui/api/orgs/acme/grants", json={"amount": 1, "reference": XSS}) as resp:
            assert resp.status == 201
        await page.goto(f"{h.url}/ui/")
        await page.wait_for_selector("#requests tbody tr:nth-child(2)")
        assert XSS in await page.inner_text("#requests")
        await page.goto(f"{h.url}/ui/#/requests/{generation}")
        await page.wait_for_function("() => document.querySelector('#client-events').textContent.includes('[DONE]')")
        assert json.loads(await page.inner_text("#client-body"))["prompt"] == XSS
        facts = dict(zip(await page.locator("#detail-facts dt").all_inner_texts(),
                         await page.locator("#detail-facts dd").all_inner_texts()))
        assert facts["finish"] == XSS
        await page.goto(f"{h.url}/ui/#/orgs/acme")
        await page.wait_for_selector("#grants-table tbody tr")
        await page.wait_for_selector("#keys-table tbody tr")  # a read of its own: it may come after the grants
        assert XSS in await page.inner_text("#keys-table") and XSS in await page.inner_text("#grants-table")
        assert await page.evaluate("window.__xss") is None
        assert await page.locator("img, main script").count() == 0


async def test_the_list_keeps_its_newest_1000_rows_and_pages_back_to_the_rest(harness):
    """Each new row laid the whole table out again: 12 ms a row with 1,000 rows, a second with 40,000
    (an hour of a busy gateway), and the page froze."""
    async with harness() as h, chromium_page() as page:
        await page.goto(f"{h.url}/ui/")
        await page.wait_for_selector("#live.on")
        ids = []
        for _ in range(1060):
            async with h.post("/v1/completions", {"model": "missing", "prompt": "x"}) as resp:
                await resp.read()
                ids.append(resp.headers["X-Neocloud-Generation-Id"])
        await page.wait_for_selector(f'#requests tr[data-id="{ids[-1]}"]')
        listed = await page.eval_on_selector_all("#requests tbody tr", "rows => rows.map(r => r.dataset.id)")
        assert listed == ids[::-1][:1000]
        assert await page.is_visible("#more")
        while await page.is_visible("#more"):
            count = await page.locator("#requests tbody tr").count()
            await page.click("#more")
            await page.wait_for_function(f"() => document.querySelectorAll('#requests tbody tr').length > {count}"
                                         " || document.querySelector('#more').hidden")
        listed = await page.eval_on_selector_all("#requests tbody tr", "rows => rows.map(r => r.dataset.id)")
        assert listed == ids[::-1]


async def test_a_stream_of_half_a_million_events_opens_in_the_browser(harness):
    raw = stream_of(chunk("first"), chunk("last", "stop"), USAGE, comments=400_000)
    async with answering(raw) as url, harness(overrides=CAPTURE, configure=lambda c: c["models"][0].update(
            upstreams=[url])) as h, chromium_page() as page:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}) as resp:
            await resp.read()
            generation = resp.headers["X-Neocloud-Generation-Id"]
        await page.goto(f"{h.url}/ui/#/requests/{generation}")
        await page.wait_for_selector("#upstream-events li.omitted", timeout=15_000)
        assert await page.locator("#upstream-events li").count() == 2001
        assert "not listed" in await page.inner_text("#upstream-events li.omitted")


async def test_a_client_naming_a_thousand_models_leaves_the_usage_charts_readable(harness):
    """Each name a client sends is a series ("by model"): 600 of them took 25 s to draw, 3,000 over 5 minutes,
    every 3 s while requests came."""
    async with harness() as h, chromium_page() as page:
        for i in range(1000):
            async with h.post("/v1/completions", {"model": f"bogus-{i:04d}", "prompt": "x"}) as resp:
                await resp.read()
        for _ in range(3):
            async with h.post("/v1/completions", {"model": "bogus-0500", "prompt": "x"}) as resp:
                await resp.read()
        await page.goto(f"{h.url}/ui/#/usage")
        await page.wait_for_function("() => { const c = window.Chart && Chart.getChart('chart-requests');"
                                     " return c && c.data.datasets.length > 0; }", timeout=15_000)
        datasets = await page.evaluate("Chart.getChart('chart-requests').data.datasets"
                                       ".map(d => [d.label, d.data.reduce((a, b) => a + b, 0)])")
        assert datasets[0] == ["bogus-0000", 1] and ["bogus-0500", 4] in datasets
        assert len(datasets) == 10 and datasets[-1] == ["991 others", 991]


async def test_long_names_do_not_push_the_tables_off_the_page(harness):
    """A 256-character model name (what a row keeps of a client's) or a 200-character key name made the
    cell, and so the table, as wide as the text: the other columns went off screen."""
    async with harness() as h, chromium_page() as page:
        async with h.post("/v1/completions", {"model": "m" * 300, "prompt": "x"}) as resp:
            await resp.read()
        async with h.session.post(f"{h.url}/ui/api/keys", json={"org": "acme", "name": "k" * 200}) as resp:
            assert resp.status == 201
        await page.goto(f"{h.url}/ui/")
        await page.wait_for_selector("#requests tbody tr")
        width = await page.evaluate("document.documentElement.clientWidth")
        assert await page.evaluate("document.querySelector('#requests').scrollWidth") <= width
        assert await page.get_attribute("#requests td.text[title^=mmm]", "title") == "m" * 255 + "…"
        await page.goto(f"{h.url}/ui/#/orgs/acme")
        await page.wait_for_selector("#keys-table td.text[title^=kkk]")
        assert await page.evaluate("document.querySelector('#keys-table').scrollWidth") <= width
