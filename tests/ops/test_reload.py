"""Reloading the config: SIGHUP, POST /admin/reload and `python -m kilnproxy reload`."""

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import pytest
from processes import GatewayProcess, gateway_config

from kilnproxy.cli.main import main
from kilnproxy.config import parse_config
from kilnproxy.mock_servers.mock_upstream import STATS
from kilnproxy.ops.admin import RELOADER
from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import KEY, MODEL
from kilnproxy.web.server import start_mock

NEW_KEY = "sk-test-acme-rotated"
STREAMS = 50
WORDS = 12


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def mock():
    running = await start_mock()
    yield running
    await running.stop()


async def read_stream(resp: aiohttp.ClientResponse, first_line: asyncio.Event) -> bytes:
    head = await resp.content.readline()
    first_line.set()
    return head + await resp.read()


async def test_sighup_during_open_streams_changes_key_and_maintenance(tmp_path, mock, eventually):
    config = gateway_config([f"{mock.url}/v1"])
    gw = await GatewayProcess(tmp_path, config).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            responses = await asyncio.gather(*(s.post(f"{gw.url}/v1/completions", headers=auth(KEY), json={
                "model": MODEL, "prompt": "hi", "max_tokens": WORDS, "stream": True,
                "mock": {"delay": 0.25}}) for _ in range(STREAMS)))
            started = [asyncio.Event() for _ in responses]
            readers = [asyncio.create_task(read_stream(r, e)) for r, e in zip(responses, started)]
            await asyncio.gather(*(e.wait() for e in started))

            config["keys"][0]["key"] = NEW_KEY
            config["maintenance"] = {"enabled": True, "retry_after": "Tue, 01 Dec 2026 06:00:00 GMT"}
            gw.write_config(config)
            gw.send(signal.SIGHUP)
            await gw.wait_for("stderr", "config reloaded")
            assert mock.app[STATS]["open"] == STREAMS  # every stream was open across the reload

            async with s.post(f"{gw.url}/v1/completions", headers=auth(KEY), json={"model": MODEL}) as r:
                assert r.status == 401
            async with s.post(f"{gw.url}/v1/completions", headers=auth(NEW_KEY), json={"model": MODEL}) as r:
                assert r.status == 503
                assert r.headers["Retry-After"] == "Tue, 01 Dec 2026 06:00:00 GMT"
                assert (await r.json())["error"]["code"] == "maintenance"

            bodies = await asyncio.gather(*readers)
        for body in bodies:
            assert body.endswith(b"data: [DONE]\n\n")
            assert body.count(b"data: ") == WORDS + 2  # the words, the finish chunk, [DONE]
            assert b'"error"' not in body
        # the last stream's row may reach the table a moment after its end (a lone row: the row journal)
        await eventually(lambda: len([r for r in gw.rows() if r["stream"]]) == STREAMS)
        rows = gw.rows()
        streamed = [r for r in rows if r["stream"]]
        assert len(streamed) == STREAMS
        assert all((r["status"], r["error_code"], r["completion_tokens"]) == (200, None, WORDS) for r in streamed)
        assert [(r["status"], r["error_code"]) for r in rows if not r["stream"]] == [(503, "maintenance")]
        assert len(await gw.wait_for("stderr", "config reloaded")) == 1
    finally:
        await gw.stop()


async def test_bad_config_is_refused_with_one_line(tmp_path, mock):
    config = gateway_config([f"{mock.url}/v1"])
    gw = await GatewayProcess(tmp_path, config).start()
    try:
        gw.write_config(config | {"keys": [{"key": "sk-x", "org": "nobody"}]})
        gw.send(signal.SIGHUP)
        line, = await gw.wait_for("stderr", "config reload refused")
        assert line.endswith("config reload refused, the running config stays in force: "
                             f"{gw.config_path}: keys[0].org: org 'nobody' does not exist; add an [[orgs]] entry"
                             " with id = 'nobody'")
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{gw.url}/v1/completions", headers=auth(KEY),
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200

            gw.write_config("[server\n")
            async with s.post(f"{gw.url}/admin/reload") as r:
                assert r.status == 422
                error = (await r.json())["error"]
                assert error["code"] == "config_invalid" and "not valid TOML" in error["message"]

            config["orgs"][0]["max_in_flight"] = 3
            gw.write_config(config)
            async with s.post(f"{gw.url}/admin/reload") as r:
                assert r.status == 200
                assert await r.json() == {"reloaded": True,
                                          "summary": "1 model(s), 2 org(s), 2 key(s), maintenance off"}
            async with s.get(f"{gw.url}/metrics") as r:
                text = await r.text()
        assert 'kilnproxy_config_reloads_total{result="ok"} 1.0' in text
        assert 'kilnproxy_config_reloads_total{result="refused"} 2.0' in text
        assert 'kilnproxy_org_max_in_flight{org="acme"} 3.0' in text
        assert len([line for line in gw.lines["stderr"] if "config reload refused" in line]) == 2
    finally:
        await gw.stop()


