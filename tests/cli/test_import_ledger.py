"""``python -m kilnproxy import-ledger FILE.db --config CONFIG``: an SQLite ledger into PostgreSQL,
spending included, idempotent (several replicas (docs/reference.md))."""

import asyncio
import os
import shutil
import sqlite3
import sys

import asyncpg
import pytest
from closed_ports import refused_port

from kilnproxy.store.sqlite.schema import SCHEMA
from kilnproxy.testing import MODEL, OTHER_KEY, completion_body, pg_usage_rows, usage_rows

ROWS = 2500  # the synthetic ledger: three batches of 1000


async def run(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KILNPROXY_CONFIG"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kilnproxy", "import-ledger", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


def write_config(tmp_path, url: str | None) -> str:
    path = tmp_path / "pg.toml"
    storage = f'[storage]\nurl = "{url}"\n\n' if url else ""
    path.write_text(f'{storage}[[models]]\nid = "{MODEL}"\nupstreams = ["http://127.0.0.1:1/v1"]\n\n'
                    '[[orgs]]\nid = "acme"\ncredits = 1.0\n')
    return str(path)


async def fetch(url: str, sql: str) -> list:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


async def spending(url: str) -> tuple[dict, dict]:
    """``kiln_orgs.spent`` and ``SUM(cost)`` of the rows, per org."""
    spent = dict(await fetch(url, "SELECT org, spent FROM kiln_orgs WHERE spent <> 0"))
    sums = dict(await fetch(url, "SELECT org, SUM(cost) FROM usage_events GROUP BY org"))
    return spent, sums


@pytest.fixture
async def ledger(harness):
    """The SQLite ledger of a real gateway after some traffic: two orgs, streamed or not, one error."""
    async with harness() as h:
        for key, n in ((None, 3), (OTHER_KEY, 2)):
            for i in range(n):
                async with h.post("/v1/completions", completion_body(stream=bool(i % 2)), key=key) as resp:
                    assert resp.status == 200
                    await resp.read()
        async with h.post("/v1/completions", {"model": "unknown-model"}) as resp:
            assert resp.status == 404
    return h.db


def synthetic(path, rows: int = ROWS):
    """A ledger of ``rows`` rows in the single-process store's own schema, over three orgs."""
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    db.execute(f"""
        WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < {rows - 1})
        INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status, error_code,
                                  prompt_tokens, completion_tokens, total_tokens, cost, duration_ms, ttft_ms,
                                  requested_model)
        SELECT printf('gen-%06d', i), strftime('%Y-%m-%dT%H:%M:%f+00:00', 1764000000 + i, 'unixepoch'),
               CASE i % 3 WHEN 0 THEN 'acme' WHEN 1 THEN 'globex' ELSE 'initech' END, 'k', 'model-a',
               'completions', i % 2, CASE WHEN i % 50 = 0 THEN 502 ELSE 200 END,
               CASE WHEN i % 50 = 0 THEN 'upstream_unavailable' END, 10, i % 7, 10 + i % 7,
               (10 * 0.1 + (i % 7) * 0.3) / 1000000, 12.5, NULL, 'model-a'
        FROM n""")
    db.commit()
    db.close()
    return path


async def test_import_copies_every_row_and_moves_the_spending(ledger, harness, pg_url, tmp_path):
    config = write_config(tmp_path, pg_url)
    code, out, err = await run(str(ledger), "--config", config)
    assert (code, err) == (0, "")
    database = pg_url.rsplit("/", 1)[1]
    assert out == (f"imported 6 rows from {ledger} into postgresql://kiln:***@{pg_url.split('@')[1]} "
                   f"(0 already there)\n") and database in out
    assert await pg_usage_rows(pg_url) == usage_rows(ledger)
    assert {r["replica"] for r in await fetch(pg_url, "SELECT replica FROM usage_events")} == {"import-ledger"}
    spent, sums = await spending(pg_url)
    assert set(spent) == {"acme", "globex"} and spent == pytest.approx(sums, rel=1e-12)
    # a gateway on the database charges the orgs what the single process had spent
    async with harness(overrides={"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}}) as h:
        async with h.session.get(f"{h.url}/v1/credits", headers=h.headers()) as resp:
            credits = await resp.json()
    assert credits["spent"] == spent["acme"] > 0


async def test_a_second_run_adds_nothing(ledger, pg_url, tmp_path):
    config = write_config(tmp_path, pg_url)
    assert (await run(str(ledger), "--config", config))[0] == 0
    before = (await fetch(pg_url, "SELECT count(*) FROM usage_events"))[0][0], await spending(pg_url)
    code, out, err = await run(str(ledger), "--config", config)
    assert (code, err) == (0, "") and out.startswith("imported 0 rows ") and out.endswith(" (6 already there)\n")
    after = (await fetch(pg_url, "SELECT count(*) FROM usage_events"))[0][0], await spending(pg_url)
    assert after == before and before[0] == 6


async def test_a_large_file_in_batches_with_progress_and_a_run_that_goes_on(pg_url, tmp_path):
    """An import cut short (the first 1200 rows) is finished by running it again on the whole file."""
    full = synthetic(tmp_path / "full.db")
    part = tmp_path / "part.db"
    shutil.copyfile(full, part)
    db = sqlite3.connect(part)
    db.execute("DELETE FROM usage_events WHERE rowid > 1200")
    db.commit()
    db.close()
    config = write_config(tmp_path, pg_url)
    code, out, err = await run(str(part), "--config", config, "--batch", "1000")
    assert (code, err) == (0, "") and out.startswith("imported 1200 rows ")
    code, out, err = await run(str(full), "--config", config, "--batch", "1000", "--progress")
    assert code == 0 and out.startswith("imported 1300 rows ") and out.endswith(" (1200 already there)\n")
    assert "import-ledger: 100%" in err and "2.50k/2.50k" in err  # tqdm's bar, on stderr
    assert await pg_usage_rows(pg_url) == usage_rows(full)
    spent, sums = await spending(pg_url)
    assert set(spent) == {"acme", "globex", "initech"} and spent == pytest.approx(sums, rel=1e-12)


async def test_a_row_whose_text_is_not_utf8_stops_the_import_in_one_line(pg_url, tmp_path):
    """Refused, not imported with its bytes replaced; once the row is corrected a run again goes on."""
    path = synthetic(tmp_path / "odd.db", rows=5)
    db = sqlite3.connect(path)
    db.execute("UPDATE usage_events SET org = CAST(x'eda080' AS TEXT) WHERE rowid = 3")
    db.commit()
    config = write_config(tmp_path, pg_url)
    code, out, err = await run(str(path), "--config", config, "--batch", "2")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("kilnproxy: error: import into postgresql://kiln:***@")
    assert (f"stopped after row gen-000001 (2 rows added): row 3 of '{path}' holds text that is not UTF-8"
            " in its org column") in err
    db.execute("UPDATE usage_events SET org = 'initech' WHERE rowid = 3")
    db.commit()
    db.close()
    code, out, err = await run(str(path), "--config", config, "--batch", "2")
    assert (code, err) == (0, "") and out.startswith("imported 3 rows ") and out.endswith(" (2 already there)\n")
    assert await pg_usage_rows(pg_url) == usage_rows(path)


def not_sqlite(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 100)
    return path


def other_database(tmp_path):
    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE things (id INTEGER PRIMARY KEY)")
    db.close()
    return path


def older_table(tmp_path):
    path = tmp_path / "older.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE usage_events (id TEXT PRIMARY KEY, org TEXT, cost REAL)")
    db.close()
    return path


@pytest.mark.parametrize("make, message", [
    (lambda tmp_path: tmp_path / "missing.db", "no such file: '{path}'"),
    (not_sqlite, "'{path}' is not a kilnproxy ledger: file is not a database"),
    (other_database, "'{path}' is not a kilnproxy ledger: it has no usage_events table"),
    (older_table, "'{path}' is not a kilnproxy ledger: its usage_events table lacks created_at, key_id"),
], ids=["missing", "not-sqlite", "no-usage-table", "other-columns"])
async def test_a_file_that_is_not_a_ledger_is_one_line_and_exit_2(postgres, tmp_path, make, message):
    path = make(tmp_path)
    code, out, err = await run(str(path), "--config", write_config(tmp_path, postgres.url()))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("kilnproxy: error: " + message.format(path=path))


@pytest.mark.parametrize("case", ["no-url", "no-config", "wrong-password", "nobody-listening"])
async def test_a_config_without_a_reachable_database_is_one_line_and_exit_2(ledger, postgres, tmp_path, case):
    url = {"no-url": None, "no-config": None, "wrong-password": postgres.url(password="not-the-secret"),
           "nobody-listening": f"postgresql://kiln:not-the-secret@127.0.0.1:{refused_port()}/kiln"}[case]
    args = () if case == "no-config" else ("--config", write_config(tmp_path, url))
    code, out, err = await run(str(ledger), *args)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("kilnproxy: error: ")
    expected = {"no-url": "pg.toml: no [storage] url (or url_env)",
                "no-config": "import-ledger needs --config",
                "wrong-password": 'cannot connect to PostgreSQL at postgresql://kiln:***@',
                "nobody-listening": "cannot connect to PostgreSQL at postgresql://kiln:***@"}[case]
    assert expected in err and "not-the-secret" not in err
