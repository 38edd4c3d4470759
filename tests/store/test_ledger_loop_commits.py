"""Rows are committed on the event loop's thread when the file is free, and handed to the writer
thread whenever that could wait (a lock) or fsync (a WAL starting over): in order, each row once,
and the request's future resolves only once its row is committed, or for a lone row appended to
the row journal, once it is there (tests/store/test_ledger_row_journal.py)."""

import asyncio
import sqlite3
import threading

import pytest
from ledger_rows import commit, row, stored_ids

from kilnproxy.store.sqlite.loop_commits import GATHER_ROWS
from kilnproxy.store.sqlite.ledger import SQLiteLedger


@pytest.fixture
async def ledger(tmp_path):
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    await commit(ledger, row(0))  # an empty WAL: the first commit is the writer's (its header is fsynced)
    try:
        yield ledger
    finally:
        await ledger.close()


async def test_rows_of_one_loop_iteration_are_committed_together_on_the_loops_thread(ledger):
    threads = []
    # every statement traced: the INSERT and, under the same text, the spend rollup's trigger steps per row
    ledger._loop_db.set_trace_callback(lambda sql: threads.append(threading.get_ident()) if "INSERT" in sql else None)
    handed, commits = ledger.stats()["rows_handed_to_writer"], ledger.here.commits
    futures = [ledger.submit(row(i)) for i in (1, 2, 3)]
    assert futures[0].done() and not any(f.done() for f in futures[1:])  # the lone first row: journaled
    assert ledger.here.commits == commits  # committed at the flush, not in submit
    await asyncio.gather(*futures)
    assert ledger.here.commits == commits + 1 and ledger.here.rows_committed == 3
    assert threads and set(threads) == {threading.get_ident()}  # one commit (above), on this (the loop's) thread
    assert ledger.stats()["rows_handed_to_writer"] == handed
    assert stored_ids(ledger.path) == [row(i)["id"] for i in range(4)]


async def test_a_lone_row_is_committed_at_the_first_flush(ledger):
    """One request at a time: its row is committed one loop iteration after it came, not two."""
    await commit(ledger, row(1))  # the last commit: one row
    commits = ledger.here.commits
    ledger.submit(row(2))
    await asyncio.sleep(0)  # one loop iteration: the flush
    assert ledger.here.commits == commits + 1


async def test_a_busy_loop_gathers_rows_of_two_iterations_into_one_commit(ledger):
    """While the loop is busy (the last commit held more than one row), a flush that finds fewer than
    GATHER_ROWS waits one more iteration, and the rows that one brings share the commit."""
    await commit(ledger, row(1), row(2))  # the last commit: two rows
    commits = ledger.here.commits
    first = ledger.submit(row(3))
    await asyncio.sleep(0)  # the flush's first turn: it waits for the next
    assert not first.done()
    second = ledger.submit(row(4))  # a row of the next iteration
    await asyncio.gather(first, second)
    assert ledger.here.commits == commits + 1 and ledger.here.last_rows == 2
    assert stored_ids(ledger.path) == [row(i)["id"] for i in range(5)]


async def test_gathering_stops_at_gather_rows(ledger):
    """GATHER_ROWS rows waiting are committed at the first flush, busy or not."""
    await commit(ledger, row(1), row(2))
    futures = [ledger.submit(row(i)) for i in range(3, 3 + GATHER_ROWS)]
    await asyncio.sleep(0)
    assert all(f.done() for f in futures)

async def test_a_commit_on_the_loop_reads_the_wal_index_header_once(ledger, monkeypatch):
    """The checks before a commit on the loop (bound, start over, background due) share one read of
    the wal-index header, a system call; none follows the commit. A lone row has one more, before
    its journal append (whether its commit will be the loop's)."""
    await commit(ledger, row(1), row(2))  # busy: no journal
    reads = []
    sizes = ledger.checkpointer._sizes
    monkeypatch.setattr(ledger.checkpointer, "_sizes", lambda: reads.append(1) or sizes())
    commits = ledger.here.commits
    await ledger.submit(row(3))
    assert ledger.here.commits == commits + 1 and len(reads) == 1
    await ledger.submit(row(4))  # lone: journaled
    assert len(reads) == 2
    await commit(ledger, row(4))
    assert ledger.here.commits == commits + 2 and len(reads) == 3


async def test_a_lock_held_by_another_program_hands_the_rows_to_the_writer(ledger, eventually):
    """A real write lock (``BEGIN IMMEDIATE`` on another connection): the loop does not wait for it,
    the writer retries, the rows wait for their commit (but the lone first one, in the journal),
    and each is stored once, in order."""
    handed = ledger.stats()["rows_handed_to_writer"]
    holder = sqlite3.connect(ledger.path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        futures = [ledger.submit(row(i)) for i in (1, 2)]
        await eventually(lambda: ledger.commit_failures >= 1)  # the writer met the lock
        assert ledger.stats()["rows_handed_to_writer"] == handed + 2
        assert futures[0].done() and not futures[1].done()
        later = ledger.submit(row(3))  # the lock is still held: it follows the others
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    await asyncio.gather(*futures, later)
    assert stored_ids(ledger.path) == [row(i)["id"] for i in range(4)]
    loop_commits = ledger.here.commits
    await commit(ledger, row(4))  # the file is free again: back on the loop
    assert ledger.here.commits == loop_commits + 1
    assert stored_ids(ledger.path) == [row(i)["id"] for i in range(5)]


async def test_rows_submitted_while_the_writer_holds_rows_follow_them(ledger, monkeypatch):
    """Order: once a row is with the writer, later rows go there too, even with the file free."""
    release = asyncio.Event()
    commit = ledger._commit

    async def held_commit(rows):
        await release.wait()
        await commit(rows)

    ledger.rows._process = held_commit
    handed = ledger.stats()["rows_handed_to_writer"]
    monkeypatch.setattr(ledger.here, "_must_hand_off", lambda: True)
    first = ledger.submit(row(1))
    await asyncio.sleep(0)  # one loop iteration: its flush hands it to the writer
    monkeypatch.undo()
    second = ledger.submit(row(2))
    await asyncio.sleep(0)
    assert ledger.stats()["rows_handed_to_writer"] == handed + 2  # not committed on the loop ahead of the first
    assert not first.done() and not second.done()
    release.set()
    await asyncio.gather(first, second)
    assert stored_ids(ledger.path) == [row(i)["id"] for i in range(3)]


async def test_the_commit_that_would_start_the_wal_over_is_the_writers(ledger):
    """Every frame copied back: the next commit writes the WAL's header again, and SQLite fsyncs it."""
    await commit(ledger, row(1))
    handed = ledger.stats()["rows_handed_to_writer"]
    other = sqlite3.connect(ledger.path, isolation_level=None)
    try:
        (busy, frames, copied), = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    finally:
        other.close()
    assert busy == 0 and frames == copied > 0
    await ledger.submit(row(2))  # not journaled: the writer's commit
    assert ledger.stats()["rows_handed_to_writer"] == handed + 1
    commits = ledger.here.commits
    await commit(ledger, row(3))  # the WAL has frames to copy again: on the loop
    assert ledger.here.commits == commits + 1
    assert stored_ids(ledger.path) == [row(i)["id"] for i in range(4)]


async def test_close_commits_rows_submitted_in_the_same_iteration(tmp_path):
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    futures = [ledger.submit(row(i)) for i in range(3)]
    await ledger.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert stored_ids(tmp_path / "usage.db") == [row(i)["id"] for i in range(3)]
