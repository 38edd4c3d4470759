"""The Batch API under load: a batch of ``--lines`` lines beside interactive requests on one capped upstream.

Three runs, each a fresh gateway (pinned to CPU 0; the upstream and the clients on CPU 1) in front of
``batch_upstream.py`` (every answer after ``--service`` seconds: one slot turn), the model's upstream
capped at ``--slots`` requests (``batch_reserve`` its default, 1), ``[batches] max_in_flight`` 4:

1. ``quiet``: interactive requests alone (``--clients`` of them in a loop, another org than the
   batch's) for ``--baseline`` seconds, then the same while the batch runs to its end. Reported: the
   batch's time and lines per second, and the interactive requests' time in queue (their latency
   less the slot turn and the gateway's own time measured in the baseline) at p50, p99 and max.
2. ``killed``: the gateway ``kill -9``ed at a third and at two thirds of the batch, started again each
   time on the same SQLite file.
3. ``replicas``: two replicas on one PostgreSQL, the one running the batch (its ``/metrics`` say so)
   ``kill -9``ed half way.
4. ``file``: a file of ``max_file_bytes`` (100 MiB) uploaded and read back: the gateway's peak memory
   (VmHWM) before and after, which a file held whole would raise by its size.

After each: every line in the output or the error file once, and no line charged twice (every
usage row of the batch with a cost is the ``request_id`` of exactly one line). Writes
``bench/results/partial/<date>-<time>-batches.md``.

    python bench/batch_run.py [--lines 10000] [--service 0.05] [--slots 4] [--clients 2] [--only quiet,killed,replicas,file]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import openai
from procs import Procs, free_port, peak_rss_kib, raise_fd_limit
from report import machine

from kilnproxy.store.reads import pg_fetch
from kilnproxy.testing.postgres import PostgresServer

HERE = Path(__file__).resolve().parent
PY = sys.executable
BATCH_KEY, LIVE_KEY = "sk-bench-batch", "sk-bench-live"


def write_config(path: Path, port: int, upstream: str, slots: int, storage: str) -> Path:
    path.write_text(f"""
[server]
host = "127.0.0.1"
port = {port}
drain_seconds = 0

[storage]
{storage}

[limits]
max_in_flight_per_org = 100000

[[models]]
id = "bench"
upstreams = [{{url = "{upstream}", max_in_flight = {slots}}}]
upstream_model = "org/Bench-7B"
queue_timeout = 600
[models.pricing]
prompt = 0.10
completion = 0.30
batch_discount = 0.5

[[orgs]]
id = "nightly"
credits = 1000000000.0

[[orgs]]
id = "live"
credits = 1000000000.0

[[keys]]
key = "{BATCH_KEY}"
org = "nightly"

[[keys]]
key = "{LIVE_KEY}"
org = "live"

[batches]
max_in_flight = 4

[log]
access = false

[inspector]
enabled = false
""")
    return path


class Run:
    """One gateway (or two replicas) and the bench's upstream, in a folder of its own."""

    def __init__(self, args, procs: Procs, work: Path, name: str, upstream: str, cpus: tuple):
        self.args, self.procs, self.work, self.name, self.upstream = args, procs, work, name, upstream
        self.gw_cpus, self.load_cpus = cpus
        self.gateways: dict[str, tuple] = {}  # name -> (proc, url, config path)

    def start(self, name: str, storage: str) -> str:
        port = free_port()
        cfg = write_config(self.work / f"{name}.toml", port, self.upstream, self.args.slots, storage)
        proc = self.procs.start(name, [PY, "-m", "kilnproxy", "serve", "--config", str(cfg)], cpus=self.gw_cpus,
                                port=port, timeout=60)
        self.gateways[name] = (proc, f"http://127.0.0.1:{port}", cfg)
        return self.gateways[name][1]

    def kill(self, name: str) -> None:
        proc = self.gateways[name][0]
        proc.kill()
        proc.wait()
        self.procs.running = [(n, p) for n, p in self.procs.running if p is not proc]

    def restart(self, name: str) -> str:
        _, url, cfg = self.gateways[name]
        port = int(url.rsplit(":", 1)[1])
        proc = self.procs.start(name, [PY, "-m", "kilnproxy", "serve", "--config", str(cfg)], cpus=self.gw_cpus,
                                port=port, timeout=60)
        self.gateways[name] = (proc, url, cfg)
        return url


def lines_file(n: int, tag: str) -> bytes:
    """``n`` lines, each asking for the completion of its own prompt (``<tag>-line-<i>``)."""
    import orjson
    return b"".join(orjson.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "bench", "prompt": f"{tag}-line-{i}", "max_tokens": 2}}) + b"\n"
                    for i in range(n))


