"""What the spend rollup's triggers cost the SQLite ledger's commit: CPU per row, with and without them.

    PYTHONPATH=. python bench/spend_rollup_cost.py [--rounds 5] [-n 40000]

A file as ``prepare_file`` makes it (the rollup and its triggers), or the same with the three triggers
dropped, holding 50,000 rows; then ``-n`` rows committed by ``insert_sync`` on the loop's own connection
(``connect_for_the_loop``), one row a commit and 16 a commit, as the gateway's group commit makes them
(7 orgs, 31 keys, 5 models in turn). The process's CPU time per row, best and median of ``--rounds``,
the two files alternated.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from kilnproxy.store.sqlite.inserts import insert_sync
from kilnproxy.store.sqlite.schema import connect_for_the_loop, prepare_file
from kilnproxy.usage import COLUMNS

TRIGGERS = ("usage_daily_insert", "usage_daily_delete", "usage_daily_update")


def row(i: int) -> dict:
    out = dict.fromkeys(COLUMNS)
    out.update(id=f"gen-{i:012d}", created_at=f"2026-12-06T{(i // 60000) % 24:02d}:{(i // 1000) % 60:02d}:"
                                              f"{(i // 10) % 60:02d}.{i % 1000:03d}+00:00",
               org=f"org-{i % 7}", key_id=f"key-{i % 31}", model=f"model-{i % 5}", endpoint="completions", stream=1,
               status=200, prompt_tokens=12, completion_tokens=30, cached_tokens=0, total_tokens=42, cost=1.3e-05,
               duration_ms=12.5, ttft_ms=2.0, finish_reason="stop", disconnected=0)
    return out


def cpu_per_row(triggers: bool, batch: int, n: int, before: int = 50_000) -> float:
    path = Path(tempfile.mkdtemp(prefix="kiln-rollup-cost-")) / "ledger.db"
    prepare_file(path)
    if not triggers:
        db = sqlite3.connect(path, isolation_level=None)
        for name in TRIGGERS:
            db.execute(f"DROP TRIGGER {name}")
        db.close()
    db = connect_for_the_loop(path)
    insert_sync(db, [row(i) for i in range(before)])
    rows = [row(i) for i in range(before, before + n)]
    start = time.process_time()
    for first in range(0, n, batch):
        insert_sync(db, rows[first:first + batch])
    spent = time.process_time() - start
    db.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return spent / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-n", type=int, default=40_000)
    args = parser.parse_args()
    for batch in (1, 16):
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for triggers in (False, True):
                runs[triggers].append(cpu_per_row(triggers, batch, args.n))
        print(f"{batch:2d} rows a commit: without the triggers {min(runs[False]):.1f} µs a row (median "
              f"{statistics.median(runs[False]):.1f}), with them {min(runs[True]):.1f} "
              f"(median {statistics.median(runs[True]):.1f})")


if __name__ == "__main__":
    main()
