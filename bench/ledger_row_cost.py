"""The SQLite ledger's whole CPU per usage row, in-process: submit, commit, future resolved.

The file is laid out as a gateway leaves it (the ledger's table and indexes, the tenancy
schema's migration, the inspector's indexes), holding ``--rows`` rows already (generation ids
and times as the gateway makes them, a few orgs, keys and models, one row in 50 an error).
Then ``--in-flight`` clients each submit a row and await it, ``-n`` rows in all (M2's pattern:
several rows per loop iteration; ``--in-flight 1``: one-row commits, as most of M3's). The CPU
counted is the whole process's (the loop's commits, the writer thread, the checkpointer's copy of
the WAL into the database: ``--checkpoint-mb`` makes that come often enough to be in the figure),
per row, and the loop thread's share of it. ``--null``: the same with a ledger whose insert
stores nothing (the Python around the commit: futures, callbacks).

Trees alternated, best of ``--rounds`` (each round a fresh process per tree):

    python bench/ledger_row_cost.py before=/tmp/before after=. [--rounds 5] [--in-flight 16]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ORGS = [f"org-{i}" for i in range(7)]
KEYS = [f"key-{i}" for i in range(31)]
MODELS = [f"model-{i}" for i in range(5)]


def make_row(i: int, when: datetime, rng: random.Random, one_of_each: bool = False) -> dict:
    """Row ``i``: of one org, key and model when ``one_of_each`` (``run.py``'s and ``ab.py``'s load), else of
    7 orgs, 31 keys and 5 models in turn (every index gets rows in several places)."""
    ms = int(when.timestamp() * 1000)
    error = i % 50 == 0 and not one_of_each
    model = MODELS[0 if one_of_each else i % 5]
    return {"id": f"gen-{ms:012x}{rng.getrandbits(48):012x}", "created_at": when.isoformat(timespec="milliseconds"),
            "org": ORGS[0 if one_of_each else i % 7], "key_id": KEYS[0 if one_of_each else i % 31],
            "model": model, "endpoint": "chat/completions", "stream": i % 2, "status": 502 if error else 200,
            "error_code": "upstream_error" if error else None, "prompt_tokens": 120, "completion_tokens": 300,
            "cached_tokens": 0, "total_tokens": 420, "cost": 0.000102, "duration_ms": 812.512, "ttft_ms": None,
            "finish_reason": None if error else "stop", "disconnected": 0, "requested_model": model}


async def one_run(rows: int, n: int, in_flight: int, checkpoint_mb: int, null: bool, one_of_each: bool) -> dict:
    from kilnproxy.store.sqlite.inspector_reader import SQLiteReader
    from kilnproxy.store.sqlite.checkpoint import Checkpointer
    from kilnproxy.store.sqlite.ledger import SQLiteLedger
    from kilnproxy.store.tenancy.sql import _migrate_file

    rng = random.Random(7)
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    with tempfile.TemporaryDirectory(prefix="kilnproxy-rowcost-") as folder:
        path = Path(folder) / "usage.db"
        ledger = SQLiteLedger(path, checkpointer=Checkpointer(path, checkpoint_bytes=checkpoint_mb << 20))
        await ledger.open()
        await asyncio.to_thread(_migrate_file, path)
        reader = SQLiteReader(path)
        await reader.open()
        await reader.close()
        step = timedelta(milliseconds=50)
        for first in range(0, rows, 5000):  # the rows already there, in the writer's batches
            await asyncio.gather(*(ledger.submit(make_row(i, start + i * step, rng, one_of_each))
                                   for i in range(first, min(rows, first + 5000))))
        checkpoint = functools.partial(asyncio.get_running_loop().run_in_executor, ledger.checkpointer._thread,
                                       ledger.checkpointer._checkpoint)
        await checkpoint()  # the rows already there are in the database, not left for the measured copy
        if null:
            ledger.here._insert = lambda batch: None
        made = [make_row(i, start + i * step, rng, one_of_each) for i in range(rows, rows + n)]
        await asyncio.sleep(0.2)

        async def client(first: int) -> None:
            for i in range(first, n, in_flight):
                await ledger.submit(made[i])

        wal = Path(f"{path}-wal")
        commits = ledger.commits
        cpu, loop_cpu, wal_before = time.process_time(), time.thread_time(), wal.stat().st_size
        await asyncio.gather(*(client(c) for c in range(in_flight)))
        # what is left to copy into the database is this run's too
        await checkpoint()
        loop_cpu = time.thread_time() - loop_cpu
        cpu = time.process_time() - cpu
        commits = ledger.commits - commits
        checkpoints = ledger.checkpointer.checkpoints
        await ledger.close()
    return {"row_us": cpu / n * 1e6, "loop_us": loop_cpu / n * 1e6, "rows_per_commit": n / max(commits, 1),
            "checkpoints": checkpoints}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", metavar="NAME=TREE")
    parser.add_argument("--rows", type=int, default=50_000, help="rows in the file before the measured ones")
    parser.add_argument("-n", type=int, default=20_000, help="rows measured")
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--checkpoint-mb", type=int, default=64, help="the background checkpoint's threshold")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--null", action="store_true", help="an insert that stores nothing")
    parser.add_argument("--one-of-each", action="store_true", help="every row of one org, key and model (M2's load)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(one_run(args.rows, args.n, args.in_flight, args.checkpoint_mb, args.null,
                                                 args.one_of_each))))
        return
    trees = dict(t.split("=", 1) for t in args.trees) or {"here": str(Path(__file__).resolve().parent.parent)}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    child = [sys.executable, __file__, "--child", "--rows", str(args.rows), "-n", str(args.n), "--in-flight",
             str(args.in_flight), "--checkpoint-mb", str(args.checkpoint_mb)] + (["--null"] if args.null else []) + (
        ["--one-of-each"] if args.one_of_each else [])
    for _ in range(args.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
            results[name].append(json.loads(out.splitlines()[-1]))
    print(f"{args.n} rows, {args.in_flight} in flight, after {args.rows} rows; checkpoint every {args.checkpoint_mb} MiB"
          + ("; one org, key and model" if args.one_of_each else "") + ("; an insert that stores nothing" if args.null else ""))
    for name, runs in results.items():
        best = min(runs, key=lambda r: r["row_us"])
        each = " ".join(f"{r['row_us']:.1f}" for r in runs)
        print(f"{name:12s} best {best['row_us']:6.1f} µs a row (loop thread {best['loop_us']:.1f}); rounds "
              f"{each}; {best['rows_per_commit']:.1f} rows a commit, "
              f"{best['checkpoints']} checkpoints")


if __name__ == "__main__":
    main()
