"""What one usage row's commit writes and costs, for candidate layouts of the SQLite ledger.

Each layout is a fresh file (its page size, the usage table, its indexes) holding ``--rows``
rows already (ids growing with time as generation ids do, a few orgs, keys and models, one row
in 50 an error), in WAL mode with ``synchronous=NORMAL`` and no automatic checkpoint, as the
ledger writes it. Then ``-n`` one-row commits on the calling thread; printed per layout: WAL
bytes appended per row and CPU µs per commit (the thread's CPU time: the cost on the event loop).

    PYTHONPATH=. python bench/ledger_layout.py [--rows 200000] [-n 3000]
"""

import argparse
import os
import sqlite3
import tempfile
import time
from pathlib import Path

from kilnproxy.store.sqlite.inserts import INSERT
from kilnproxy.store.sqlite.schema import SCHEMA
from kilnproxy.usage import COLUMNS

TABLE = SCHEMA.split("CREATE INDEX")[0]
PK = "the id's primary key"
INDEXES = {  # name -> (reads that use it, DDL)
    "org_created": ("usage reads by org (CLI, inspector)", "CREATE INDEX i1 ON usage_events (org, created_at)"),
    "created": ("inspector pages, usage buckets", "CREATE INDEX i2 ON usage_events (created_at)"),
    "key_created": ("key limits' usage", "CREATE INDEX i3 ON usage_events (key_id, created_at)"),
    "model_created": ("inspector's model filter", "CREATE INDEX i4 ON usage_events (model, created_at)"),
    "errors_created": ("inspector's error pages (errors only)",
                       "CREATE INDEX i5 ON usage_events (created_at) WHERE status >= 400"),
}
TODAY = ("org_created", "created", "key_created", "model_created", "errors_created")
LAYOUTS = [  # (page size, indexes besides the primary key)
    (4096, TODAY),
    (1024, TODAY),
    (4096, ("org_created", "created", "key_created")),
    (1024, ("org_created", "created", "key_created")),
    (1024, ("org_created", "key_created")),
    (1024, ("key_created",)),
    (1024, ()),
]


def row(i: int) -> tuple:
    values = dict.fromkeys(COLUMNS, 0)
    seconds = 1_764_500_000 + i // 20  # 20 requests a second
    values.update(id=f"gen-{seconds * 1000 + i % 1000:012x}{i:012x}",
                  created_at=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{i % 1000:03d}+00:00",
                  org=f"org-{i % 7}", key_id=f"key-{i % 31}", model=f"model-{i % 5}", endpoint="chat/completions",
                  stream=i % 2, status=500 if i % 50 == 0 else 200, error_code=None, prompt_tokens=120,
                  completion_tokens=300, total_tokens=420, cost=0.00042, duration_ms=812.5, ttft_ms=40.1,
                  finish_reason="stop", requested_model=f"model-{i % 5}")
    return tuple(values[c] for c in COLUMNS)


def measure(folder: Path, page: int, indexes: tuple[str, ...], rows: int, n: int) -> tuple[float, float]:
    path = folder / f"layout-{page}-{len(indexes)}.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute(f"PRAGMA page_size={page}")
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(TABLE)
    for name in indexes:
        db.execute(INDEXES[name][1])
    db.execute("BEGIN")
    db.executemany(INSERT, (row(i) for i in range(rows)))
    db.execute("COMMIT")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute(INSERT, row(rows))  # the WAL's header; the measured commits append to it
    wal = Path(f"{path}-wal")
    before, cpu = wal.stat().st_size, time.thread_time()
    for i in range(rows + 1, rows + 1 + n):
        db.execute(INSERT, row(i))
    cpu = time.thread_time() - cpu
    written = wal.stat().st_size - before
    db.close()
    os.unlink(path)
    return written / n, cpu / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows in the table before the commits")
    parser.add_argument("-n", type=int, default=3000, help="one-row commits measured")
    args = parser.parse_args()
    print(f"{args.n} one-row commits after {args.rows} rows; every layout has {PK}\n")
    print("| page size | indexes besides the primary key | WAL bytes per row | CPU µs per commit |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kilnproxy-layout-") as folder:
        for page, indexes in LAYOUTS:
            wal, cpu = measure(Path(folder), page, indexes, args.rows, args.n)
            print(f"| {page} | {', '.join(indexes) or 'none'} | {wal:,.0f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