class Interactive:
    """``clients`` loops of interactive requests; each latency kept (seconds)."""

    def __init__(self, url: str, clients: int):
        self.url, self.clients = url, clients
        self.latencies: list[float] = []
        self.sent: dict[str, float] = {}  # prompt -> when it was sent (Unix seconds)
        self.refused = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = {"model": "bench", "prompt": f"live-{i}-{n}", "max_tokens": 2}
            self.sent[body["prompt"]] = time.time()
            started = time.perf_counter()
            try:
                async with session.post(f"{self.url}/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {LIVE_KEY}"}) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                self.latencies.append(time.perf_counter() - started)
            else:
                self.refused += 1
                await asyncio.sleep(0.05)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else float("nan")


async def wait_batch(urls, batch_id: str, on_progress=None, every: float = 0.5):
    """The batch once it has ended, asked of the first gateway of ``urls()`` that answers."""
    while True:
        for url in urls():
            try:
                async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=BATCH_KEY, max_retries=0) as c:
                    batch = await c.batches.retrieve(batch_id)
                break
            except openai.APIConnectionError:
                continue
        else:
            await asyncio.sleep(every)
            continue
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        if on_progress is not None:
            await on_progress(batch)
        await asyncio.sleep(every)


async def create_batch(url: str, n: int, tag: str):
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=BATCH_KEY, max_retries=0) as c:
        upload = await c.files.create(file=("lines.jsonl", lines_file(n, tag)), purpose="batch")
        return await c.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")


async def check_once(url: str, batch, rows: list[dict]) -> dict:
    """Each line in the files once; every charged row the request_id of exactly one line."""
    import orjson
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=BATCH_KEY, max_retries=0) as c:
        texts = []
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                texts.append((await c.files.content(file_id)).text)
    entries = [orjson.loads(t) for text in texts for t in text.splitlines() if t]
    custom = [e["custom_id"] for e in entries]
    request_ids = [e["response"]["request_id"] for e in entries if e["response"]]
    charged = [r["id"] for r in rows if r["cost"] > 0]
    return {"lines": len(entries), "distinct": len(set(custom)), "errors": sum(1 for e in entries if e["error"]),
            "rows": len(rows), "charged": len(charged),
            "charged_not_a_line": len(set(charged) - set(request_ids)),
            "lines_sharing_a_row": len(request_ids) - len(set(request_ids)),
            "cost": sum(r["cost"] for r in rows)}


def sqlite_rows(db: Path, batch_id: str) -> list[dict]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT id, cost, status FROM usage_events WHERE batch_id = ?",
                                              (batch_id,))]
    finally:
        conn.close()


