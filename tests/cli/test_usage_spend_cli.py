"""``kilnproxy usage --from --to --group-by --csv``: the spend query of ``GET /admin/v1/usage`` from the
command line, on both stores, read while the gateway runs: the same CSV bytes as the API's, the same
JSON rows; a bad option is one line naming it (exit 2); a ledger no gateway of this version opened (no
rollup) is answered from its rows, and left as it was."""

import asyncio
import json
import sqlite3
import sys
from datetime import datetime, timedelta, timezone

from processes import toml
from spend_rows import csv_text, expected, move

from kilnproxy.store.sqlite.inserts import insert_sync
from kilnproxy.store.sqlite.schema import SCHEMA
from kilnproxy.testing import MODEL, OTHER_KEY, completion_body


async def usage(*args: str, cwd=None) -> tuple[int, bytes, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kilnproxy", "usage", *args, cwd=cwd,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, out, err.decode()


async def traffic(h) -> list[dict]:
    """Six rows of real requests, moved to 7 h apart from midnight two days ago."""
    ids = []
    for key, max_tokens in ((None, 4), (None, 9), (OTHER_KEY, 3), (None, 1), (OTHER_KEY, 6)):
        async with h.post("/v1/completions", completion_body(max_tokens=max_tokens), key=key) as resp:
            await resp.read()
            ids.append(resp.headers["X-Neocloud-Generation-Id"])
    async with h.post("/v1/completions", completion_body(model="unknown-model")) as resp:
        assert resp.status == 404
        ids.append(resp.headers["X-Neocloud-Generation-Id"])
    midnight = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=2)
    await move(h, {i: (midnight + timedelta(hours=7 * n)).isoformat(timespec="milliseconds")
                   for n, i in enumerate(ids)})
    return sorted(await h.rows(), key=lambda r: r["created_at"])


async def test_the_spend_query_as_the_api_answers_it(harness, store, tmp_path):
    async with harness(overrides=store) as h:
        rows = await traffic(h)
        (tmp_path / "kiln.toml").write_text(toml(h.config))
        config = ("--config", str(tmp_path / "kiln.toml"))
        start = rows[1]["created_at"]  # a row's own time: from is inclusive
        end = rows[5]["created_at"]  # and to exclusive
        code, out, err = await usage(*config, "--from", start, "--to", end, "--group-by", "day,model", "--csv")
        assert (code, err) == (0, "")
        assert out == csv_text(expected(rows[1:5], ("day", "model")), ("day", "model"))
        async with h.session.get(f"{h.url}/admin/v1/usage", headers={"Accept": "text/csv"},
                                 params={"from": start, "to": end, "group_by": "day,model"}) as resp:
            assert await resp.read() == out
        code, out, err = await usage(*config, "--group-by", "key,org", "--json")
        assert (code, err) == (0, "")
        assert json.loads(out) == {"data": expected(rows, ("key", "org"))}
        code, out, err = await usage(*config, "--org", "globex", "--from", rows[0]["created_at"][:10], "--csv")
        assert out == csv_text(expected([r for r in rows if r["org"] == "globex"]), ())
        code, out, err = await usage(*config, "--group-by", "model")
        assert code == 0
        lines = out.decode().splitlines()
        assert lines[0].split() == ["model", "requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cost"]
        assert [line.split()[:2] for line in lines[1:]] == [[MODEL, "5"], ["unknown-model", "1"]]


async def test_bad_options_are_one_line_naming_them(gw):
    for args, named in ((("--group-by", "week"), "--group-by 'week'"), (("--from", "yesterday"), "--from 'yesterday'"),
                        (("--to", "2026-02-30"), "--to '2026-02-30'"),
                        (("--from", "2026-11-02", "--to", "2026-11-01"), "--from '2026-11-02'"),
                        (("--group-by", "day", "--since", "2026-11-01"), "--since is not an option"),
                        (("--csv", "--json"), "--csv or --json")):
        code, out, err = await usage("--db", str(gw.db), *args)
        assert (code, out) == (2, b""), args
        assert len(err.splitlines()) == 1 and named in err, (args, err)


async def test_a_ledger_without_the_rollup_is_answered_from_its_rows(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(SCHEMA)  # as a kilnproxy before the rollup left it
    rows = []
    for n in range(40):
        row = {"id": f"gen-{n}", "created_at": f"2026-11-{1 + n % 4:02d}T{n % 24:02d}:30:00.000+00:00",
               "org": ("acme", "globex")[n % 2], "key_id": f"key-{n % 3}", "model": ("m1", "m2")[n % 2 and n % 3 > 0],
               "endpoint": "completions", "stream": 0, "status": 200, "error_code": None, "prompt_tokens": n,
               "completion_tokens": 3 * n, "cached_tokens": n % 4, "total_tokens": 4 * n,
               "cost": round(n * 3.3e-7, 10), "duration_ms": 1.0, "ttft_ms": None, "finish_reason": "stop",
               "disconnected": 0, "requested_model": None, "upstream": None, "batch_id": None}
        rows.append(row)
    insert_sync(db, rows)
    db.close()
    before = path.read_bytes()
    code, out, err = await usage("--db", str(path), "--from", "2026-11-02T12:00", "--to", "2026-11-04",
                                 "--group-by", "day,key", "--json")
    assert (code, err) == (0, "")
    inside = [r for r in rows if "2026-11-02T12:00" <= r["created_at"] < "2026-11-04"]
    assert json.loads(out) == {"data": expected(inside, ("day", "key"))}
    assert path.read_bytes() == before
