"""``python -m kilnproxy usage``: totals by org and model, read while the gateway runs."""

import asyncio
import json
import sys

import pytest

from kilnproxy.testing import MODEL, OTHER_KEY

PRICE = {"prompt": 0.10, "completion": 0.30}


async def usage(*args: str, cwd=None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kilnproxy", "usage", *args, cwd=cwd,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def traffic(gw) -> None:
    for key, n in ((None, 3), (OTHER_KEY, 2)):
        for i in range(n):
            request = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "stream": bool(i % 2)}
            async with gw.post("/v1/completions", request, key=key) as resp:
                assert resp.status == 200
                await resp.read()
    async with gw.post("/v1/completions", {"model": "unknown-model"}) as resp:
        assert resp.status == 404


async def test_json_totals_by_org_and_model_while_the_gateway_runs(gw):
    await traffic(gw)
    code, out, err = await usage("--db", str(gw.db), "--json")
    assert (code, err) == (0, "")
    one = (5 * PRICE["prompt"] + 4 * PRICE["completion"]) / 1_000_000
    rows = json.loads(out)
    assert [(r["org"], r["model"], r["requests"], r["errors"]) for r in rows] == [
        ("acme", MODEL, 3, 0), ("acme", "unknown-model", 1, 1), ("globex", MODEL, 2, 0)]
    acme = rows[0]
    assert (acme["prompt_tokens"], acme["completion_tokens"], acme["total_tokens"]) == (15, 12, 27)
    assert abs(acme["cost"] - 3 * one) < 1e-15
    assert rows[1]["cost"] == 0


async def test_filters_and_the_table(gw):
    await traffic(gw)
    code, out, _ = await usage("--db", str(gw.db), "--org", "globex", "--json")
    assert [(r["org"], r["requests"]) for r in json.loads(out)] == [("globex", 2)]
    code, out, _ = await usage("--db", str(gw.db), "--model", "unknown-model", "--json")
    assert [(r["org"], r["model"], r["requests"]) for r in json.loads(out)] == [("acme", "unknown-model", 1)]
    code, out, _ = await usage("--db", str(gw.db), "--since", "2999-01-01", "--json")
    assert (code, json.loads(out)) == (0, [])
    code, out, _ = await usage("--db", str(gw.db), "--since", "2000-01-01T00:00:00+02:00")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split() == ["org", "model", "requests", "errors", "prompt", "completion", "cached", "total",
                                "cost", "(USD)"]
    assert lines[1].split()[:4] == ["acme", MODEL, "3", "0"]
    assert lines[-2].split()[:3] == ["globex", MODEL, "2"]
    assert lines[-1].split()[:3] == ["total", "6", "1"]


async def test_reads_the_database_named_by_the_config(gw, tmp_path):
    await traffic(gw)
    config = tmp_path / "gateway.toml"
    config.write_text(f'''
[storage]
path = "{gw.db.name}"

[[models]]
id = "{MODEL}"
upstreams = ["{gw.mock_url}/v1"]

[[orgs]]
id = "acme"
credits = 1.0
''')
    code, out, err = await usage("--config", str(config), "--org", "acme", "--json", cwd="/")
    assert (code, err) == (0, "")
    assert sum(r["requests"] for r in json.loads(out)) == 4


async def test_bad_since_is_one_line_and_exit_2(gw):
    code, out, err = await usage("--db", str(gw.db), "--since", "last tuesday")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("kilnproxy: error: --since 'last tuesday'")


@pytest.mark.parametrize("since", ["9999-12-31T23:59:59-01:00", "0001-01-01T00:00+01:00"])
async def test_since_out_of_range_is_one_line_and_exit_2(gw, since):
    code, out, err = await usage("--db", str(gw.db), "--since", since)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(f"kilnproxy: error: --since {since!r}: out of range")


async def test_missing_database_is_one_line_and_exit_2(tmp_path):
    code, out, err = await usage("--db", str(tmp_path / "nope.db"))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "no usage database" in err


async def test_a_directory_as_database_is_one_line_and_exit_2(tmp_path):
    code, out, err = await usage("--db", str(tmp_path))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("kilnproxy: error: ") and "is a directory" in err


async def test_empty_ledger(gw):
    code, out, _ = await usage("--db", str(gw.db))
    assert (code, out) == (0, "no usage recorded\n")


def pg_config(tmp_path, url: str, mock_url: str = "http://127.0.0.1:1") -> str:
    config = tmp_path / "pg.toml"
    config.write_text(f'''
[storage]
url = "{url}"

[[models]]
id = "{MODEL}"
upstreams = ["{mock_url}/v1"]

[[orgs]]
id = "acme"
credits = 1.0
''')
    return str(config)


async def test_postgresql_gives_the_same_totals_as_sqlite(harness, gw, pg_url, tmp_path):
    """The rows of a gateway on PostgreSQL, read with the config's url: the same output as the same
    traffic on SQLite, table and JSON, filters included."""
    await traffic(gw)
    async with harness(overrides={"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}}) as pg:
        await traffic(pg)
    config = pg_config(tmp_path, pg_url)
    for args in ((), ("--json",), ("--org", "acme", "--json"), ("--model", "unknown-model"),
                 ("--since", "2000-01-01T00:00:00+02:00", "--json"), ("--since", "2999-01-01")):
        on_sqlite = await usage("--db", str(gw.db), *args)
        on_postgresql = await usage("--config", config, *args)
        assert on_postgresql == on_sqlite and on_sqlite[0] == 0
    rows = json.loads((await usage("--config", config, "--json"))[1])
    assert [(r["org"], r["model"], r["requests"], r["errors"], r["total_tokens"]) for r in rows] == [
        ("acme", MODEL, 3, 0, 27), ("acme", "unknown-model", 1, 1, 0), ("globex", MODEL, 2, 0, 18)]


async def test_unreachable_postgresql_is_one_line_and_exit_2(postgres, tmp_path):
    url = postgres.url("kiln", password="wrong-secret")
    code, out, err = await usage("--config", pg_config(tmp_path, url))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("kilnproxy: error: cannot connect to PostgreSQL at ")
    assert "wrong-secret" not in err and "kiln:***@" in err
