"""Instructions the PostgreSQL store costs the gateway a request, counted by valgrind (callgrind), at a
batch width fixed by construction: a figure neither the machine nor the timing moves.

``stream_instructions.py --stores pg`` counts the whole gateway, but there a batch's width (how many
admissions or rows one round trip carries) depends on how fast PostgreSQL answers the slowed-down
process, and moves its count by about ±1 % from one run to the next. Here one process per tree
(``PYTHONPATH``) opens a ``PostgresStore`` on a fresh database of a throw-away server
(``kilnproxy.testing.postgres``) and runs rounds of ``--width`` requests at once, each as the request
path does it: ``admit`` its hold, ``submit`` its row and await its commit, ``release`` the hold. All
of a round's requests reach ``admit`` before the admitter runs, and ``submit`` before the writer
runs, so every round trip carries ``--width``. After ``--warm`` rounds the counters are zeroed, and
dumped after ``--rounds`` more; prints the user-space instructions a request (the store's Python, asyncpg's
encoding and decoding, orjson, the event loop's share; not PostgreSQL's).

    python bench/pg_store_instructions.py before=/tmp/before after=installed [--width 16] [--rounds 40]

``--inspector``: ``tell_rows`` on, as with the inspector enabled (each settlement NOTIFYs its rows' ids).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


class FakeCall:
    """What ``Hold`` reads of a request's call."""

    def __init__(self, number: int):
        self.generation_id = f"gen-0000019ad{number:07x}-{os.getpid():08x}abcdef012345"
        self.org, self.key_id, self.model, self.endpoint = "bench", "key-bench", "bench", "completions"
        self.pricing = None


async def child(url: str, spool: str, width: int, warm: int, rounds: int, inspector: bool) -> None:
    """In the process under callgrind: the rounds, the counters on for the measured ones."""
    from kilnproxy.config import load_config
    from kilnproxy.store.limits import Credits, Hold
    from kilnproxy.store.postgres.store import PostgresStore

    from run import gateway_config  # bench/: this script's folder

    toml = gateway_config(Path(spool).with_suffix(".toml"), Path(spool).with_suffix(".db"), 9,
                          {"bench": "http://127.0.0.1:9/v1"},
                          storage=f'url = "{url}"\nspool_path = "{spool}"\nreplica_timeout_seconds = 15')
    config = load_config(toml)
    store = PostgresStore(config, Credits({"bench": 1e9}, {}))
    store.tell_rows = inspector
    await store.open()
    body = {"model": "bench", "prompt": "Say hello", "max_tokens": 16}
    counter = iter(range(10**9))

    async def request() -> None:
        call = FakeCall(next(counter))
        hold = Hold(call, "2026-12-02T09:00:00.000000Z", body, 32768)
        await store.admit(hold, 100000)
        row = {"id": hold.id, "created_at": hold.created_at, "org": "bench", "key_id": "key-bench",
               "model": "bench", "endpoint": "completions", "stream": 0, "status": 200, "error_code": None,
               "prompt_tokens": 12, "completion_tokens": 16, "cached_tokens": 0, "total_tokens": 28,
               "cost": 0.0000058, "duration_ms": 1.234, "ttft_ms": None, "finish_reason": "length",
               "disconnected": 0, "requested_model": "bench"}
        committed = store.submit(row)
        store.release(hold)
        await committed

    for _ in range(warm):
        await asyncio.gather(*(request() for _ in range(width)))
    subprocess.run(["callgrind_control", "-z", str(os.getpid())], check=True, capture_output=True)
    for _ in range(rounds):
        await asyncio.gather(*(request() for _ in range(width)))
    subprocess.run(["callgrind_control", "-d", str(os.getpid())], check=True, capture_output=True)
    await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", metavar="NAME=TREE")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--inspector", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("URL", "SPOOL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(child(*args.child, args.width, args.warm, args.rounds, args.inspector))
        return
    sys.path.insert(0, str(HERE.parent))
    from kilnproxy.testing.postgres import PostgresServer

    work = Path(tempfile.mkdtemp(prefix="kilnproxy-pg-ir-"))
    os.chdir(work)
    with PostgresServer() as postgres:
        for number, (name, tree) in enumerate(v.split("=", 1) for v in args.variants):
            tree = str(HERE.parent) if tree == "installed" else str(Path(tree).resolve())
            url = postgres.create_database(f"kiln_ir_{number}")
            out = work / f"{name}.callgrind"
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                            sys.executable, str(Path(__file__).resolve()), "--child", url, str(work / f"{name}.spool"),
                            "--width", str(args.width), "--warm", str(args.warm), "--rounds", str(args.rounds)]
                           + (["--inspector"] if args.inspector else []),
                           env={**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"}, check=True,
                           stdout=subprocess.DEVNULL, stderr=open(work / f"{name}.log", "w"))
            dump = Path(f"{out}.1")  # the counters from the zeroing to the dump
            totals = int(re.search(r"^summary: (\d+)", dump.read_text(errors="replace"), re.M).group(1))
            requests = args.width * args.rounds
            print(f"{name:12s} {totals / requests:10,.0f} instructions a request ({requests} requests, "
                  f"{args.width} a round trip{', inspector on' if args.inspector else ''})", flush=True)


if __name__ == "__main__":
    main()
