"""WAL checkpoints never run inside a commit: a background checkpointer copies the WAL back, and
the WAL file stays within its bound however many commits come without a pause."""

import sqlite3

from kilnproxy.store.sqlite.checkpoint import Checkpointer
from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.usage import COLUMNS

PAGE = 4096
COMMITS = 1500  # each commit appends a few pages: far past SQLite's own 1000-page checkpoint


def row(i: int) -> dict:
    values = dict.fromkeys(COLUMNS, 0)
    values.update(id=f"gen-{i:024x}", created_at=f"2026-11-30T10:00:{i % 60:02d}.000+00:00", org="acme",
                  key_id="acme-key", model="m", endpoint="completions", error_code=None, finish_reason="stop")
    return values


async def commit_one_by_one(ledger: SQLiteLedger, n: int) -> list[int]:
    """Commit ``n`` rows one transaction each; the WAL file's size after each."""
    sizes = []
    for i in range(n):
        await ledger.submit(row(i))
        sizes.append(ledger.checkpointer.wal.stat().st_size)
    return sizes


def count_rows(path) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0]
    finally:
        db.close()


async def test_commits_run_no_checkpoint_of_their_own(tmp_path):
    """A background checkpoint only past a size never reached here: the WAL keeps every frame,
    which SQLite's own checkpoint, inside some commit, would have copied back at 1000 pages."""
    checkpointer = Checkpointer(tmp_path / "usage.db", checkpoint_bytes=1 << 40)
    ledger = SQLiteLedger(tmp_path / "usage.db", checkpointer=checkpointer)
    await ledger.open()
    try:
        sizes = await commit_one_by_one(ledger, COMMITS)
        assert checkpointer.checkpoints == 0 and checkpointer.restarts == 0
        assert sizes[-1] > 1200 * PAGE
    finally:
        await ledger.close()
    assert count_rows(tmp_path / "usage.db") == COMMITS


async def test_the_background_checkpoints_once_enough_frames_wait(tmp_path, eventually):
    """300 commits of a few pages each, a checkpoint due every 64 pages: the background copies
    them back (and only the writer's bound, never reached here, would make a commit do it)."""
    checkpointer = Checkpointer(tmp_path / "usage.db", checkpoint_bytes=64 * PAGE)
    ledger = SQLiteLedger(tmp_path / "usage.db", checkpointer=checkpointer)
    await ledger.open()
    try:
        await commit_one_by_one(ledger, 300)
        await eventually(lambda: checkpointer.checkpoints >= 1)
        assert checkpointer.last[1] >= 64  # frames copied by the last one
        assert checkpointer.restarts == 0
    finally:
        await ledger.close()
    assert count_rows(tmp_path / "usage.db") == 300


async def test_the_wal_stays_within_its_bound(tmp_path):
    """Commits without a pause and no background checkpoint at all: the writer restarts the WAL
    whenever it holds more than twice its bound, so the file never gets past that by more than
    a commit's pages."""
    bound = 32 * PAGE
    checkpointer = Checkpointer(tmp_path / "usage.db", checkpoint_bytes=1 << 40, max_wal_bytes=bound)
    ledger = SQLiteLedger(tmp_path / "usage.db", checkpointer=checkpointer)
    await ledger.open()
    try:
        sizes = await commit_one_by_one(ledger, COMMITS)
    finally:
        await ledger.close()
    assert max(sizes) <= 2 * bound + 16 * PAGE, max(sizes)
    assert checkpointer.checkpoints == 0 and checkpointer.restarts >= 10
    assert count_rows(tmp_path / "usage.db") == COMMITS


async def test_the_wal_starts_over_in_an_empty_file(tmp_path):
    """A restart empties the WAL file, and the commits after it append to new blocks: the file's size
    falls back to a commit's few pages at each restart (over a WAL started again in place, a commit
    could wait for the disk to read a page of the file the kernel had dropped)."""
    bound = 32 * PAGE
    checkpointer = Checkpointer(tmp_path / "usage.db", checkpoint_bytes=1 << 40, max_wal_bytes=bound)
    ledger = SQLiteLedger(tmp_path / "usage.db", checkpointer=checkpointer)
    await ledger.open()
    try:
        sizes = await commit_one_by_one(ledger, 300)
    finally:
        await ledger.close()
    assert checkpointer.restarts >= 3
    shrunk = [after for before, after in zip(sizes, sizes[1:]) if after < before]
    assert len(shrunk) == checkpointer.restarts, sizes
    assert max(shrunk) <= 16 * PAGE, shrunk  # the restart's own commit: a few pages
    assert count_rows(tmp_path / "usage.db") == 300
