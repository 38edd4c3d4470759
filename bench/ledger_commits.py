"""The ledger alone: how long a response waits for its row, one request at a time (M1's pattern).

Commits ``-n`` one-row transactions through ``SQLiteLedger``, 0.3 ms apart (a client's next
request), and prints the wait's p50, p99, p99.9, maximum and the number over 5 ms. No HTTP,
so the tail it shows is the ledger's (a WAL checkpoint inside a commit, the hop to the
ledger's thread) and the machine's scheduling, not the network's.

    python bench/ledger_commits.py [-n 4000] [--label now]
    PYTHONPATH=DIR python bench/ledger_commits.py --label before   # another checkout's ledger
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from kilnproxy.store.sqlite import SQLiteLedger
from kilnproxy.usage import COLUMNS

GAP_SECONDS = 0.0003


def row(i: int) -> dict:
    values = dict.fromkeys(COLUMNS, 0)
    values.update(id=f"gen-{i:024x}", created_at="2026-11-30T10:00:00.000+00:00", org="acme", key_id="k",
                  model="m", endpoint="completions", error_code=None, finish_reason="stop")
    return values


async def measure(n: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="kilnproxy-ledger-") as folder:
        ledger = SQLiteLedger(Path(folder) / "usage.db")
        await ledger.open()
        waits = []
        try:
            for i in range(n):
                started = time.perf_counter()
                await ledger.submit(row(i))
                waits.append(time.perf_counter() - started)
                await asyncio.sleep(GAP_SECONDS)
        finally:
            await ledger.close()
    return sorted(waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4000)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    waits = asyncio.run(measure(args.n))

    def ms(q: float) -> float:
        return waits[min(len(waits) - 1, int(q * len(waits)))] * 1e3
    print(f"{args.label} {args.n} commits: p50 {ms(.5):.3f} ms, p99 {ms(.99):.3f}, p99.9 {ms(.999):.3f}, "
          f"max {waits[-1] * 1e3:.1f}; over 5 ms: {sum(w > 0.005 for w in waits)}")


if __name__ == "__main__":
    main()
