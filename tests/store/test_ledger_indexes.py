"""The usage table keeps only the indexes the gateway's own queries need: the inspector's reads by time and
by model go through tables of its own (``inspector_times``, ``inspector_models``), filled when it reads
them. A ledger file written by the older code, rows and all, opens without those indexes and every query
answers as it did."""

import shutil
import sqlite3

import pytest

from kilnproxy.inspector.queries import InspectorStore, cursor_of, page_query
from kilnproxy.store.inspector_tables import SQLITE_TABLES as INDEXES
from kilnproxy.store.sqlite import inspector_reader
from kilnproxy.store.sqlite.inspector_reader import FILL_ROWS, SQLiteReader
from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.store.sqlite.schema import SCHEMA
from kilnproxy.store.tenancy.sql import migrate_sqlite
from kilnproxy.usage import COLUMNS

# What the older code created on the ledger's file, as it wrote it: the ledger's time index, the inspector's two.
OLD_INDEXES = """
CREATE INDEX IF NOT EXISTS usage_events_created ON usage_events (created_at);
CREATE INDEX IF NOT EXISTS usage_events_model_created ON usage_events (model, created_at);
CREATE INDEX IF NOT EXISTS usage_events_errors_created ON usage_events (created_at) WHERE status >= 400;
"""
INSERT = f"INSERT OR REPLACE INTO usage_events ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
ORGS = ("acme", "globex", "initech")
MODELS = ("m-a", "m-b", "m-c", None)
SHAPES = [{}, {"org": "acme"}, {"model": "m-a"}, {"model": "m-c"}, {"model": "nope"}, {"status": "error"},
          {"status": "ok"}, {"status": "429"}, {"status": "200"}, {"model": "m-b", "org": "globex"},
          {"model": "m-a", "status": "error"}, {"model": "m-b", "status": "200"}, {"model": "m-a", "status": "ok"}]


def row(i: int, model_of=None) -> dict:
    values = dict.fromkeys(COLUMNS, 0)
    model = MODELS[i % 4] if model_of is None else model_of
    values.update(id=f"gen-{i:06d}", created_at=f"2026-11-30T10:{i // 60 % 60:02d}:{i % 60:02d}.{i // 7 % 2:03d}+00:00",
                  org=ORGS[i % 3], key_id=f"key-{i % 5}", model=model, endpoint="completions", stream=i % 2,
                  status=(429, 502)[i % 2] if i % 11 == 0 else 200, error_code=None, finish_reason="stop",
                  prompt_tokens=i, total_tokens=i, cost=i / 1000, requested_model=model)
    return values


def old_file(path, rows: int) -> None:
    """A ledger file as the older code left it: its table, the tenancy schema, the inspector's two indexes,
    rows (times shared by several rows, one row written twice: replaced, a new rowid)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA page_size=1024")
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(SCHEMA)
    migrate_sqlite(db)
    db.executescript(OLD_INDEXES)
    db.execute("BEGIN")
    for i in range(rows):
        db.execute(INSERT, [row(i // 2 * 2 if i % 13 == 0 else i)[c] for c in COLUMNS])
    db.execute(INSERT, [row(5)[c] for c in COLUMNS])
    db.execute("COMMIT")
    db.close()


def answers_of(path, shape: dict, limit: int) -> list[list[str]]:
    """Every page of ``shape`` as the older code read it: ``page_query``'s SQL on the file as it is."""
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    try:
        pages, before = [], None
        while True:
            sql, params = page_query(before=before, limit=limit, **shape)
            rows = [dict(r) for r in db.execute(sql, params)]
            pages.append([r["id"] for r in rows[:limit]])
            if len(rows) <= limit:
                return pages
            before = cursor_of(rows[limit - 1])
    finally:
        db.close()


async def pages_of(store: InspectorStore, shape: dict, limit: int) -> list[list[str]]:
    pages, before = [], None
    while True:
        rows, before = await store.page(limit=limit, before=before, **shape)
        pages.append([r["id"] for r in rows])
        if before is None:
            return pages


def indexes(path) -> set[str]:
    db = sqlite3.connect(path)
    try:
        return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index' "
                                         "AND tbl_name = 'usage_events'")}
    finally:
        db.close()


