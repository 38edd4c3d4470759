"""The row journal (``kilnproxy.store.row_journal``): a lone row's response ends once its JSON line is
appended to ``<database>-rows``; the loop commits it to SQLite next; a gateway killed between the two
inserts it at its next start; a journal that cannot be written leaves rows waiting for their commits."""

import asyncio
import logging
import os
import signal
import sqlite3
from pathlib import Path

import aiohttp
import orjson
import pytest
from ledger_rows import commit, row, stored_ids
from processes import GatewayProcess, gateway_config

from kilnproxy.store import row_journal
from kilnproxy.store.sqlite import ledger as sqlite_ledger
from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.testing import KEY, MODEL, completion_body
from kilnproxy.web.server import start_mock


def journal_lines(ledger: SQLiteLedger) -> list[dict]:
    return [orjson.loads(line) for line in ledger.journal.path.read_bytes().splitlines()]


@pytest.fixture
async def ledger(tmp_path):
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    await commit(ledger, row(0))  # an empty WAL: the first commit is the writer's, not journaled
    try:
        yield ledger
    finally:
        await ledger.close()


async def test_a_lone_row_is_answered_at_its_append_and_committed_at_the_next_iteration(ledger):
    assert journal_lines(ledger) == []
    future = ledger.submit(row(1))
    assert future.done()  # before any commit: its line is in the file
    assert journal_lines(ledger) == [row(1)]
    assert stored_ids(ledger.path) == [row(0)["id"]]
    await asyncio.sleep(0)  # one loop iteration: the flush
    assert stored_ids(ledger.path) == [row(0)["id"], row(1)["id"]]
    assert ledger.journal.uncommitted == 0 and not ledger.here.journaled


async def test_rows_of_a_busy_loop_wait_for_their_commit_and_are_not_journaled(ledger):
    await commit(ledger, row(1), row(2))  # the last commit held two rows: the loop is busy
    size = ledger.journal.size
    future = ledger.submit(row(3))
    assert not future.done()
    await future
    assert ledger.journal.size == size and row(3)["id"] in stored_ids(ledger.path)


async def test_the_first_commit_is_the_writers_and_its_row_waits_for_it(tmp_path):
    """A commit that would fsync (the WAL's first frame) is the writer's: its row is not journaled, so
    that a response never ends with its row only in the journal while the file is slow to take it."""
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    try:
        future = ledger.submit(row(0))
        assert not future.done()
        await future
        assert stored_ids(ledger.path) == [row(0)["id"]] and journal_lines(ledger) == []
    finally:
        await ledger.close()


async def test_a_lookup_of_a_journaled_row_waits_for_its_commit(ledger, eventually):
    """Another program holds the file's write lock: the lone row is answered from the journal, its commit
    goes to the writer and waits; a lookup of its id answers once it is committed, with the row."""
    holder = sqlite3.connect(ledger.path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        assert ledger.submit(row(1)).done()
        await eventually(lambda: ledger.commit_failures >= 1)
        lookup = asyncio.ensure_future(ledger.get(row(1)["id"]))
        failures = ledger.commit_failures
        await eventually(lambda: ledger.commit_failures > failures)  # the writer tried again: still locked
        assert not lookup.done()
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    assert (await lookup)["id"] == row(1)["id"]
    assert ledger.journal.uncommitted == 0


async def test_a_journal_that_cannot_be_written_leaves_the_row_waiting_for_its_commit(ledger, caplog):
    """A full disk (``/dev/full``): the append fails, the row waits for its commit as before the journal,
    the log says so once, and once every row is committed the journal is made anew at its own path."""
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, ledger.journal._fd)
    os.close(full)
    with caplog.at_level(logging.ERROR, "kilnproxy.ledger"):
        first = ledger.submit(row(1))
        assert not first.done()
        await first
        await commit(ledger, row(2))
    assert [r.message for r in caplog.records if "No space left" in r.message] != []
    assert len([r for r in caplog.records if "No space left" in r.message]) == 1
    assert stored_ids(ledger.path) == [row(i)["id"] for i in range(3)]
    assert not ledger.journal.usable
    ledger.journal.check()  # the half-second check
    assert ledger.journal.usable
    assert ledger.submit(row(3)).done() and journal_lines(ledger) == [row(3)]


