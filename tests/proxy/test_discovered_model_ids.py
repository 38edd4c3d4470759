"""Model ids a discovering upstream lists, through a real gateway on a real port: ids that cannot be model ids
(a control character, longer than 256 characters) are refused (404 ``model_not_found``) and logged once,
escaped and shortened; a long list is named twenty ids a line."""

import asyncio

from kilnproxy.mock_servers.mock_upstream import OPTIONS


HUGE = "x" * 790_000
HOSTILE = ("good/model", "evil\n2026-12-01 kilnproxy INFO admin logged in", HUGE, "tab\there", "line\u2028break",
           "c1\x85", "ok:2", "y" * 256)


def discovering(config):
    model = config["models"][0]
    model.update(id="", discover=True, alias="kiln-demo", upstream_model="mock-vllm")
    del model["reject_chat_params"]


def discovery_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("model discovery")]


async def test_model_ids_that_cannot_be_ids_are_refused_and_logged_escaped_and_short(harness, caplog):
    caplog.set_level("INFO", logger="kilnproxy")
    async with harness(mock_options={"served_models": HOSTILE}, configure=discovering) as h:
        async with h.session.get(f"{h.url}/v1/models", headers=h.headers()) as resp:
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == ["kiln-demo", "good/model", "ok:2", "y" * 256]
        for model in (HOSTILE[1], HOSTILE[4], "tab\there"):
            async with h.post("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1}) as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "model_not_found"
        async with h.post("/v1/completions", {"model": "y" * 256, "prompt": "hi", "max_tokens": 1}) as resp:
            assert resp.status == 200
        rows = await h.rows()
        assert [(r["model"], r["status"], r["error_code"]) for r in rows] == [
            (HOSTILE[1], 404, "model_not_found"), (HOSTILE[4], 404, "model_not_found"),
            ("tab\there", 404, "model_not_found"), ("y" * 256, 200, None)]
        base = h.config["models"][0]["upstreams"][0]
    lines = discovery_lines(caplog)
    assert lines == [
        f"model discovery: {base}/models: 5 model id(s) refused, with a control character or longer than 256 "
        "characters: 'evil\\n2026-12-01 kilnproxy INFO admin logged in', "
        f"'{'x' * 80}'... (790000 characters), 'tab\\there', 'line\\u2028break', 'c1\\x85'",
        "model discovery: 4 model(s) served; new: 'good/model', 'ok:2', "
        f"'{'y' * 80}'... (256 characters)"]
    assert all("\n" not in r.getMessage() and len(r.getMessage()) < 1000 for r in caplog.records)


async def test_a_long_list_is_named_twenty_ids_a_line_and_refusals_are_logged_once(harness, caplog, monkeypatch):
    from kilnproxy.proxy import discovery
    monkeypatch.setattr(discovery, "INTERVAL", 0.02)
    caplog.set_level("INFO", logger="kilnproxy")
    served = tuple(f"m{i:03d}" for i in range(300)) + ("bad\r\n",)
    async with harness(mock_options={"served_models": served}, configure=discovering) as h:
        for _ in range(10):  # several reads of the same list
            await asyncio.sleep(0.03)
        lines = discovery_lines(caplog)
        base = h.config["models"][0]["upstreams"][0]
        assert lines == [f"model discovery: {base}/models: 1 model id(s) refused, with a control character or "
                         "longer than 256 characters: 'bad\\r\\n'",
                         "model discovery: 301 model(s) served; new: "
                         + ", ".join(f"'m{i:03d}'" for i in range(20)) + " and 280 more"]
        h.mock.app[OPTIONS]["served_models"] = served[:300] + ("worse\x00",)
        for _ in range(100):
            if len(discovery_lines(caplog)) == 3:
                break
            await asyncio.sleep(0.02)
        assert discovery_lines(caplog)[2:] == [
            f"model discovery: {base}/models: 1 model id(s) refused, with a control character or "
            "longer than 256 characters: 'worse\\x00'"]