async def test_a_malformed_upstream_url_is_refused_by_post_and_by_sighup(tmp_path, mock):
    config = gateway_config([f"{mock.url}/v1"])
    gw = await GatewayProcess(tmp_path, config).start()
    try:
        gw.write_config(gateway_config(["http://[::1/v1"]))
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{gw.url}/admin/reload") as r:
                assert r.status == 422
                error = (await r.json())["error"]
            assert error["code"] == "config_invalid"
            assert error["message"] == (f"{gw.config_path}: models[0] ({MODEL}).upstreams: 'http://[::1/v1' is not "
                                        "a valid URL: Invalid IPv6 URL")
            gw.write_config(gateway_config(["http://127.0.0.1:99999/v1"]))
            gw.send(signal.SIGHUP)
            _, line = await gw.wait_for("stderr", "config reload refused", count=2)
            assert line.endswith("'http://127.0.0.1:99999/v1' is not a valid URL: Port out of range 0-65535")
            async with s.post(f"{gw.url}/v1/completions", headers=auth(KEY),
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200
        assert not [line for line in gw.lines["stderr"] if "Traceback" in line or "never retrieved" in line]
    finally:
        await gw.stop()


async def test_reload_command_by_pidfile_and_by_url(tmp_path, mock):
    config = gateway_config([f"{mock.url}/v1"])
    pidfile = tmp_path / "gw.pid"
    gw = await GatewayProcess(tmp_path, config, "--pidfile", str(pidfile)).start()
    try:
        config["maintenance"] = {"enabled": True}
        gw.write_config(config)
        out = await _cli("reload", "--pidfile", str(pidfile))
        assert out.returncode == 0 and out.stdout.startswith("sent SIGHUP to ")
        await gw.wait_for("stderr", "maintenance on")

        config["maintenance"] = {"enabled": False}
        gw.write_config(config)
        out = await _cli("reload", "--url", gw.url)
        assert (out.returncode, out.stdout) == (0, "reloaded: 1 model(s), 2 org(s), 2 key(s), maintenance off\n")

        gw.write_config(config | {"limits": {"max_in_flight_per_org": 0}})
        out = await _cli("reload", "--url", gw.url)
        assert out.returncode == 1 and out.stdout.startswith("refused, the running config stays in force: ")
        assert "limits.max_in_flight_per_org: must be greater than 0" in out.stdout

        gw.send(signal.SIGTERM)
        assert await gw.wait() == 0
        assert not pidfile.exists()
        out = await _cli("reload", "--pidfile", str(pidfile))
        assert out.returncode == 2 and out.stderr.startswith("kilnproxy: error: ")
    finally:
        await gw.stop()


@pytest.mark.parametrize("pid", ["-1", "0", "-7", "2147483648", "99999999999999999999"])
def test_a_pid_that_names_no_single_process_is_refused_without_a_signal(pid, tmp_path, monkeypatch, capsys):
    sent = []
    monkeypatch.setattr(os, "kill", lambda *args: sent.append(args))
    pidfile = tmp_path / "gw.pid"
    pidfile.write_text(f"{pid}\n")
    for args in (["--pid", pid], ["--pidfile", str(pidfile)]):
        assert main(["reload", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kilnproxy: error: ") and err.count("\n") == 1 and "not a process id" in err
    assert sent == []


@pytest.mark.parametrize("url", ["notaurl", "ftp://h/", "http://", "http://[::1", "http://h:99999"])
def test_a_url_that_is_not_http_is_one_line(url, capsys):
    assert main(["reload", "--url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kilnproxy: error: --url ") and err.count("\n") == 1


async def _cli(*args: str) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "kilnproxy", *args],
                                   capture_output=True, text=True, timeout=60)


async def test_reload_swaps_routes_keeping_upstream_state(harness, tmp_path):
    async with harness(overrides={"health": {"interval": 0}}) as h:
        gw = h.app[GATEWAY]
        old_upstream = gw.routes[MODEL].upstreams[0]
        old_upstream.failed()
        raw = {**h.config}
        raw["models"] = [h.config["models"][0], {**h.config["models"][0], "id": "second-model"}]
        raw["orgs"] = [{"id": "acme", "credits": 0.5, "max_in_flight": 1}, {"id": "globex", "credits": 1.0}]
        raw["keys"] = h.config["keys"] + [{"key": NEW_KEY, "org": "acme", "models": ["second-model"]}]
        raw["server"] = {**h.config["server"], "port": 1, "keepalive_seconds": 3}
        raw["log"] = {"access": False}
        assert [type(o).__name__ for o in gw.row_observers] == ["method", "AccessLog"]
        summary = h.app[RELOADER].apply(parse_config(raw, source="<test>"))
        assert summary == "2 model(s), 2 org(s), 3 key(s), maintenance off"
        assert gw.routes[MODEL].upstreams[0] is old_upstream and old_upstream.failures == 1
        assert gw.routes["second-model"].upstreams[0].failures == 1  # same URL: same health
        assert gw.config.server.port == 0 and gw.config.server.keepalive_seconds == 3
        assert [type(o).__name__ for o in gw.row_observers] == ["method"]  # metrics stay, the log is off
        async with h.session.get(f"{h.url}/v1/models", headers=auth(NEW_KEY)) as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["second-model"]
        async with h.session.get(f"{h.url}/v1/credits", headers=auth(KEY)) as r:
            assert (await r.json())["granted"] == 0.5
        held = await h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True,
                                                "mock": {"delay": 0.2}})
        await held.content.readline()
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi"}) as r:
            assert r.status == 429  # the new limit of 1
        assert (await held.read()).endswith(b"data: [DONE]\n\n")
        held.release()
