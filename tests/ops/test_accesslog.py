"""The JSON access log: one line per request on the gateway process' stdout."""

import json

import aiohttp
import pytest
from processes import GatewayProcess, gateway_config

from kilnproxy.ops.accesslog import AccessLog
from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import KEY, MODEL
from kilnproxy.web.server import start_mock

AUTH = {"Authorization": f"Bearer {KEY}"}
FIELDS = {"time", "generation_id", "org", "key_id", "model", "endpoint", "stream", "status", "error_code",
          "prompt_tokens", "completion_tokens", "cached_tokens", "cost", "duration_ms", "ttft_ms",
          "finish_reason", "upstream", "disconnected"}


@pytest.fixture
async def mock():
    running = await start_mock()
    yield running
    await running.stop()


async def test_one_json_line_per_request_without_secrets_or_prompts(tmp_path, mock, eventually):
    host = mock.url.split("://", 1)[1]  # the upstream's URL carries a password: the lines name it without
    gw = await GatewayProcess(tmp_path, gateway_config([f"http://user:upstream-pw@{host}/v1"])).start()
    try:
        ids = []
        async with aiohttp.ClientSession() as s:
            for body in ({"model": MODEL, "prompt": "secret prompt words", "max_tokens": 3, "stream": True},
                         {"model": MODEL, "prompt": "secret prompt words", "max_tokens": 2},
                         {"model": "missing-model", "prompt": "secret prompt words"}):
                async with s.post(f"{gw.url}/v1/completions", headers=AUTH, json=body) as r:
                    await r.read()
                    ids.append(r.headers["X-Neocloud-Generation-Id"])
            async with s.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer nope"},
                              json={"model": MODEL}) as r:
                assert r.status == 401  # no org, no row, no line
        await gw.wait_for("stdout", ids[-1])
        lines = [line for line in gw.lines["stdout"] if line.startswith("{")]
        assert len(lines) == 3
        entries = [json.loads(line) for line in lines]
        assert [e["generation_id"] for e in entries] == ids
        for line in lines:
            assert KEY not in line and "secret prompt" not in line and "Paris" not in line
            assert "upstream-pw" not in line
        stream, whole, missing = entries
        assert set(stream) == FIELDS
        assert stream | {"time": None, "duration_ms": None, "ttft_ms": None, "cost": None} == {
            "time": None, "generation_id": ids[0], "org": "acme", "key_id": "acme-key", "model": MODEL,
            "endpoint": "completions", "stream": True, "status": 200, "error_code": None, "prompt_tokens": 3,
            "completion_tokens": 3, "cached_tokens": 0, "cost": None, "duration_ms": None, "ttft_ms": None,
            "finish_reason": "length", "upstream": f"{mock.url}/v1", "disconnected": False}
        assert stream["cost"] == pytest.approx((3 * 0.10 + 3 * 0.30) / 1e6)
        assert stream["duration_ms"] >= stream["ttft_ms"] > 0
        assert (whole["stream"], whole["completion_tokens"]) == (False, 2)
        assert (missing["status"], missing["error_code"], missing["upstream"]) == (404, "model_not_found", None)
        # a lone request's row reaches the table a moment after its response (the row journal)
        await eventually(lambda: {e["generation_id"] for e in entries} <= {r["id"] for r in gw.rows()})
        rows = {r["id"]: r for r in gw.rows()}
        for entry in entries:
            row = rows[entry["generation_id"]]
            assert (row["status"], row["cost"], row["duration_ms"]) == (
                entry["status"], entry["cost"], entry["duration_ms"])
    finally:
        await gw.stop()


async def test_bodies_only_when_configured(harness, capsys):
    async with harness(overrides={"log": {"bodies": True}}) as h:
        async with h.post("/v1/completions", {"model": h.model, "prompt": "tell me", "max_tokens": 2}) as r:
            assert r.status == 200
            answer = await r.json()
    entry = json.loads(capsys.readouterr().out.strip())
    assert entry["body"]["prompt"] == "tell me"
    assert answer["choices"][0]["text"] not in json.dumps(entry)  # completions are never logged


async def test_access_log_switched_off(harness, capsys):
    async with harness(overrides={"log": {"access": False}}) as h:
        assert not any(isinstance(o, AccessLog) for o in h.app[GATEWAY].row_observers)
        async with h.post("/v1/completions", {"model": h.model, "prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200
        assert len(await h.rows()) == 1
    assert capsys.readouterr().out == ""


async def test_disconnected_client_is_logged(harness, capsys):
    async with harness() as h:
        resp = await h.post("/v1/completions", {"model": h.model, "prompt": "hi", "max_tokens": 50,
                                                "stream": True, "mock": {"delay": 0.05}})
        await resp.content.readline()
        resp.close()
        await h.mock_wait(hangups=1)
    rows = await h.rows()  # the gateway has stopped: its ledger is flushed
    assert len(rows) == 1 and rows[0]["disconnected"] == 1
    entry = json.loads(capsys.readouterr().out.strip())
    assert (entry["generation_id"], entry["disconnected"]) == (rows[0]["id"], True)