async def test_an_old_ledger_file_migrates_and_every_query_answers_the_same(tmp_path):
    path = tmp_path / "usage.db"
    old_file(path, 700)
    before = tmp_path / "before.db"
    shutil.copyfile(path, before)
    assert "usage_events_model_created" in indexes(path)
    expected = {(i, limit): answers_of(before, shape, limit) for i, shape in enumerate(SHAPES) for limit in (7, 50)}
    ledger = SQLiteLedger(path)
    await ledger.open()
    store = InspectorStore(SQLiteReader(path))
    await store.open()
    try:
        assert indexes(path) == {"sqlite_autoindex_usage_events_1", "usage_events_org_created",
                                 "usage_events_key_created", "usage_events_errors_created"}
        for i, shape in enumerate(SHAPES):
            for limit in (7, 50):
                assert await pages_of(store, shape, limit) == expected[(i, limit)], shape
        old = sqlite3.connect(before)
        old.row_factory = sqlite3.Row
        try:
            for i in (0, 5, 13, 699):
                want = old.execute("SELECT * FROM usage_events WHERE id = ?", (f"gen-{i:06d}",)).fetchone()
                assert await ledger.get(f"gen-{i:06d}") == (dict(want) if want else None)
                assert await store.get(f"gen-{i:06d}") == (dict(want) if want else None)
            for bucket in ("minute", "hour"):
                for shape in ({}, {"org": "acme"}, {"model": "m-b"}, {"org": "initech", "model": "m-a"}):
                    got = await store.usage(bucket, "2026-11-30T09:00:00Z", "2026-11-30T11:00:00Z", **shape)
                    store_old = InspectorStore(SQLiteReader(before))
                    await store_old.open()
                    try:
                        want = await store_old.usage(bucket, "2026-11-30T09:00:00Z", "2026-11-30T11:00:00Z", **shape)
                    finally:
                        await store_old.close()
                    assert got == want and got["series"], shape
            assert await ledger.spent_by_org() == {
                org: total for org, total in old.execute("SELECT org, SUM(cost) FROM usage_events GROUP BY org")}
        finally:
            old.close()
        # rows committed since: a model page sees them at once
        for i in range(700, 760):
            await ledger.submit(row(i))
        rows, _ = await store.page(limit=500, model="m-a")
        assert [r["id"] for r in rows] == answers_of(path, {"model": "m-a"}, 500)[0]
        assert rows[0]["id"] == "gen-000756"
    finally:
        await store.close()
        await ledger.close()


async def test_a_model_page_never_shows_an_entry_whose_rowid_another_row_took(tmp_path):
    """Rows deleted from the top of the table (another program's doing): their rowids are taken again by
    new rows of another model; the model's page shows neither the deleted rows nor the new ones."""
    path = tmp_path / "usage.db"
    ledger = SQLiteLedger(path)
    await ledger.open()
    store = InspectorStore(SQLiteReader(path))
    await store.open()
    try:
        for i in range(10):
            await ledger.submit(row(i, "m-a"))
        assert len((await store.page(limit=50, model="m-a"))[0]) == 10
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("DELETE FROM usage_events WHERE rowid > 6")
        db.close()
        for i in range(10, 14):
            await ledger.submit(row(i, "m-b"))
        by_a = [r["id"] for r in (await store.page(limit=50, model="m-a"))[0]]
        by_b = [r["id"] for r in (await store.page(limit=50, model="m-b"))[0]]
        assert by_a == answers_of(path, {"model": "m-a"}, 50)[0] and len(by_a) == 6
        assert by_b == answers_of(path, {"model": "m-b"}, 50)[0] and len(by_b) == 4
    finally:
        await store.close()
        await ledger.close()


async def test_a_model_table_far_behind_is_filled_a_part_at_a_time(tmp_path):
    path = tmp_path / "usage.db"
    old_file(path, 2 * FILL_ROWS + 10)
    ledger = SQLiteLedger(path)
    await ledger.open()
    store = InspectorStore(SQLiteReader(path))
    await store.open()
    try:
        assert await pages_of(store, {"model": "m-c"}, 500) == answers_of(path, {"model": "m-c"}, 500)
    finally:
        await store.close()
        await ledger.close()


async def test_pages_answer_while_another_program_holds_the_write_lock(tmp_path, caplog, monkeypatch):
    """The inspector's tables cannot be filled then: the usage table answers alone, the same rows."""
    monkeypatch.setattr(inspector_reader, "FILL_WAIT_MS", 1)  # each read's wait for the lock: not half a second
    path = tmp_path / "usage.db"
    old_file(path, 300)
    ledger = SQLiteLedger(path)
    await ledger.open()
    await ledger.close()
    store = InspectorStore(SQLiteReader(path))
    await store.open()
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        for shape in SHAPES:
            assert await pages_of(store, shape, 50) == answers_of(path, shape, 50), shape
        usage = await store.usage("hour", "2026-11-30T09:00:00Z", "2026-11-30T11:00:00Z")
        (count,), = holder.execute("SELECT COUNT(*) FROM usage_events").fetchall()  # every row is in that hour
        assert sum(s["requests"] for s in usage["series"]) == count
        assert [r.getMessage() for r in caplog.records if "cannot be filled" in r.getMessage()] == [
            "inspector: its own tables cannot be filled now (database is locked); reading the usage table "
            "without them"]
        holder.execute("ROLLBACK")
        assert await pages_of(store, {}, 50) == answers_of(path, {}, 50)
    finally:
        holder.close()
        await store.close()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_page_walks_an_index_newest_first(tmp_path, shape):
    path = tmp_path / "usage.db"
    old_file(path, 50)
    db = sqlite3.connect(path)
    try:
        for name in ("usage_events_created", "usage_events_model_created"):
            db.execute(f"DROP INDEX {name}")
        db.executescript(INDEXES)
        for before in (None, "MjAyNi0xMS0zMFQxMDowMDozMC4wMDArMDA6MDB-MzA"):
            sql, params = page_query(before=before, limit=50, own_tables=True, **shape)
            steps = [r[3] for r in db.execute("EXPLAIN QUERY PLAN " + sql, params)]
            plan = " | ".join(steps)
            # ``SCAN m``: the inspector's table is its primary key (WITHOUT ROWID), walked in order
            assert "TEMP B-TREE" not in plan and all("USING" in step or step == "SCAN m" for step in steps), plan
            if "model" in shape:
                assert "SEARCH m USING PRIMARY KEY (model=?" in plan, plan
            if "inspector_" in sql:
                assert "SEARCH u USING INTEGER PRIMARY KEY (rowid=?)" in plan, plan
    finally:
        db.close()
