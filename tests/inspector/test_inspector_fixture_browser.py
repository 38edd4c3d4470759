"""The inspector page's "save as fixture" link, in the headless chromium of test_inspector_browser."""


from browser import chromium_page, stream_through

from kilnproxy.mock_servers.format import load


async def test_save_as_fixture_downloads_a_fixture_that_replays(harness, tmp_path):
    async with harness(overrides={"inspector": {"capture": True}}) as h, chromium_page() as page:
        gen = await stream_through(h, "The capital of France is")
        await h.row(gen)
        await page.goto(f"{h.url}/ui/#/requests/{gen}")
        await page.wait_for_selector("#save-fixture:not([hidden])")
        async with page.expect_download() as info:
            await page.click("#save-fixture")
        download = await info.value
        assert download.suggested_filename == f"{gen}.json"
        await download.save_as(tmp_path / "saved.json")
    fixture = load(tmp_path / "saved.json")
    assert fixture.path == "/v1/completions" and fixture.stream and fixture.content.endswith(b"data: [DONE]\n\n")
    async with harness(replay=tmp_path / "saved.json") as h:
        async with h.post("/v1/completions", h.client_body()) as resp:
            assert resp.status == 200 and b" Paris" in await resp.read()
