"""M7's second part, fair queues (SPEC 14): one org floods an upstream's slots, another sends one stream at a time.

On M7's gateway and its upstream of ``SLOTS`` slots: ``QUEUE_CLIENTS`` clients of org ``bench`` keep the
queue full (a closed loop; streams of four lengths about M4's) while one client sends streams one after the other, first with a key of org
``other`` (two orgs waiting: the fair queues' weighted round robin), then with another key of org ``bench``
(one org: its queue is first come, first served, the order every request had before fair queues). The
second client's time in queue (its time to first byte minus the median of M7's unqueued run) is set beside
one slot turn per org waiting: 2 × (an unqueued stream's total time, p50) / ``SLOTS``; and, from the gateway's
usage rows, the slots granted to the flood while each of its requests waited (a request's start at the
upstream: its row's ``created_at`` + ``ttft_ms``, the same offset for every row).
"""

from __future__ import annotations

import datetime
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson

from loads import LoadError, stream_latency
from report import spread, table

HERE = Path(__file__).resolve().parent
OTHER_KEY = "sk-bench-other"  # org "other"
SAME_ORG_KEY = "sk-bench-flood-2"  # org "bench", as the flood's: the FCFS order
SECTIONS = f"""
[[orgs]]
id = "other"
credits = 1000000000.0

[[keys]]
key = "{OTHER_KEY}"
org = "other"
id = "other-key"

[[keys]]
key = "{SAME_ORG_KEY}"
org = "bench"
id = "flood-2"
"""
KEY_IDS = {"two": "other-key", "one": "flood-2"}
FAIR, FCFS = "two orgs (fair queues)", "one org (first come, first served)"
# The flood's streams in 4 lengths about M4's 64 chunks (a quarter of its clients each): streams of one length
# started together end together, and would free the slots in bursts a whole stream apart
FLOOD_CHUNKS = (40, 56, 72, 88)
STREAMS = {FAIR: 150, FCFS: 12}  # the other client's streams; FCFS's each wait for the whole queue


