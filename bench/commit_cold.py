"""What a usage row's commit costs when the caches are cold, as they are after a request's own work.

One-row commits on the ledger's loop connection (``connect_for_the_loop``, a file made by
``prepare_file``: WAL, ``synchronous=NORMAL``), and for comparison the same row appended to a
plain file as one JSON line (``os.write``), each after touching ``--mib`` MiB of memory (one
byte a cache line), as a request that ran in between would. Prints the thread's CPU time a
commit, median of ``-n``, per size.

    PYTHONPATH=. python bench/commit_cold.py [--mib 0,1,4,16] [-n 3000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import orjson

from kilnproxy.store.sqlite.inserts import insert_sync as _insert_sync
from kilnproxy.store.sqlite.schema import connect_for_the_loop, prepare_file


def row(i: int) -> dict:
    """M2's row, in the ledger's column order."""
    return {"id": f"gen-{i:024x}", "created_at": "2026-12-02T13:00:00.000000Z", "org": "bench", "key_id": "k1",
            "model": "bench", "endpoint": "/v1/completions", "stream": 0, "status": 200, "error_code": None,
            "prompt_tokens": 12, "completion_tokens": 64, "cached_tokens": 0, "total_tokens": 76,
            "cost": 0.0000204, "duration_ms": 0.4, "ttft_ms": None, "finish_reason": "length", "disconnected": 0,
            "requested_model": "bench"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="0,1,4,16", help="memory touched before each commit, MiB (comma-separated)")
    parser.add_argument("-n", type=int, default=3000)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kilnproxy-commit-cold-"))
    db_path = folder / "usage.db"
    prepare_file(db_path)
    db = connect_for_the_loop(db_path)
    journal = os.open(folder / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    ids = iter(range(10**9))
    commits = {"SQLite one-row commit": lambda: _insert_sync(db, [row(next(ids))]),
               "one JSON line appended": lambda: os.write(journal, orjson.dumps(list(row(next(ids)).values())) + b"\n")}
    for mib in (int(m) for m in args.mib.split(",")):
        junk = bytearray(mib << 20)
        times: dict[str, list[float]] = {name: [] for name in commits}
        for _ in range(args.n):
            for name, commit in commits.items():
                for at in range(0, len(junk), 64):
                    junk[at] = (junk[at] + 1) & 255
                started = time.thread_time()
                commit()
                times[name].append(time.thread_time() - started)
        print(f"{mib:3d} MiB touched before each: "
              + "; ".join(f"{name} {statistics.median(t) * 1e6:.1f} µs" for name, t in times.items()), flush=True)
    db.close()
    os.close(journal)


if __name__ == "__main__":
    main()
