"""The SQLite ledger when its disk or its file misbehaves under a running gateway (usage accounting,
"When the ledger cannot write" in docs/reference.md).

Real gateways (``processes.GatewayProcess``, or the in-process ``Harness`` where a test must reach
into the ledger) on real ports, in front of the mock upstream, with their ledger on a small file
system of the test's own when the fault needs one (a tmpfs to fill up, an ext4 image whose files
turn read-only), mounted in the test's temporary folder and unmounted whatever happens. Faults: the
disk fills up, the files turn read-only, another program keeps the write lock, a reader keeps its
snapshot while the WAL grows, the -wal, -shm or database file is deleted. For each: what clients
get, that every request ends in exactly one row once the fault clears, what the log, /healthz and
/metrics say, and what a graceful stop does with rows it could not commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
from pathlib import Path

import aiohttp
import pytest
from faulty_ledgers import AUTH, GEN, fill, health, metric, mounted, post
from processes import GatewayProcess, Process, gateway_config

from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import completion_body

DOWN_LINE = "new requests get 503 store_unavailable"
ROW_LINE = "kilnproxy.ledger: usage row not committed: "  # then the row as JSON
GUARD_SECONDS = 30  # a bound on events that come within seconds: a test that hangs fails instead


def ledger_rows(db: Path) -> list[dict]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM usage_events")]
    finally:
        conn.close()


def ledger_lines(gateway: GatewayProcess) -> list[str]:
    return [line for line in gateway.lines["stderr"] if "kilnproxy.ledger" in line]


async def cancelled(tasks: list[asyncio.Task]) -> None:
    """The clients of a test that failed half-way, ended quietly."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def stopped(gateway: GatewayProcess) -> None:
    """Kill a gateway still running (a test that failed half-way), so that its mount can go."""
    if gateway.proc is not None and gateway.proc.returncode is None:
        await gateway.stop()


