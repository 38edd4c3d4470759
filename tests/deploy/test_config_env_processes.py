"""The environment rule in real processes: ``python -m kilnproxy`` serves what ``KILNPROXY__*`` says, on top
of a file or of the demo; ``check-config`` shows where each value came from and no secret; a bad
variable stops start-up in one line, exit status 2, no traceback."""

from __future__ import annotations

import sqlite3

import aiohttp
import pytest
from deploy_processes import Served, free_port, run

from kilnproxy.config import parse_config

CONFIG = """
[server]
host = "127.0.0.1"
port = 1
drain_seconds = 0
[storage]
path = "from-file.db"
[health]
interval = 0
[plugins]
entry_points = false
[[models]]
id = "m"
upstreams = ["http://127.0.0.1:9/v1"]
[[orgs]]
id = "acme"
[[keys]]
key = "sk-1"
org = "acme"
"""
# The README's curl ("Try the demo")
DEMO_BODY = {"model": "kiln-demo", "prompt": "The capital of France is", "max_tokens": 12, "stream": True}


async def test_the_gateway_listens_where_the_environment_says_over_the_file(tmp_path):
    (tmp_path / "gw.toml").write_text(CONFIG)
    port = free_port()
    async with Served(["--config", "gw.toml"], tmp_path, KILNPROXY__SERVER__PORT=str(port),
                      KILNPROXY__STORAGE__PATH="from-env.db") as gw:
        assert gw.url == f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gw.url}/healthz?ready") as r:
                assert r.status == 200
            async with http.get(f"{gw.url}/v1/models", headers={"Authorization": "Bearer sk-1"}) as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["m"]
        code, err = await gw.stop()
        assert code == 0 and "Traceback" not in err
    assert (tmp_path / "from-env.db").exists() and not (tmp_path / "from-file.db").exists()


async def test_the_demo_with_no_file_takes_the_environment_too(tmp_path):
    port = free_port()
    async with Served([], tmp_path, KILNPROXY__SERVER__PORT=str(port), KILNPROXY__STORAGE__PATH="demo-ledger.db",
                      KILNPROXY__LOG__ACCESS="false") as gw:
        assert gw.url == f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{gw.url}/v1/completions", json=DEMO_BODY,
                                 headers={"Authorization": "Bearer sk-kiln-demo"}) as r:
                assert r.status == 200
                body = await r.text()
        assert body.endswith("data: [DONE]\n\n")
        code, err = await gw.stop()
        assert code == 0 and "Traceback" not in err
    assert not any(line.startswith("{") for line in gw.stdout)  # [log] access = false from the environment
    db = sqlite3.connect(tmp_path / "demo-ledger.db")
    try:
        assert db.execute("SELECT org, model, status FROM usage_events").fetchall() == [("demo", "kiln-demo", 200)]
    finally:
        db.close()


@pytest.mark.parametrize("args", [[], ["--config", "gw.toml"]])
@pytest.mark.parametrize("variables, line", [
    ({"KILNPROXY__SERVER__PORT": "http"},
     "kilnproxy: error: KILNPROXY__SERVER__PORT: server.port: must be an integer, got 'http'"),
    ({"KILNPROXY__SERVER__HOTS": "0.0.0.0"},
     "kilnproxy: error: KILNPROXY__SERVER__HOTS: server.hots: unknown key (check its spelling against "
     "config.example.toml)"),
    ({"KILNPROXY__ORGS__ID": "acme"},
     "kilnproxy: error: KILNPROXY__ORGS__ID: [[orgs]] is an array of tables: it stays in the config file"),
])
def test_a_bad_variable_stops_start_up_in_one_line(tmp_path, args, variables, line):
    (tmp_path / "gw.toml").write_text(CONFIG)
    out = run(args, tmp_path, **variables)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")
    out = run(["check-config", *args[1:]], tmp_path, **variables)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")