async def test_a_value_json_cannot_hold_is_not_journaled(ledger):
    odd = {**row(1), "prompt_tokens": 2**64}
    future = ledger.submit(odd)
    assert not future.done()
    await future
    assert ledger.journal.usable and journal_lines(ledger) == []


async def test_a_journal_deleted_under_the_gateway_is_made_anew(ledger):
    await commit(ledger, row(1))
    ledger.journal.path.unlink()
    ledger.journal.check()
    assert ledger.journal.path.exists()
    assert ledger.submit(row(2)).done() and journal_lines(ledger) == [row(2)]


async def test_the_journal_is_emptied_once_large_and_committed(ledger, monkeypatch):
    monkeypatch.setattr(row_journal, "EMPTY_AT_BYTES", 1)
    ledger.submit(row(1))
    assert journal_lines(ledger) == [row(1)]
    await asyncio.sleep(0)
    assert journal_lines(ledger) == []
    assert ledger.submit(row(2)).done() and journal_lines(ledger) == [row(2)]


async def test_a_clean_stop_removes_the_journal(tmp_path):
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    await commit(ledger, row(0))
    ledger.submit(row(1))
    await ledger.close()
    assert not ledger.journal.path.exists()
    assert stored_ids(ledger.path) == [row(0)["id"], row(1)["id"]]


async def test_the_next_start_inserts_the_rows_the_table_lacks(tmp_path, caplog):
    """A journal left behind: a row the table lacks is inserted, a row it has is left as it is, a line
    cut short is said in the log; the file is emptied."""
    path = tmp_path / "usage.db"
    ledger = SQLiteLedger(path)
    await ledger.open()
    await commit(ledger, row(0))
    await ledger.close()
    lines = [orjson.dumps({**row(0), "cost": 9.0}), orjson.dumps(row(1)), orjson.dumps(row(2))[:40]]
    row_journal.journal_path(path).write_bytes(b"\n".join(lines))
    ledger = SQLiteLedger(path)
    with caplog.at_level(logging.WARNING, "kilnproxy.ledger"):
        await ledger.open()
    try:
        assert stored_ids(path) == [row(0)["id"], row(1)["id"]]
        assert await ledger.get(row(0)["id"]) == row(0)  # not replaced
        assert journal_lines(ledger) == []
        messages = " ".join(r.message for r in caplog.records)
        assert "1 usage rows" in messages and "is not a usage row" in messages
    finally:
        await ledger.close()


async def test_kill_9_after_a_response_whose_commit_waits_loses_no_row(tmp_path):
    """A real gateway process: another program holds the file's write lock, a lone request's response
    ends (its row in the journal only), the gateway is killed; the next start has the row."""
    mock = await start_mock()
    gateway = GatewayProcess(tmp_path, gateway_config([f"{mock.url}/v1"]))
    await gateway.start()
    db = tmp_path / "usage.db"
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
            async def complete(url: str) -> str:
                async with session.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}) as resp:
                    assert resp.status == 200
                    await resp.read()
                    return resp.headers["X-Neocloud-Generation-Id"]

            for _ in range(2):  # the first commit is the writer's; the second one's row is journaled
                last = await complete(gateway.url)
            async with session.get(f"{gateway.url}/v1/generations/{last}") as resp:
                assert resp.status == 200  # answered once the row is committed: the file is free again
            holder = sqlite3.connect(db, isolation_level=None)
            try:
                holder.execute("BEGIN IMMEDIATE")
                generation = await asyncio.wait_for(complete(gateway.url), 10)  # not held by the lock
                await gateway.wait_for("stderr", "cannot commit")
                gateway.send(signal.SIGKILL)
                await gateway.wait()
                assert generation in (tmp_path / "usage.db-rows").read_text()
            finally:
                holder.close()
            assert generation not in {r["id"] for r in gateway.rows()}
            restarted = GatewayProcess(tmp_path, gateway_config([f"{mock.url}/v1"]))
            await restarted.start()
            try:
                assert generation in {r["id"] for r in restarted.rows()}
                await restarted.wait_for("stderr", "1 usage rows of responses that ended")
            finally:
                await restarted.stop()
    finally:
        await gateway.stop()
        await mock.stop()


