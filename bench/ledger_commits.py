"""The ledger alone: how long a response waits for its row, one request at a time (M1's pattern).

Commits ``-n`` one-row transactions through ``SQLiteLedger``, 0.3 ms apart (a client's next
request), and prints the wait's p50, p99, p99.9, maximum and the number over 5 ms, and the
process' CPU time per row (every thread: the loop's and the ledger's). ``--in-flight N``: N
requests at once, each submitting its next row as soon as the last is committed (M2's pattern),
for the CPU per row of group commits under load. No HTTP,
so the tail it shows is the ledger's (a WAL checkpoint inside a commit, the hop to the
ledger's thread) and the machine's scheduling, not the network's.

    python bench/ledger_commits.py [-n 4000] [--in-flight 1] [--label now]
    PYTHONPATH=DIR python bench/ledger_commits.py --label before   # another checkout's ledger
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.usage import COLUMNS

GAP_SECONDS = 0.0003


def row(i: int) -> dict:
    values = dict.fromkeys(COLUMNS, 0)
    values.update(id=f"gen-{i:024x}", created_at="2026-11-30T10:00:00.000+00:00", org="acme", key_id="k",
                  model="m", endpoint="completions", error_code=None, finish_reason="stop")
    return values


async def measure(n: int, in_flight: int) -> tuple[list[float], float]:
    """The sorted waits, and the process' CPU seconds per row."""
    with tempfile.TemporaryDirectory(prefix="kilnproxy-ledger-") as folder:
        ledger = SQLiteLedger(Path(folder) / "usage.db")
        await ledger.open()
        waits = []

        async def client(first: int) -> None:
            for i in range(first, n, in_flight):
                started = time.perf_counter()
                await ledger.submit(row(i))
                waits.append(time.perf_counter() - started)
                if in_flight == 1:
                    await asyncio.sleep(GAP_SECONDS)

        cpu = time.process_time()
        try:
            await asyncio.gather(*(client(c) for c in range(in_flight)))
        finally:
            cpu = time.process_time() - cpu
            await ledger.close()
    return sorted(waits), cpu / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4000)
    parser.add_argument("--in-flight", type=int, default=1)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    waits, cpu = asyncio.run(measure(args.n, args.in_flight))

    def ms(q: float) -> float:
        return waits[min(len(waits) - 1, int(q * len(waits)))] * 1e3
    print(f"{args.label} {args.n} commits: p50 {ms(.5):.3f} ms, p99 {ms(.99):.3f}, p99.9 {ms(.999):.3f}, "
          f"max {waits[-1] * 1e3:.1f}; over 5 ms: {sum(w > 0.005 for w in waits)}; "
          f"CPU {cpu * 1e6:.0f} µs per row ({args.in_flight} in flight)")


if __name__ == "__main__":
    main()
