"""The inspector's "Upstreams" page in Debian's chromium (Playwright, as tests/inspector/test_inspector_browser.py):
two mock servers with prompt caches behind cache_aware routing; the page shows each one's tokens, hit rate and
load as conversations go through, refreshing itself, within the page's Content-Security-Policy."""

from browser import ARTIFACTS, chromium_page

from kilnproxy.testing import Harness, MODEL
from kilnproxy.web.server import start_mock

TOKEN = "s3cret"
OPENING = "Here is a long document to discuss. " * 10


async def cells(page, selector):
    return await page.locator(selector).locator("td").all_inner_texts()


def row_of(url):
    return f'#upstreams-table tr[data-upstream="{url}"]'


async def test_hit_rate_and_load_per_upstream_on_the_page(tmp_path):
    servers = [await start_mock(prompt_cache_slots=2) for _ in range(2)]
    urls = [f"{m.url}/v1" for m in servers]
    try:
        def configure(config):
            config["models"][0].update(upstreams=urls, routing="cache_aware", load_poll=0)
            config["inspector"] = {"token": TOKEN}

        async with Harness(tmp_path, configure=configure) as h, chromium_page() as page:
            await page.goto(f"{h.url}/ui/?token={TOKEN}#/upstreams")
            for url in urls:
                await page.wait_for_selector(row_of(url))
                assert await cells(page, row_of(url)) == [MODEL, "cache_aware", url, "up", "0", "0", "0", "–"]
            assert await page.get_attribute("#tab-upstreams", "class") == "active"

            # one conversation of three turns: its server's cache serves the later two
            messages = [{"role": "user", "content": f"Conversation one. {OPENING}"}]
            prompt = cached = 0
            for n in range(3):
                async with h.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3}) \
                        as resp:
                    assert resp.status == 200
                    answer = await resp.json()
                    generation_id = resp.headers["X-Neocloud-Generation-Id"]
                prompt += answer["usage"]["prompt_tokens"]
                cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                messages = [*messages, answer["choices"][0]["message"], {"role": "user", "content": f"And {n}?"}]
            served = (await h.row(generation_id))["upstream"]
            [idle] = [u for u in urls if u != served]
            assert cached > 0
            # the page refreshes on its own (every 2 s): wait for the served server's figures
            await page.wait_for_function(
                "([sel, n]) => document.querySelector(sel + ' .prompt').textContent === n",
                arg=[row_of(served), f"{prompt:,}"])
            rate = f"{cached / prompt * 100:.1f}%"
            assert await cells(page, row_of(served)) == [
                MODEL, "cache_aware", served, "up", "0", f"{prompt:,}", f"{cached:,}", rate]
            assert await cells(page, row_of(idle)) == [MODEL, "cache_aware", idle, "up", "0", "0", "0", "–"]
            width = await page.eval_on_selector(f"{row_of(served)} .bar span", "e => e.style.width")
            assert float(width.rstrip("%")) == float(rate.rstrip("%"))  # set through the CSSOM: the page's CSP refuses style attributes

            # a stream held in flight: the load column says so while it lasts
            held = await h.post("/v1/chat/completions", {
                "model": MODEL, "stream": True, "max_tokens": 3, "mock": {"silence": 60}, "messages": messages})
            try:
                assert held.status == 200
                await page.wait_for_function(
                    "sel => document.querySelector(sel + ' .load').textContent === '1'", arg=row_of(served))
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / "inspector-upstreams.png"), full_page=True)
            finally:
                held.close()
            await page.wait_for_function(
                "sel => document.querySelector(sel + ' .load').textContent === '0'", arg=row_of(served))
    finally:
        for m in servers:
            await m.stop()
