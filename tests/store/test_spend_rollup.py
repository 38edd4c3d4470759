"""The SQLite ledger's spend rollup (``usage_daily``) in step with its rows on every way a row is written:
a ledger an older kilnproxy made gets it built from its rows when opened; the group commit's statement
(one row, many, a row written again with other values), the row journal replayed (a row there skipped),
an UPDATE and a DELETE by another program each leave it equal to a GROUP BY over the rows; the spend
statement answers what a scan of the rows answers."""

import sqlite3

from kilnproxy.store import spend
from kilnproxy.store.row_journal import RowJournal
from kilnproxy.store.sqlite.inserts import insert_sync, replay_journal
from kilnproxy.store.sqlite.schema import SCHEMA, prepare_file
from kilnproxy.usage import COLUMNS

ROLLUP = ("SELECT day, org, key_id, model, requests, prompt_tokens, completion_tokens, cached_tokens, cost_units"
          " FROM usage_daily WHERE requests <> 0 ORDER BY 1, 2, 3, 4")
BY_ROWS = ("SELECT substr(created_at, 1, 10), org, key_id, coalesce(model, ''), count(*), sum(prompt_tokens),"
           " sum(completion_tokens), sum(cached_tokens), sum(CAST(round(cost * 10000000000) AS INTEGER))"
           " FROM usage_events GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4")


def row(n: int, **extra) -> dict:
    out = dict.fromkeys(COLUMNS)
    out.update(id=f"gen-{n}", created_at=f"2026-11-{1 + n % 3:02d}T{n % 24:02d}:00:00.{n % 1000:03d}+00:00",
               org=("acme", "globex")[n % 2], key_id=f"key-{n % 3}", model=("m1", "m2", None, "")[n % 4],
               endpoint="completions", stream=0, status=200, prompt_tokens=n, completion_tokens=2 * n,
               cached_tokens=n % 5, total_tokens=3 * n, cost=round(n * 1.7e-7 + 0.1, 10), disconnected=0)
    out.update(extra)
    return out


def in_step(db: sqlite3.Connection) -> list[tuple]:
    rollup = db.execute(ROLLUP).fetchall()
    assert rollup == db.execute(BY_ROWS).fetchall()
    return rollup


def test_an_older_ledger_gets_its_rollup_from_its_rows(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(SCHEMA)  # the table as a kilnproxy before the rollup left it
    insert_sync(db, [row(n) for n in range(200)])
    db.close()
    prepare_file(path)
    db = sqlite3.connect(path, isolation_level=None)
    assert len(in_step(db)) == 12
    assert db.execute("SELECT sum(requests) FROM usage_daily").fetchone() == (200,)
    prepare_file(path)  # opened again: built once, not twice
    assert db.execute("SELECT sum(requests) FROM usage_daily").fetchone() == (200,)
    insert_sync(db, [row(n) for n in range(200, 210)])
    assert db.execute("SELECT sum(requests) FROM usage_daily").fetchone() == (210,)
    in_step(db)


def test_every_write_keeps_the_rollup_in_step(tmp_path):
    path = tmp_path / "ledger.db"
    prepare_file(path)
    db = sqlite3.connect(path, isolation_level=None)
    insert_sync(db, [row(1)])  # one row
    in_step(db)
    insert_sync(db, [row(n) for n in range(2, 150)])  # more than one INSERT's worth, one transaction
    in_step(db)
    # a row written again (a retried commit): its new values replace the old ones, counted once
    insert_sync(db, [row(5, model="m9", cost=0.25, created_at="2026-11-05T10:00:00.000+00:00"), row(150)])
    assert db.execute("SELECT count(*) FROM usage_events").fetchone() == (150,)
    assert db.execute("SELECT requests, cost_units FROM usage_daily WHERE model = 'm9'").fetchone() == (1, 2500000000)
    in_step(db)
    # the row journal replayed: a row the table has is left as it is, a new one inserted
    journal = RowJournal(path)
    journal.open()
    assert journal.append(row(7, cost=9.0)) and journal.append(row(151))
    db.close()
    assert replay_journal(path, journal.path) == 1
    db = sqlite3.connect(path, isolation_level=None)
    in_step(db)
    # another program's UPDATE (a row moved to another day, another model) and DELETE
    db.execute("UPDATE usage_events SET created_at = '2026-10-30T23:59:59.999+00:00', model = 'm3' WHERE id = 'gen-8'")
    db.execute("UPDATE usage_events SET cost = cost + 0.0000000001, prompt_tokens = 7 WHERE org = 'acme'")
    db.execute("UPDATE usage_events SET finish_reason = 'length'")  # no figure changes
    in_step(db)
    db.execute("DELETE FROM usage_events WHERE key_id = 'key-1'")
    in_step(db)
    db.execute("DELETE FROM usage_events")
    assert in_step(db) == []


def test_the_statement_answers_what_a_scan_answers(tmp_path):
    path = tmp_path / "ledger.db"
    prepare_file(path)
    db = sqlite3.connect(path, isolation_level=None)
    insert_sync(db, [row(n) for n in range(300)])
    db.row_factory = sqlite3.Row
    spans = [("2026-10-31", "2026-11-04"), ("2026-11-01T05:00:00.005", "2026-11-03T07:30"),
             ("2026-11-01T05:00:00.005", "2026-11-02"), ("2026-11-02T03:00", "2026-11-02T17:00"),
             ("2026-11-02", "2026-11-02"), ("2026-11-01T12:00+05:00", "2026-11-03T00:00:00.001Z")]
    for start, end in spans:
        for org in (None, "acme"):
            for group_by in ("", "day", "day,model", "key,org", "model,day,org,key"):
                q = spend.parse_spend({"from": start, "to": end, "group_by": group_by, **({"org": org} if org else {})},
                                      org_scoped=False)
                answers = [spend.answer_rows(q, [dict(r) for r in db.execute(*spend.statement(q, rollup))])
                           for rollup in (True, False)]
                assert answers[0] == answers[1], (start, end, org, group_by)
    assert spend.answer_rows(q, [dict(r) for r in db.execute(*spend.statement(q))])[0]["requests"] > 0
