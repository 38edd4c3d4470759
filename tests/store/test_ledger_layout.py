"""The ledger file's layout: a new file gets small pages (a one-row commit appends less to the WAL);
a file made before keeps its page size, and its rows and new ones are read and written as ever."""

import sqlite3

from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.store.sqlite.schema import NEW_FILE_PAGE_SIZE, SCHEMA
from kilnproxy.usage import COLUMNS


def row(i: int) -> dict:
    values = dict.fromkeys(COLUMNS, 0)
    values.update(id=f"gen-{i:024x}", created_at="2026-11-30T10:00:00.000+00:00", org="acme", key_id="acme-key",
                  model="m", endpoint="completions", error_code=None, finish_reason="stop", requested_model="m",
                  upstream=None, batch_id=None)
    return values


def page_size(path) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA page_size").fetchone()[0]
    finally:
        db.close()


async def test_a_new_file_has_small_pages(tmp_path):
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    try:
        for i in range(3):
            await ledger.submit(row(i))
    finally:
        await ledger.close()
    assert NEW_FILE_PAGE_SIZE == 1024
    assert page_size(tmp_path / "usage.db") == 1024


async def test_a_file_made_with_4k_pages_keeps_them_and_its_rows(tmp_path):
    path = tmp_path / "usage.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA page_size=4096")
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(SCHEMA)
    db.execute(f"INSERT INTO usage_events ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
               [row(0)[c] for c in COLUMNS])
    db.close()
    ledger = SQLiteLedger(path)
    await ledger.open()
    try:
        for i in (1, 2):
            await ledger.submit(row(i))
        assert await ledger.get(row(0)["id"]) == row(0)
    finally:
        await ledger.close()
    assert page_size(path) == 4096
    db = sqlite3.connect(path)
    try:
        assert [r[0] for r in db.execute("SELECT id FROM usage_events ORDER BY rowid")] == [row(i)["id"] for i in range(3)]
    finally:
        db.close()