def queued(gw: str, upstream: str) -> tuple[float, float]:
    """The gateway's requests queued for ``upstream`` (host:port) and its slots busy, from /metrics."""
    with urllib.request.urlopen(f"{gw}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = []
    for name in ("kilnproxy_upstream_queued_requests", "kilnproxy_upstream_slots_busy"):
        found = re.findall(rf"^{name}{{[^}}]*{re.escape(upstream)}[^}}]*}} (\S+)$", text, re.MULTILINE)
        out.append(float(found[0]) if found else 0.0)
    return out[0], out[1]


def wait_for(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise LoadError(f"M7 fair queues: {what} not reached in {timeout:g} s")
        time.sleep(0.05)


def overtaken(db: Path, since: str, key_id: str, n: int) -> list[int]:
    """For each of the ``n`` requests of ``key_id`` since ``since`` (ISO time), how many other requests started
    at the upstream between its arrival and its own start (from the usage rows in the SQLite file ``db``)."""
    def read():
        conn = sqlite3.connect(db)
        try:
            return conn.execute("SELECT key_id, created_at, ttft_ms FROM usage_events WHERE created_at >= ? "
                                "AND ttft_ms IS NOT NULL", (since,)).fetchall()
        finally:
            conn.close()
    wait_for(lambda: sum(1 for r in read() if r[0] == key_id) >= n, "the rows of the other client")
    at = {}
    for key, created, ttft in read():
        start = datetime.datetime.fromisoformat(created).timestamp() * 1000
        at.setdefault(key == key_id, []).append((start, start + ttft))
    others = sorted(s for _, s in at.get(False, []))
    return [sum(1 for s in others if arrived < s < started) for arrived, started in at[True]]


def one_mode(gw: str, upstream: str, body: bytes, flood_key: str, key: str, n: int, clients: int, slots: int) -> dict:
    """The other client's ``n`` streams (``key``) while ``clients`` streams of ``flood_key`` keep the queue full."""
    url = f"{gw}/v1/completions"
    floods = [subprocess.Popen([sys.executable, str(HERE / "clients.py"), "latency", "--url", url, "--body",
                                orjson.dumps({**orjson.loads(body), "max_tokens": chunks}).decode(), "--key",
                                flood_key, "-n", "5000", "--concurrency", str(clients // len(FLOOD_CHUNKS))],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for chunks in FLOOD_CHUNKS]
    try:
        wait_for(lambda: queued(gw, upstream)[0] >= clients - slots - 2, "the flood's queue")
        out = stream_latency(url, body, key, n, 1)
    finally:
        for flood in floods:
            flood.terminate()
        for flood in floods:
            flood.wait(timeout=30)
    wait_for(lambda: queued(gw, upstream) == (0.0, 0.0), "an empty queue after the flood")
    return out


def measure(bench, gw: str, db: Path, upstream: str, body: bytes, clients: int, slots: int, base_ttfb: float,
            total_p50: float, base_p99: float) -> None:
    """Appends the section and the goal to ``bench`` (M7's gateway ``gw``, ``upstream`` its slotted mock's
    host:port; ``base_ttfb``, ``total_p50`` and ``base_p99``: M7's unqueued time to first byte, median, its
    total time, p50, and its time to first byte, p99)."""
    res, ahead = {}, {}
    for mode, key, key_id in ((FAIR, OTHER_KEY, KEY_IDS["two"]), (FCFS, SAME_ORG_KEY, KEY_IDS["one"])):
        since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        res[mode] = one_mode(gw, upstream, body, bench.key, key, STREAMS[mode], clients, slots)
        ahead[mode] = sorted(overtaken(db, since, key_id, STREAMS[mode]))
    turn = total_p50 / slots
    bound = 2 * turn
    waits = {mode: sorted(t - base_ttfb for t in r["ttfb_ms"]) for mode, r in res.items()}

    def pct(values, p):
        return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]

    rows = [[mode, str(len(w)), f"{pct(w, 50):.0f}", f"{pct(w, 90):.0f}", f"{pct(w, 99):.0f}", f"{max(w):.0f}",
             f"{pct(w, 99) / bound:.2f}", f"{pct(ahead[mode], 50)}; {pct(ahead[mode], 99)}; {max(ahead[mode])}"]
            for mode, w in waits.items()]
    bench.sections.append(
        f"## M7 fair queues: {clients} clients of one org flooding {slots} slots, another org's streams one at a "
        "time\n\n" + table(["the other client's key", "streams", "time in queue p50 ms", "p90 ms", "p99 ms",
                            "max ms", "p99 / (2 slot turns)", "slots granted to others while it waited: p50; p99; max"],
                           rows)
        + f"\n\nOn M7's gateway and upstream ({slots} slots, `queue_timeout = 600`), right after its rounds: "
        f"{clients} clients of org `bench` keep its queue full (about {clients - slots} waiting; a quarter each "
        f"with streams of {', '.join(map(str, FLOOD_CHUNKS))} chunks, so that the slots do not free in bursts) "
        "while one client sends streams (M4's, 64 chunks) one after the other, with a key of another org (*two orgs*), then with another key of "
        "org `bench` (*one org*: its own queue is first come, first served, the order before fair queues). "
        "*time in queue*: the stream's time to first byte minus the median of M7's unqueued run "
        f"({base_ttfb:.1f} ms). One slot turn = an unqueued stream's total time (p50, {total_p50:.0f} ms) / "
        f"{slots} slots = {turn:.0f} ms; with two orgs waiting the bound is two turns, {bound:.0f} ms. "
        f"The flood's {clients - slots} requests ahead take about ({clients} − {slots}) / {slots} × "
        f"{total_p50:.0f} ms = {(clients - slots) / slots * total_p50:.0f} ms to drain. The unqueued run's own "
        f"time to first byte, p99 (median of its rounds): {base_p99:.0f} ms, what the machine adds without a queue. *slots granted to others while it waited*: "
        "requests of the other key that started at the upstream between the request's arrival and its own start "
        "(the gateway's usage rows: `created_at` + `ttft_ms`, to the millisecond): the queue's order itself, "
        "which the machine's noise does not move; with two orgs waiting, one slot turn per org is at most 1.")
    fair99 = pct(waits[FAIR], 99)
    bench.goal("M7", "fair queues: the other org's time in queue p99 ≤ one slot turn per org waiting "
               f"(2 × {turn:.0f} ms); first come, first served: its p99",
               f"{fair99:.0f} ms; {pct(waits[FCFS], 99):.0f} ms", fair99 <= bound)
    bench.goal("M7", "fair queues: slots granted to the flooding org while the other org's request waited, "
               "at most (one turn per org waiting: ≤ 1); first come, first served: the same",
               f"{max(ahead[FAIR])}; {max(ahead[FCFS])}", max(ahead[FAIR]) <= 1)
