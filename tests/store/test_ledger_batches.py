"""The ledger writes a batch of any size as one transaction of multi-row INSERTs, every row intact;
generation ids sort by creation time so that the table's key grows at its end."""

import re
import sqlite3

import pytest

from kilnproxy.proxy.request_path import new_generation_id
from kilnproxy.store.sqlite.inserts import ROWS_PER_INSERT
from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.usage import COLUMNS


def row(i: int) -> dict:
    return {"id": f"gen-{i:024x}", "created_at": "2026-11-29T20:00:00.000+00:00", "org": "acme",
            "key_id": "acme-key", "model": "m", "endpoint": "completions", "stream": i % 2, "status": 200,
            "error_code": None if i % 3 else "upstream_error", "prompt_tokens": i, "completion_tokens": 2 * i,
            "cached_tokens": 0, "total_tokens": 3 * i, "cost": i / 1e6, "duration_ms": 1.5, "ttft_ms": None,
            "finish_reason": "length", "disconnected": 0, "requested_model": "m", "upstream": None,
            "batch_id": None}


@pytest.mark.parametrize("n", [1, 2, ROWS_PER_INSERT, ROWS_PER_INSERT + 1, 3 * ROWS_PER_INSERT + 7])
async def test_a_batch_of_any_size_is_committed_in_one_go(tmp_path, n):
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    try:
        futures = [ledger.submit(row(i)) for i in range(n)]  # all queued before the writer runs
        for future in futures:
            await future
        assert ledger.commits == 1
        assert await ledger.get(row(n - 1)["id"]) == row(n - 1)
    finally:
        await ledger.close()
    db = sqlite3.connect(tmp_path / "usage.db")
    try:
        got = db.execute(f"SELECT {', '.join(COLUMNS)} FROM usage_events ORDER BY id").fetchall()
    finally:
        db.close()
    assert got == [tuple(row(i)[c] for c in COLUMNS) for i in range(n)]


def test_generation_ids_are_unique_and_sort_by_creation_time():
    ids = [new_generation_id() for _ in range(20000)]
    assert all(re.fullmatch(r"gen-[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    prefixes = [i[4:16] for i in ids]
    assert prefixes == sorted(prefixes)
