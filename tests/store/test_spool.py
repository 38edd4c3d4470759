"""The spool (``kilnproxy.store.postgres.spool``): usage rows kept on disk while PostgreSQL is out of reach."""

from __future__ import annotations

import threading

from kilnproxy.store.postgres.spool import Spool
from kilnproxy.usage import COLUMNS


def row(i: int) -> dict:
    return {**dict.fromkeys(COLUMNS), "id": f"gen-{i:08d}", "created_at": "2026-12-01T21:00:00.000+00:00",
            "org": "acme", "key_id": "k", "endpoint": "completions", "stream": 0, "status": 200,
            "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0, "total_tokens": 2, "cost": 0.5,
            "disconnected": 0}


def test_rows_added_while_others_are_taken_and_removed_are_all_kept(tmp_path):
    """The store's writer adds rows (in one thread) while its heartbeat flushes the spool (in another):
    both used one SQLite connection, so a BEGIN of one inside the other's transaction failed ("cannot
    start a transaction within a transaction"), and the failed side's rollback undid the other's
    rows, which it then took for kept: rows lost. Every row added is now either removed by the
    flush or still in the spool."""
    spool = Spool(tmp_path / "spool.db")
    assert spool.open() == 0
    added, removed, errors = [], [], []
    done = threading.Event()

    def writer():
        try:
            for start in range(0, 4000, 8):
                rows = [row(i) for i in range(start, start + 8)]
                spool.add(rows)
                added.extend(r["id"] for r in rows)
        except Exception as exc:
            errors.append(exc)
        finally:
            done.set()

    def flusher():
        try:
            while not done.is_set() or spool.count():
                ids = [r["id"] for r in spool.take(50)]
                spool.remove(ids)
                removed.extend(ids)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=flusher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(added) == 4000
    assert sorted(removed) == sorted(added)  # each row flushed once; none lost
    assert spool.count() == 0
    spool.close()
