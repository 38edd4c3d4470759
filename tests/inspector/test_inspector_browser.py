"""The inspector page in a real headless browser: Debian's chromium (``make browser``), driven by Playwright.

Playwright is pointed at /usr/bin/chromium; it never downloads a browser of its own.
The detail view's screenshot is saved to tests/artifacts/ (or $KILNPROXY_ARTIFACTS).
"""

import json


from browser import ARTIFACTS, chromium_page, stream_through
from otlp_receiver import Receiver

from kilnproxy.testing import UPSTREAM_MODEL


PLUGIN = '''
from kilnproxy import hookimpl

@hookimpl
def transform_event(event):
    for choice in event.get("choices") or []:
        choice["text"] = choice["text"].upper()
'''


async def test_a_streamed_request_appears_live_and_opens_on_both_streams(harness, tmp_path):
    plugin = tmp_path / "shout.py"
    plugin.write_text(PLUGIN)
    async with harness(overrides={"inspector": {"capture": True}}, plugins=[str(plugin)]) as h, \
            chromium_page() as page:
        await page.goto(f"{h.url}/ui/")
        await page.wait_for_selector("#live.on")  # the live feed is connected
        assert await page.is_visible("#empty")
        await page.evaluate("window.loadedOnce = true")

        gen = await stream_through(h, "The capital of France is")
        row = page.locator(f'#requests tr[data-id="{gen}"]')
        await row.wait_for()
        assert await page.evaluate("window.loadedOnce") is True  # it came over the live feed, no reload
        cells = await row.locator("td").all_inner_texts()
        assert cells[1:5] == ["acme", "test-model", "completions (stream)", "200"]
        assert cells[5] == "5 / 6" and cells[9] == "●"

        await row.click()
        await page.wait_for_function("() => document.querySelector('#client-events').textContent.includes('[DONE]')")
        assert page.url.endswith(f"/ui/#/requests/{gen}")
        upstream = await page.locator("#upstream-events .d").all_inner_texts()
        client = await page.locator("#client-events .d").all_inner_texts()
        assert [json.loads(d)["choices"][0]["text"] for d in upstream[:6]] == [
            " Paris", " is", " the", " capital", " of", " France"]
        assert [json.loads(d)["choices"][0]["text"] for d in client[:6]] == [
            " PARIS", " IS", " THE", " CAPITAL", " OF", " FRANCE"]
        assert all(json.loads(d)["model"] == UPSTREAM_MODEL for d in upstream[:6])
        assert all(json.loads(d)["model"] == "test-model" for d in client[:6])
        assert upstream[-1] == client[-1] == "[DONE]"
        assert json.loads(client[-2])["usage"]["cost"] > 0
        assert json.loads(await page.inner_text("#upstream-body"))["model"] == UPSTREAM_MODEL
        assert json.loads(await page.inner_text("#client-body"))["model"] == "test-model"
        facts = dict(zip(await page.locator("#detail-facts dt").all_inner_texts(),
                         await page.locator("#detail-facts dd").all_inner_texts()))
        assert facts["status"] == "200" and facts["tokens in / out"] == "5 / 6"
        assert facts["upstream"] == f"{h.mock_url}/v1"
        assert float(facts["tokens / s"]) > 0

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "inspector-detail.png"
        await page.screenshot(path=str(shot), full_page=True)
        print(f"\ninspector detail screenshot: {shot}")

        await page.click("#tab-usage")
        await page.wait_for_function(
            "() => { const c = window.Chart && Chart.getChart('chart-requests');"
            " return c && c.data.datasets.length > 0; }")
        total = await page.evaluate(
            "Chart.getChart('chart-requests').data.datasets.flatMap(d => d.data).reduce((a, b) => a + b, 0)")
        assert total == 1
        await page.screenshot(path=str(ARTIFACTS / "inspector-usage.png"), full_page=True)


async def test_filters_reload_the_list_from_the_api(harness):
    async with harness() as h, chromium_page() as page:
        first = await stream_through(h, "one")
        async with h.post("/v1/completions", {"model": "missing", "prompt": "x"}) as resp:
            assert resp.status == 404
            missing = resp.headers["X-Neocloud-Generation-Id"]
        await page.goto(f"{h.url}/ui/")
        await page.wait_for_selector(f'tr[data-id="{missing}"]')
        assert await page.locator("#requests tbody tr").count() == 2
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "inspector-list.png"))
        await page.select_option("select[name=status]", "error")
        await page.wait_for_selector(f'tr[data-id="{first}"]', state="detached")
        assert await page.locator("#requests tbody tr").get_attribute("data-id") == missing
        assert "capture off" in await page.inner_text("#capture-state")
        await page.locator(f'tr[data-id="{missing}"]').click()
        await page.wait_for_function(
            "() => document.querySelector('#detail-note').textContent.includes('capture = true')")
        assert await page.is_hidden("#detail-streams")
        assert await page.is_hidden("#trace-link")  # no [tracing] trace_url


async def test_the_detail_links_to_the_requests_trace(harness):
    receiver = await Receiver().start()
    tracing = {"enabled": True, "endpoint": receiver.url, "trace_url": "https://traces.example/trace/{trace_id}"}
    try:
        async with harness(overrides={"tracing": tracing}) as h, chromium_page() as page:
            generation = await stream_through(h, "traced")
            trace_id = h.gw.tracer.link(generation)["trace_id"]
            await page.goto(f"{h.url}/ui/#/requests/{generation}")
            await page.wait_for_selector("#trace-link", state="visible")
            assert await page.get_attribute("#trace-link", "href") == f"https://traces.example/trace/{trace_id}"
            facts = dict(zip(await page.locator("#detail-facts dt").all_inner_texts(),
                             await page.locator("#detail-facts dd").all_inner_texts()))
            assert facts["trace"] == trace_id
    finally:
        await receiver.stop()


async def test_a_request_in_flight_shows_its_streams_as_they_come(harness):
    async with harness(overrides={"inspector": {"capture": True}}) as h, chromium_page() as page:
        await page.goto(f"{h.url}/ui/")
        await page.wait_for_selector("#live.on")
        body = {"model": h.model, "prompt": "The capital of France is", "max_tokens": 6, "stream": True,
                "mock": {"fail": "stall", "after": 2}}  # two chunks, then the upstream goes silent
        async with h.post("/v1/completions", body) as resp:
            gen = resp.headers["X-Neocloud-Generation-Id"]
            received = b""
            while received.count(b"\n\n") < 2:
                received += await resp.content.readany()
            row = page.locator(f'#requests tr.inflight[data-id="{gen}"]')
            await row.wait_for()
            assert (await row.locator("td").all_inner_texts())[4] == "in flight"
            await row.click()
            await page.wait_for_function("() => document.querySelectorAll('#client-events li').length === 2")
            assert (await page.inner_text("#detail-facts")).startswith("state\nin flight\n")
            texts = [json.loads(d)["choices"][0]["text"]
                     for d in await page.locator("#client-events .d").all_inner_texts()]
            assert texts == [" Paris", " is"]
        # the client has hung up: the row is written and the open detail view turns into it
        await page.wait_for_function(
            "() => [...document.querySelectorAll('#detail-facts div')].some(d => d.textContent === 'client leftyes')")
        await page.click("a.back")
        final = page.locator(f'#requests tr[data-id="{gen}"]')
        await page.wait_for_selector(f'#requests tr[data-id="{gen}"]:not(.inflight)')
        assert (await final.locator("td").all_inner_texts())[4] == "200 (left)"