def test_check_config_shows_the_values_from_the_environment_and_no_secret(tmp_path):
    (tmp_path / "gw.toml").write_text(CONFIG)
    secrets = {"KILNPROXY__ADMIN__TOKEN": "adm-s3cret-1", "KILNPROXY__INSPECTOR__TOKEN": "insp-s3cret-2",
               "KILNPROXY__STORAGE__URL": "postgresql://kiln:pg-s3cret-3@db.internal:5432/kiln?sslmode=require",
               "KILNPROXY__PLUGINS__SETTINGS": '{webhook = {url = "https://hooks.example/t/hook-s3cret-4"}}'}
    out = run(["check-config", "gw.toml"], tmp_path, KILNPROXY__SERVER__PORT="9100",
              KILNPROXY__SERVER__HOST="0.0.0.0", **secrets)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines() == [
        "gw.toml: OK",
        "  listen   0.0.0.0:9100",
        f"  storage  postgresql://kiln:***@db.internal:5432/kiln?sslmode=require (spool {tmp_path}/"
        "kilnproxy-spool.db)",
        "  model    m -> m via http://127.0.0.1:9/v1, routing least_busy",
        "  org      acme: 0.0 USD, 8 in flight, interactive, weight 1, 1 key(s)",
        "  ops      metrics on, access log on, health checks off, admin token or loopback, drain 0 s, "
        "shutdown grace 30 s",
        '  setting  server.port = 9100 (environment: KILNPROXY__SERVER__PORT)',
        '  setting  server.host = "0.0.0.0" (environment: KILNPROXY__SERVER__HOST)',
        '  setting  storage.url = "postgresql://kiln:***@db.internal:5432/kiln?sslmode=require" '
        "(environment: KILNPROXY__STORAGE__URL)",
        "  setting  plugins.settings = {webhook = {...}} (environment: KILNPROXY__PLUGINS__SETTINGS)",
        "  setting  admin.token = <secret> (environment: KILNPROXY__ADMIN__TOKEN)",
        "  setting  inspector.token = <secret> (environment: KILNPROXY__INSPECTOR__TOKEN)",
    ]
    assert "s3cret" not in out.stdout


def test_check_config_settings_says_file_environment_or_default_for_every_key(tmp_path):
    (tmp_path / "gw.toml").write_text(CONFIG)
    out = run(["check-config", "gw.toml", "--settings"], tmp_path, KILNPROXY__SERVER__PORT="9100",
              KILNPROXY__ADMIN__TOKEN_SHA256="cd" * 32)
    assert (out.returncode, out.stderr) == (0, "")
    settings = [line for line in out.stdout.splitlines() if line.startswith("  setting  ")]
    assert len(settings) == len(parse_config({}).settings)  # every key the loader reads, once
    assert '  setting  server.port = 9100 (environment: KILNPROXY__SERVER__PORT)' in settings
    assert '  setting  server.host = "127.0.0.1" (file)' in settings
    assert '  setting  storage.path = "from-file.db" (file)' in settings
    assert '  setting  server.shutdown_grace_seconds = 30.0 (default)' in settings
    assert '  setting  plugins.entry_points = false (file)' in settings
    assert '  setting  plugins.modules = [] (default)' in settings
    assert '  setting  admin.token_sha256 = <secret> (environment: KILNPROXY__ADMIN__TOKEN_SHA256)' in settings
    assert '  setting  tracing.trace_url = none (default)' in settings
    assert "cd" * 32 not in out.stdout


def test_check_config_with_no_file_checks_the_environment_alone(tmp_path):
    out = run(["check-config"], tmp_path, KILNPROXY__SERVER__PORT="9100", KILNPROXY__STORAGE__PATH="k.db")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines() == [
        "<environment>: OK",
        "  listen   127.0.0.1:9100",
        f"  storage  {tmp_path / 'k.db'}",
        "  ops      metrics on, access log on, health checks every 10 s on /health, admin loopback, drain 5 s, "
        "shutdown grace 30 s",
        "  setting  server.port = 9100 (environment: KILNPROXY__SERVER__PORT)",
        '  setting  storage.path = "k.db" (environment: KILNPROXY__STORAGE__PATH)',
    ]


def test_kilnproxy_config_names_the_file_check_config_reads(tmp_path):
    (tmp_path / "gw.toml").write_text(CONFIG)
    out = run(["check-config"], tmp_path, KILNPROXY_CONFIG="gw.toml")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines()[:2] == ["gw.toml: OK", "  listen   127.0.0.1:1"]