async def upstream_arrivals(upstream: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(upstream.replace("/v1", "/arrivals")) as resp:
        return await resp.json()


async def upstream_stats(upstream: str, prefix: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(upstream.replace("/v1", "/stats"),
                                                               params={"prefix": prefix}) as resp:
        return await resp.json()


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


async def quiet(args, run: Run) -> list[str]:
    url = run.start("quiet", f'path = "{run.work / "quiet.db"}"')
    live = Interactive(url, args.clients)
    task = asyncio.create_task(live.run())
    await asyncio.sleep(args.baseline)
    baseline, alone_sent = list(live.latencies), dict(live.sent)
    live.latencies.clear()
    started = time.perf_counter()
    batch = await create_batch(url, args.lines, "quiet")
    batch = await wait_batch(lambda: [url], batch.id)
    took = time.perf_counter() - started
    live.stop.set()
    await task
    during = live.latencies
    arrived = await upstream_arrivals(run.upstream)
    # through the gateway to the upstream: its own time, and (while the batch runs) the time in queue
    alone_through = [arrived[p] - t for p, t in alone_sent.items() if p in arrived]
    during_through = [arrived[p] - t for p, t in live.sent.items() if p in arrived and p not in alone_sent]
    waits = [max(0.0, x - statistics.median(alone_through)) for x in during_through]
    turn = args.service
    once = await check_once(url, batch, sqlite_rows(run.work / "quiet.db", batch.id))
    ok = once["distinct"] == args.lines == once["lines"] and once["charged_not_a_line"] == 0
    return [
        "## 1. The batch beside interactive requests (SQLite)",
        f"- batch of {args.lines:,} lines: {batch.status} in {took:.1f} s ({args.lines / took:.0f} lines/s), "
        f"request_counts {batch.request_counts.model_dump()}",
        f"- each line answered once: {once['lines']:,} lines in the files, {once['distinct']:,} distinct; "
        f"{once['charged']:,} rows charged, {once['charged_not_a_line']} charged outside a line, "
        f"{once['lines_sharing_a_row']} lines sharing a row ({verdict(ok)})",
        f"- interactive, alone ({len(baseline)} requests, {args.clients} clients): latency p50 "
        f"{statistics.median(baseline) * 1000:.1f} ms, p99 {pct(baseline, 99) * 1000:.1f} ms",
        f"- interactive, while the batch ran ({len(during)} requests, {live.refused} refused): latency p50 "
        f"{statistics.median(during) * 1000:.1f} ms, p99 {pct(during, 99) * 1000:.1f} ms",
        f"- from the client to the upstream (the gateway's own time, and the time in queue): alone p50 "
        f"{pct(alone_through, 50) * 1000:.1f} ms, p99 {pct(alone_through, 99) * 1000:.1f} ms; while the batch ran "
        f"p50 {pct(during_through, 50) * 1000:.1f} ms, p99 {pct(during_through, 99) * 1000:.1f} ms. Time in queue "
        f"(that less the alone p50): p50 {pct(waits, 50) * 1000:.1f} ms, p90 {pct(waits, 90) * 1000:.1f} ms, "
        f"p99 {pct(waits, 99) * 1000:.1f} ms, max {max(waits) * 1000:.1f} ms, against one slot turn (the "
        f"upstream's service time: the longest a busy slot takes to free) of {turn * 1000:.0f} ms: p99 "
        f"{verdict(pct(waits, 99) <= turn)} (M7's turn, service / slots: {turn / args.slots * 1000:.1f} ms); "
        f"p99 less the alone p99: "
        f"{(pct(during_through, 99) - pct(alone_through, 99)) * 1000:.1f} ms "
        f"({verdict(pct(during_through, 99) - pct(alone_through, 99) <= turn)})",
    ]


async def killed(args, run: Run) -> list[str]:
    db = run.work / "killed.db"
    url = run.start("killed", f'path = "{db}"')
    batch = await create_batch(url, args.lines, "killed")
    kills = []

    async def progress(b):
        ended = b.request_counts.completed + b.request_counts.failed
        if len(kills) < 2 and ended >= (len(kills) + 1) * args.lines // 3:
            run.kill("killed")
            kills.append(ended)
            run.restart("killed")

    started = time.perf_counter()
    batch = await wait_batch(lambda: [url], batch.id, progress)
    took = time.perf_counter() - started
    once = await check_once(url, batch, sqlite_rows(db, batch.id))
    stats = await upstream_stats(run.upstream, "killed-")
    ok = once["distinct"] == args.lines == once["lines"] and once["charged_not_a_line"] == 0 \
        and once["lines_sharing_a_row"] == 0
    return [
        "## 2. The gateway killed twice (kill -9, SQLite)",
        f"- killed at {', '.join(f'{k:,}' for k in kills)} lines ended; the batch {batch.status} in {took:.1f} s, "
        f"request_counts {batch.request_counts.model_dump()}",
        f"- {once['lines']:,} lines in the files, {once['distinct']:,} distinct ({once['errors']} in the error file); "
        f"{once['charged']:,} rows charged, {once['charged_not_a_line']} outside a line; the upstream saw "
        f"{stats['requests']:,} requests, {stats['repeated']} prompts twice (lines in flight at a kill, no row: "
        f"run again) ({verdict(ok)})",
    ]


async def replicas(args, run: Run) -> list[str]:
    with PostgresServer() as postgres:
        url = postgres.create_database("kiln_batches")
        storage = (f'url = "{url}"\nreplica_timeout_seconds = 3\nspool_path = "{run.work / "spool-%s.db"}"')
        a = run.start("replica-a", storage.replace("%s", "a"))
        b = run.start("replica-b", storage.replace("%s", "b"))
        batch = await create_batch(a, args.lines, "replicas")
        killed_at = []

        async def progress(bt):
            ended = bt.request_counts.completed + bt.request_counts.failed
            if not killed_at and ended >= args.lines // 2:
                running = await running_replica({"replica-a": a, "replica-b": b})
                run.kill(running)
                killed_at.append((running, ended))

        started = time.perf_counter()
        alive = lambda: [u for n, u in (("replica-a", a), ("replica-b", b)) if not killed_at or killed_at[0][0] != n]
        batch = await wait_batch(alive, batch.id, progress)
        took = time.perf_counter() - started
        rows = await pg_fetch(url, "SELECT id, cost, status FROM usage_events WHERE batch_id = ?", (batch.id,))
        once = await check_once(alive()[0], batch, rows)
    ok = once["distinct"] == args.lines == once["lines"] and once["charged_not_a_line"] == 0 \
        and once["lines_sharing_a_row"] == 0
    name, at = killed_at[0]
    return [
        "## 3. Two replicas on one PostgreSQL, the running one killed",
        f"- {name} (the one whose /metrics showed the batch) killed at {at:,} lines ended; the other took the batch "
        f"over after replica_timeout_seconds = 3: {batch.status} in {took:.1f} s, request_counts "
        f"{batch.request_counts.model_dump()}",
        f"- {once['lines']:,} lines in the files, {once['distinct']:,} distinct ({once['errors']} in the error file: "
        f"lines in flight on the lost replica, charged by its replica_lost rows, not run again); "
        f"{once['charged']:,} rows charged, {once['charged_not_a_line']} outside a line ({verdict(ok)})",
    ]


async def big_file(args, run: Run) -> list[str]:
    size = 100 * 1024 * 1024
    path = run.work / "big.jsonl"
    with path.open("wb") as f:
        line = b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}' + b" " * 949 + b"\n"
        for _ in range(size // len(line)):
            f.write(line)
        f.write(b"\n" * (size - f.tell()))
    url = run.start("file", f'path = "{run.work / "file.db"}"')
    pid = run.gateways["file"][0].pid
    before = peak_rss_kib(pid)[0]
    headers = {"Authorization": f"Bearer {BATCH_KEY}"}
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", path.open("rb"), filename="big.jsonl")
        async with session.post(f"{url}/v1/files", data=form, headers=headers) as resp:
            uploaded = await resp.json()
        up = time.perf_counter() - started
        after_up = peak_rss_kib(pid)[0]
        started = time.perf_counter()
        read = 0
        async with session.get(f"{url}/v1/files/{uploaded['id']}/content", headers=headers) as resp:
            async for chunk in resp.content.iter_chunked(1 << 20):
                read += len(chunk)
        down = time.perf_counter() - started
    after_down = peak_rss_kib(pid)[0]
    ok = uploaded["bytes"] == read == size and after_down - before < size // 1024 // 4
    return [
        "## 4. A file of 100 MiB to and from the store (SQLite)",
        f"- uploaded in {up:.1f} s ({uploaded['bytes']:,} bytes), read back in {down:.1f} s ({read:,} bytes); the "
        f"gateway's peak memory (VmHWM) {before / 1024:.1f} MiB before, {after_up / 1024:.1f} after the upload, "
        f"{after_down / 1024:.1f} after the read: {(after_down - before) / 1024:.1f} MiB more for a 100 MiB file "
        f"({verdict(ok)}: under a quarter of it)",
    ]


async def running_replica(urls: dict[str, str]) -> str:
    async with aiohttp.ClientSession() as session:
        for name, url in urls.items():
            async with session.get(f"{url}/metrics") as resp:
                if "kilnproxy_batches_running 1.0" in await resp.text():
                    return name
    raise RuntimeError("no replica runs the batch")


async def main_async(args, procs: Procs, work: Path, cpus) -> list[str]:
    port = free_port()
    procs.start("upstream", [PY, str(HERE / "batch_upstream.py"), "--port", str(port), "--service",
                             str(args.service)], port=port)
    upstream = f"http://127.0.0.1:{port}/v1"
    sections = []
    for name, measure in (("quiet", quiet), ("killed", killed), ("replicas", replicas), ("file", big_file)):
        if name in args.only:
            print(f"{name} ...", flush=True)
            sections += await measure(args, Run(args, procs, work, name, upstream, cpus))
            print("\n".join(sections[-3:]), flush=True)
    return sections


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--service", type=float, default=0.05, help="seconds the upstream takes per request")
    parser.add_argument("--slots", type=int, default=4, help="the upstream's max_in_flight")
    parser.add_argument("--clients", type=int, default=2, help="interactive clients in a loop")
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds of interactive requests alone")
    parser.add_argument("--only", default="quiet,killed,replicas,file")
    args = parser.parse_args()
    args.only = set(args.only.split(","))
    cpus = sorted(os.sched_getaffinity(0))
    gw_cpus, load_cpus = ({cpus[0]}, {cpus[1]}) if len(cpus) >= 2 else (None, None)
    if load_cpus:
        os.sched_setaffinity(0, load_cpus)
    raise_fd_limit()
    work = Path(tempfile.mkdtemp(prefix="kilnproxy-batch-bench-"))
    started = datetime.datetime.now(datetime.timezone.utc)
    with Procs(work) as procs:
        sections = asyncio.run(main_async(args, procs, work, (gw_cpus, load_cpus)))
    minutes = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60
    text = "\n\n".join([
        f"# kilnproxy bench: the Batch API, {started:%Y-%m-%d %H:%M} UTC",
        machine() + f"\n- `python bench/batch_run.py --lines {args.lines} --service {args.service} --slots "
        f"{args.slots} --clients {args.clients}` ({minutes:.1f} min); gateway on CPU {min(gw_cpus or {0})}, "
        f"upstream and clients on the other; logs in {work}",
        *sections]) + "\n"
    out = HERE / "results" / "partial"
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{started:%Y-%m-%d-%H%M}-batches.md"
    target.write_text(text)
    print(f"\nwritten to {target} ({minutes:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