async def test_the_journal_has_the_databases_permissions(tmp_path):
    path = tmp_path / "usage.db"
    ledger = SQLiteLedger(path)
    await ledger.open()
    await ledger.close()
    path.chmod(0o600)
    ledger = SQLiteLedger(path)
    await ledger.open()
    try:
        assert ledger.journal.path.stat().st_mode & 0o777 == 0o600
    finally:
        await ledger.close()


def test_a_journal_another_gateway_has_open_is_neither_emptied_nor_used(tmp_path, caplog):
    """Two gateways given one file (two replicas on one spool path): the second's journal is unusable,
    said once, and the first's rows stay in the file; once the first is gone, the second takes it."""
    database = tmp_path / "spool.db"
    database.touch()
    first, second = row_journal.RowJournal(database), row_journal.RowJournal(database)
    first.open()
    assert first.append(row(1))
    with caplog.at_level(logging.ERROR, "kilnproxy.ledger"):
        second.open()
        second.check()
    assert not second.usable and not second.append(row(2))
    assert [r.message for r in caplog.records if "another gateway has it open" in r.message] != []
    assert len([r for r in caplog.records if "another gateway has it open" in r.message]) == 1
    assert [orjson.loads(line) for line in first.path.read_bytes().splitlines()] == [row(1)]
    first.committed(1)
    first.close()
    second.check()
    assert second.usable and second.append(row(2))
    second.committed(1)
    second.close()


async def test_only_the_row_of_a_request_in_progress_alone_is_journaled(harness):
    """A gateway: the row of a request served while no other is in progress goes to the row journal; while
    a stream is still open, a request's row waits for its commit instead (under load rows share commits)."""
    async with harness() as h:
        journal = Path(f"{h.db}-rows")

        async def complete() -> str:
            async with h.post("/v1/completions", completion_body()) as resp:
                assert resp.status == 200
                await resp.read()
                return resp.headers["X-Neocloud-Generation-Id"]

        await complete()  # the first commit is the writer's
        alone = await complete()
        assert alone.encode() in journal.read_bytes()
        async with h.post("/v1/completions", completion_body(stream=True, max_tokens=4, mock={"delay": 0.05})) as slow:
            assert slow.status == 200
            await slow.content.readline()
            beside = await complete()
            assert beside.encode() not in journal.read_bytes()
            await slow.read()
        assert {r["id"] for r in await h.rows()} >= {alone, beside}


async def test_a_stop_that_gives_up_rows_keeps_the_journal_for_the_next_start(tmp_path, monkeypatch, eventually):
    """Another program holds the write lock through a stop: the journaled row is given up (logged as not
    committed) and stays in the file, and the next start inserts it."""
    monkeypatch.setattr(sqlite_ledger, "LAST_TRY_SECONDS", 0.1)
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    await commit(ledger, row(0))
    holder = sqlite3.connect(ledger.path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        assert ledger.submit(row(1)).done()
        await eventually(lambda: ledger.commit_failures >= 1)
        await ledger.close()
        assert [r["id"] for r in ledger.not_committed] == [row(1)["id"]]
        assert journal_lines(ledger) == [row(1)]
    finally:
        holder.close()
    again = SQLiteLedger(ledger.path)
    await again.open()
    try:
        assert row(1)["id"] in stored_ids(ledger.path)
    finally:
        await again.close()