class HeldLock:
    """Another program's write transaction on the file (``BEGIN IMMEDIATE``), held until released."""

    def __init__(self, db: Path):
        self.conn = sqlite3.connect(db, isolation_level=None, timeout=10)

    def take(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def release(self) -> None:
        with contextlib.suppress(sqlite3.ProgrammingError):  # released already
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
        self.conn.close()


@pytest.fixture
def fault(request, tmp_path):
    """(where the ledger goes, start the fault, clear it): the disk fills up and empties again; the
    file turns read-only (``chattr +i``, which binds root too, on an ext4 file system) and writable
    again; or another program keeps the file's write lock and lets it go."""
    if request.param == "full":
        if os.geteuid() != 0:
            pytest.skip("mounts a tmpfs: root only")
        with mounted(tmp_path / "disk", "-t", "tmpfs", "-o", "size=4m", "tmpfs") as disk:
            filler = []
            yield disk / "usage.db", lambda: filler.append(fill(disk)), lambda: filler.pop().unlink()
        return
    if request.param == "read_only":
        if os.geteuid() != 0 or not all(shutil.which(c) for c in ("mkfs.ext4", "chattr", "losetup")):
            pytest.skip("mounts an ext4 image: root, mkfs.ext4 and chattr only")
        image = tmp_path / "ext4.img"
        with open(image, "wb") as f:
            f.truncate(16 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
        with mounted(tmp_path / "disk", "-o", "loop", str(image)) as disk:
            files = [str(disk / "usage.db"), str(disk / "usage.db-wal")]
            try:
                yield (disk / "usage.db", lambda: subprocess.run(["chattr", "+i", *files], check=True),
                       lambda: subprocess.run(["chattr", "-i", *files], check=True))
            finally:
                subprocess.run(["chattr", "-i", *files], capture_output=True)
        return
    lock: list[HeldLock] = []

    def take():
        lock.append(HeldLock(tmp_path / "usage.db"))
        lock[0].take()

    try:
        yield tmp_path / "usage.db", take, lambda: lock[0].release()
    finally:
        for held in lock:
            with contextlib.suppress(sqlite3.Error):
                held.release()


@pytest.mark.parametrize("fault", ["full", "read_only", "locked"], indirect=True)
async def test_a_ledger_that_cannot_commit_refuses_new_requests_then_recovers_with_one_row_each(
        tmp_path, mock_url, fault, eventually):
    db, start_fault, clear_fault = fault
    gateway = GatewayProcess(tmp_path, gateway_config([mock_url], storage={"path": str(db)}))
    await gateway.start()
    sent: dict[str, int] = {}
    waiting: list[asyncio.Task] = []
    try:
        async with aiohttp.ClientSession() as session:
            status, gen, _ = await post(session, gateway.url, completion_body())
            assert status == 200
            sent[gen] = status
            slow = completion_body(stream=True, max_tokens=6, mock={"delay": 0.05})
            streams = [await session.post(f"{gateway.url}/v1/completions", json=slow, headers=AUTH)
                       for _ in range(3)]
            for s in streams:
                assert s.status == 200
                await s.content.readline()  # under way when the fault comes
            start_fault()
            # the streams' rows meet the fault (the first may be a lone row, in the row journal: its stream
            # is read after the recovery all the same); from then on every row follows them to the writer
            await gateway.wait_for("stderr", "cannot commit")
            waiting += [asyncio.create_task(post(session, gateway.url, completion_body(stream=i == 0)))
                        for i in range(3)]
            await gateway.wait_for("stderr", DOWN_LINE)

            # down: a new request is refused at once, with its generation id, streamed or not
            for body in (completion_body(), completion_body(stream=True)):
                status, gen, raw = await asyncio.wait_for(post(session, gateway.url, body), GUARD_SECONDS)
                assert status == 503 and gen is not None
                assert json.loads(raw)["error"]["code"] == "store_unavailable"
                sent[gen] = status
            assert not any(task.done() for task in waiting)  # served, waiting for their rows
            body, ready = await health(session, gateway.url)
            assert body["store"] == "down" and ready == 503
            assert await metric(session, gateway.url, "kilnproxy_store_up") == 0
            assert await metric(session, gateway.url, "kilnproxy_ledger_commit_failures_total") >= 1
            assert await metric(session, gateway.url, "kilnproxy_ledger_queue_depth") >= 3

            clear_fault()
            await gateway.wait_for("stderr", "commits again")
            for s in streams:
                raw = await asyncio.wait_for(s.read(), GUARD_SECONDS)
                assert raw.endswith(b"data: [DONE]\n\n")
                sent[s.headers[GEN]] = 200
            for status, gen, raw in await asyncio.wait_for(asyncio.gather(*waiting), GUARD_SECONDS):
                assert status == 200
                sent[gen] = status
            assert (await health(session, gateway.url)) == ({"status": "ok", "store": "up"}, 200)
            status, gen, _ = await post(session, gateway.url, completion_body())
            assert status == 200
            sent[gen] = status
            assert await metric(session, gateway.url, "kilnproxy_store_up") == 1
            assert await metric(session, gateway.url, 'kilnproxy_in_flight_requests{org="acme"}') == 0
            async with session.get(f"{gateway.url}/admin/v1/orgs/acme") as resp:
                assert (await resp.json())["held"] == 0
        gateway.send(signal.SIGTERM)
        assert await gateway.wait() == 0
    finally:
        await stopped(gateway)
        await cancelled(waiting)
    rows = ledger_rows(db)
    assert sorted(r["id"] for r in rows) == sorted(sent)  # exactly one row per request
    assert {r["id"]: r["status"] for r in rows} == sent
    assert {r["error_code"] for r in rows if r["status"] == 503} == {"store_unavailable"}
    # the log says it once when it starts, once when requests are refused, once when it ends: not per retry
    lines = ledger_lines(gateway)
    assert len(lines) <= 4, lines
    assert "Traceback" not in "\n".join(gateway.lines["stderr"])


@pytest.mark.parametrize("fault", ["full", "read_only", "locked"], indirect=True)
async def test_a_graceful_stop_that_cannot_commit_writes_the_rows_to_the_log_and_exits_2(tmp_path, mock_url, fault):
    """The fault outlasts the stop: the rows the ledger could not commit are not lost silently. The
    process still exits (it does not retry for ever), each such row is a JSON line of its log, and it
    ends with one line saying how many and exit status 2."""
    db, start_fault, clear_fault = fault
    config = gateway_config([mock_url], storage={"path": str(db)},
                            server={"drain_seconds": 0, "shutdown_grace_seconds": 1})
    gateway = GatewayProcess(tmp_path, config)
    await gateway.start()
    clients: list[asyncio.Task] = []
    try:
        async with aiohttp.ClientSession() as session:
            status, first, _ = await post(session, gateway.url, completion_body())
            assert status == 200
            slow = completion_body(stream=True, max_tokens=6, mock={"delay": 0.05})
            streams = [await session.post(f"{gateway.url}/v1/completions", json=slow, headers=AUTH)
                       for _ in range(2)]
            for s in streams:
                await s.content.readline()
            start_fault()
            clients += [asyncio.create_task(post(session, gateway.url, completion_body())) for _ in range(2)]
            clients += [asyncio.create_task(s.read()) for s in streams]
            await gateway.wait_for("stderr", "cannot commit")
            gateway.send(signal.SIGTERM)
            assert await gateway.wait(timeout=60) == 2
            await asyncio.gather(*clients, return_exceptions=True)  # each ends, one way or another
    finally:
        await stopped(gateway)
        await cancelled(clients)
        clear_fault()
    stderr = gateway.lines["stderr"]
    assert "Traceback" not in "\n".join(stderr)
    assert stderr[-1].startswith("kilnproxy: error: stopped with ")
    logged = [json.loads(line.split(ROW_LINE, 1)[1]) for line in stderr if ROW_LINE in line]
    assert stderr[-1] == (f"kilnproxy: error: stopped with usage rows not committed to the ledger: {len(logged)}; "
                          "each is in the log above, on a line 'usage row not committed: ' and the row as JSON")
    committed = ledger_rows(db)
    ids = [r["id"] for r in committed] + [r["id"] for r in logged]
    assert len(ids) == len(set(ids)) == 5  # one row per request: in the file, or in the log
    assert first in ids and {s.headers[GEN] for s in streams} <= set(ids)
    assert {r["org"] for r in logged} == {"acme"} and all(r["cost"] > 0 for r in logged)


async def test_a_reader_holding_an_old_snapshot_holds_up_no_response(harness, caplog):
    """Past twice its bound the WAL must start over, which a reader's open snapshot forbids: the
    writer's restart waited for the reader (2 s) before each batch, so every response did. Now it
    is tried again a second later and the commits go on; the log says so once."""
    async with harness() as h:
        ledger = h.gateway.app[GATEWAY].ledger
        ledger.checkpointer.max_wal_bytes = 256 << 10  # the bound (256 MB by default), reached with 1 MB
        async with h.post("/v1/completions", completion_body()) as resp:
            assert resp.status == 200
        reader = sqlite3.connect(h.db, isolation_level=None)
        writer = sqlite3.connect(h.db, isolation_level=None)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT COUNT(*) FROM usage_events").fetchall()  # its snapshot, kept open
            with writer:  # another program's write: 1 MB more in the WAL, which cannot start over now
                writer.execute("CREATE TABLE other (b BLOB)")
                writer.execute("INSERT INTO other VALUES (zeroblob(1048576))")
            loop = asyncio.get_running_loop()
            started = loop.time()
            for body in (completion_body(), completion_body(stream=True)) * 3:
                async with h.post("/v1/completions", body) as resp:
                    assert resp.status == 200
                    await resp.read()
            assert loop.time() - started < 2.0  # was 2 s (the writer's busy timeout) for each
            assert ledger.checkpointer.wal.stat().st_size > 2 * ledger.checkpointer.max_wal_bytes
        finally:
            reader.close()
            writer.close()
    held_off = [r for r in caplog.records if "cannot start over" in r.getMessage()]
    assert len(held_off) == 1
    assert len(ledger_rows(h.db)) == 7


async def test_rows_wait_in_memory_up_to_a_bound_then_refusals_have_none(harness, eventually):
    """While down, a refusal's row waits in memory with the others, up to ``max_waiting_rows``; past
    it the refusal has no row and no generation id (as a 401), and is counted. The answers never wait."""
    async with harness() as h:
        ledger = h.gateway.app[GATEWAY].ledger
        ledger.max_waiting_rows = 4
        lock = HeldLock(h.db)
        waiting: list[asyncio.Task] = []
        try:
            lock.take()
            waiting += [asyncio.create_task(post(h.session, h.url, completion_body())) for _ in range(2)]
            await eventually(lambda: ledger.refuses_requests, timeout=GUARD_SECONDS)
            answers = [await post(h.session, h.url, completion_body(stream=i % 2 == 1)) for i in range(4)]
            assert [status for status, _, _ in answers] == [503] * 4
            assert {json.loads(raw)["error"]["code"] for _, _, raw in answers} == {"store_unavailable"}
            with_row = [gen for _, gen, _ in answers if gen is not None]
            assert len(with_row) == 2 and [gen for _, gen, _ in answers[2:]] == [None, None]
            async with h.session.get(f"{h.url}/metrics") as resp:
                assert "kilnproxy_ledger_refused_unrecorded_total 2.0" in await resp.text()
            lock.release()
            served = [gen for status, gen, _ in await asyncio.wait_for(asyncio.gather(*waiting), GUARD_SECONDS)]
        finally:
            lock.release()
            await cancelled(waiting)
        # the refusals' rows are committed after those the responses waited for
        await eventually(lambda: sorted(r["id"] for r in ledger_rows(h.db)) == sorted(served + with_row))


@pytest.mark.parametrize("deleted", ["-wal", "-shm", ""])
async def test_a_file_deleted_under_the_gateway_is_made_anew_with_every_row(tmp_path, mock_url, deleted, eventually):
    """The -wal, the -shm or the database itself deleted under a running gateway: it wrote on into the
    deleted file, where no other program could read the rows (the -wal: "disk I/O error"), a kill -9
    lost every row since the last checkpoint (all of them, the database: no file at all), and a
    program writing beside it (the orgs command) corrupted the file (the -shm). Now the gateway copies
    the rows into the file it opens anew, within a second: all there, for everyone, and after a kill -9."""
    gateway = GatewayProcess(tmp_path, gateway_config([mock_url]))
    await gateway.start()
    db = tmp_path / "usage.db"
    ids = []
    try:
        async with aiohttp.ClientSession() as session:
            async def served(n: int) -> None:
                for i in range(n):
                    status, gen, _ = await post(session, gateway.url, completion_body(stream=i % 2 == 1))
                    assert status == 200
                    ids.append(gen)

            await served(4)
            (tmp_path / f"usage.db{deleted}").unlink()
            await served(4)  # committed into the deleted file
            await gateway.wait_for("stderr", "opened anew")
            await served(4)
            # another program sees them all (the last, a lone row, a moment after its response ended)
            await eventually(lambda: sorted(r["id"] for r in ledger_rows(db)) == sorted(ids))
            command = await Process(["orgs", "create", "beside", "--config", str(gateway.config_path)],
                                    tmp_path).start()  # another program writes the file meanwhile
            assert await command.wait() == 0

            async def seen() -> bool:
                async with session.get(f"{gateway.url}/admin/v1/orgs/beside") as resp:
                    return resp.status == 200
            await eventually(seen)
            await served(2)
    finally:
        await gateway.stop()  # kill -9
    # the last rows may be in the row journal only: the next start inserts them
    restarted = GatewayProcess(tmp_path, gateway_config([mock_url]))
    await restarted.start()
    await restarted.stop()
    assert sorted(r["id"] for r in ledger_rows(db)) == sorted(ids)
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("SELECT id FROM kiln_runtime_orgs").fetchall() == [("beside",)]
    finally:
        conn.close()
    assert "Traceback" not in "\n".join(gateway.lines["stderr"])
