"""A gateway killed (``kill -9``) or stopped in the middle of a batch goes on with it when it starts
again: each line in the output file once, each charged once (SPEC 14: durability). Real gateway
processes on one SQLite file, their upstream held line by line by the test."""

import asyncio
import signal

import openai
import pytest
from batch_inputs import GatedUpstream, ended, jsonl_lines, line, submitted
from processes import GatewayProcess, gateway_config

from kilnproxy.testing import KEY

LINES = 6


@pytest.fixture
async def gated():
    async with GatedUpstream() as upstream:
        yield upstream


def config(upstream_url: str) -> dict:
    return gateway_config([upstream_url], batches={"max_in_flight": 2})


def client(gateway: GatewayProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)


async def check_each_line_answered_and_charged_once(gateway: GatewayProcess, batch) -> None:
    assert batch.status == "completed" and batch.request_counts.model_dump() == {
        "total": LINES, "completed": LINES, "failed": 0}
    async with client(gateway) as c:
        out = jsonl_lines((await c.files.content(batch.output_file_id)).text)
    assert sorted(o["custom_id"] for o in out) == [f"line-{i}" for i in range(LINES)]
    charged = [r for r in gateway.rows() if r["batch_id"] == batch.id and r["cost"] > 0]
    assert sorted(r["id"] for r in charged) == sorted(o["response"]["request_id"] for o in out)


@pytest.mark.parametrize("stop", ["kill", "term"])
async def test_a_gateway_stopped_mid_batch_resumes_it(tmp_path, gated, stop):
    gateway = await GatewayProcess(tmp_path, config(gated.url)).start()
    try:
        async with client(gateway) as c:
            _, batch = await submitted(c, [line(i) for i in range(LINES)])
        await gated.arrivals(2)
        await gated.allow(2)  # lines 0 and 1 answered; 2 and 3 taken once their slots freed, held upstream
        await gated.arrivals(4)
        if stop == "kill":
            gateway.send(signal.SIGKILL)
        else:
            gateway.send(signal.SIGTERM)
            await gated.allow(2)  # a graceful stop lets the lines in flight end
        await gateway.wait()
        assert gated.arrived == 4
        gateway = await GatewayProcess(tmp_path, config(gated.url)).start()
        await gated.allow(100)
        async with client(gateway) as c:
            batch = await ended(c, batch.id)
        await check_each_line_answered_and_charged_once(gateway, batch)
        # killed: lines 2 and 3 had no row (their requests died with the process) and ran again
        assert gated.arrived == (LINES + 2 if stop == "kill" else LINES)
    finally:
        await gateway.stop()


def leave_as_killed(db, batch_id: str, line_no: int) -> str:
    """The file as a gateway killed after line ``line_no``'s usage row and before its outcome leaves it:
    the line ``sent`` under its row's generation id, the batch in progress, not counted."""
    import sqlite3
    conn = sqlite3.connect(db)
    try:
        with conn:
            (generation_id,) = conn.execute(
                "SELECT generation_id FROM kiln_batch_lines WHERE batch_id = ? AND line = ?",
                (batch_id, line_no)).fetchone()
            conn.execute("UPDATE kiln_batch_lines SET state = 'sent', ok = NULL, result = NULL"
                         " WHERE batch_id = ? AND line = ?", (batch_id, line_no))
            conn.execute("UPDATE kiln_batches SET status = 'in_progress', completed = completed - 1,"
                         " output_file_id = NULL, finalizing_at = NULL, completed_at = NULL WHERE id = ?",
                         (batch_id,))
        return generation_id
    finally:
        conn.close()


async def test_a_line_charged_but_not_kept_is_not_run_again(harness):
    async with harness() as h:
        c = h.openai()
        _, batch = await submitted(c, [line(0), line(1)])
        await ended(c, batch.id)
    generation_id = leave_as_killed(h.db, batch.id, 1)
    async with harness() as h:
        c = h.openai()
        batch = await ended(c, batch.id)
        assert batch.status == "completed"
        assert batch.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
        assert [o["custom_id"] for o in jsonl_lines((await c.files.content(batch.output_file_id)).text)] == [
            "line-1"]
        (lost,) = jsonl_lines((await c.files.content(batch.error_file_id)).text)
        assert lost["custom_id"] == "line-0" and lost["error"]["code"] == "batch_answer_lost"
        assert lost["response"] == {"status_code": 200, "request_id": generation_id, "body": None}
        assert len(await h.rows(batch_id=batch.id)) == 2  # line 0 charged once, not run again
