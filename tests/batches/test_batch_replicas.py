"""Two real replicas on one PostgreSQL: one runs a batch at a time, and the other takes it over once the
first is lost (``kill -9``), each line in the output or the error file once and charged at most once."""

import signal

import openai
import pytest
from batch_inputs import GatedUpstream, ended, jsonl_lines, line, submitted
from replicas import Ledger, replica, stop_all

from kilnproxy.testing import KEY

LINES = 6


@pytest.fixture
async def gated():
    async with GatedUpstream() as upstream:
        yield upstream


def client(gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)


async def test_a_replica_lost_mid_batch_has_its_batch_taken_over(tmp_path, gated, pg_url):
    a = await replica(tmp_path, "a", gated.url, pg_url, batches={"max_in_flight": 2})
    b = None
    try:
        async with client(a) as c:
            _, batch = await submitted(c, [line(i) for i in range(LINES)])
        await gated.arrivals(2)  # replica a runs the batch (b is not started yet)
        b = await replica(tmp_path, "b", gated.url, pg_url, batches={"max_in_flight": 2})
        await gated.allow(2)
        await gated.arrivals(4)  # lines 2 and 3 in flight on a, admitted (held in the store)
        assert gated.arrived == 4  # b runs nothing of a batch a holds
        a.send(signal.SIGKILL)
        await a.wait()
        await gated.allow(100)
        async with client(b) as c:
            batch = await ended(c, batch.id)
            out = jsonl_lines((await c.files.content(batch.output_file_id)).text)
            errors = jsonl_lines((await c.files.content(batch.error_file_id)).text)
        assert batch.status == "completed"
        assert batch.request_counts.model_dump() == {"total": LINES, "completed": 4, "failed": 2}
        assert [o["custom_id"] for o in out] == ["line-0", "line-1", "line-4", "line-5"]
        # lines 2 and 3 died with a: a survivor wrote their replica_lost rows (their prompts charged); b
        # finds those rows and does not run them again
        assert [(e["custom_id"], e["error"]["code"], e["response"]["status_code"]) for e in errors] == [
            ("line-2", "batch_answer_lost", 502), ("line-3", "batch_answer_lost", 502)]
        async with Ledger(pg_url) as db:
            rows = {r["id"]: r for r in await db.rows(batch_id=batch.id)}
            assert await db.consistent()
        assert len(rows) == LINES  # one row per line: none ran twice
        assert {rows[e["response"]["request_id"]]["error_code"] for e in errors} == {"replica_lost"}
        assert all(rows[o["response"]["request_id"]]["status"] == 200 for o in out)
        assert gated.arrived == LINES
    finally:
        await stop_all(a, b)
