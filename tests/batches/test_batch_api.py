"""The Batch API with the openai SDK against a real gateway (SPEC 14): files, batches, lines run
through the whole request path, the output and error files, prices, and every refusal."""

import asyncio
import sqlite3

import openai
import pytest
from batch_inputs import GatedUpstream, ended, jsonl, jsonl_lines, line, submitted

from kilnproxy.batches.service import BATCHES
from kilnproxy.testing import OTHER_KEY


def stored(db, table: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()


async def test_a_batch_runs_each_line_once_through_the_request_path(any_gw):
    gw = any_gw
    client = gw.openai()
    lines = [line(i, "/v1/chat/completions", stream=True, stream_options={"include_usage": True})
             for i in range(3)]
    lines.append(line(3, "/v1/chat/completions", model="no-such-model"))
    upload, batch = await submitted(client, lines, "/v1/chat/completions", metadata={"run": "nightly"})
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(lines)) and upload.status == "processed"
    assert (batch.status, batch.endpoint, batch.input_file_id) == ("validating", "/v1/chat/completions", upload.id)
    assert batch.request_counts.model_dump() == {"total": 0, "completed": 0, "failed": 0}
    assert batch.metadata == {"run": "nightly"} and isinstance(batch.created_at, int)

    batch = await ended(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    for name in ("in_progress_at", "finalizing_at", "completed_at"):
        assert isinstance(getattr(batch, name), int)
    out = jsonl_lines((await client.files.content(batch.output_file_id)).text)
    assert [o["custom_id"] for o in out] == ["line-0", "line-1", "line-2"]
    rows = await gw.rows(batch_id=batch.id)
    assert len(rows) == 4  # one row per line, each with the batch's id
    by_id = {r["id"]: r for r in rows}
    for o in out:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"  # stream forced off: one JSON answer
        row = by_id[o["response"]["request_id"]]
        assert (row["status"], row["stream"], row["key_id"]) == (200, 0, "acme-key")
    errors = jsonl_lines((await client.files.content(batch.error_file_id)).text)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("line-3", 404)]
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id[errors[0]["response"]["request_id"]]["error_code"] == "model_not_found"

    output = await client.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.bytes == len(
        (await client.files.content(batch.output_file_id)).content)
    listed = await client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]
    files = [f.id for f in (await client.files.list()).data]
    assert set(files) == {upload.id, batch.output_file_id, batch.error_file_id}
    assert files[-1] == upload.id  # newest first
    assert (await client.files.delete(upload.id)).deleted is True
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(upload.id)


async def test_lines_are_priced_at_the_batch_discount(harness):
    def discount(config):
        config["models"][0]["pricing"]["batch_discount"] = 0.5

    async with harness(configure=discount) as h:
        client = h.openai()
        interactive = await client.completions.with_raw_response.create(**line(0)["body"])
        full = await h.row(interactive.headers["X-Neocloud-Generation-Id"])
        _, batch = await submitted(client, [line(0)])
        batch = await ended(client, batch.id)
        (out,) = jsonl_lines((await client.files.content(batch.output_file_id)).text)
        row = await h.row(out["response"]["request_id"])
        assert row["total_tokens"] == full["total_tokens"] and full["cost"] > 0
        assert row["cost"] == pytest.approx(full["cost"] * 0.5, abs=1e-12)
        assert out["response"]["body"]["usage"]["cost"] == row["cost"]  # the answer shows what was charged


async def test_bad_lines_fail_the_batch_and_no_line_runs(gw):
    client = gw.openai()
    lines = [line(0), b"{not json", line(0), {**line(2), "url": "/v1/embeddings"}, {**line(3), "body": "text"},
             {**line(4), "method": "GET"}, b"[1, 2]", {**line(6), "custom_id": 7}, b"", line(8)]
    _, batch = await submitted(client, lines)
    batch = await ended(client, batch.id)
    assert batch.status == "failed" and isinstance(batch.failed_at, int)
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [
        ("invalid_json_line", 2, None), ("invalid_url", 4, "url"), ("invalid_body", 5, "body"),
        ("invalid_method", 6, "method"), ("invalid_request", 7, None), ("invalid_custom_id", 8, "custom_id")]
    assert batch.request_counts.model_dump() == {"total": 0, "completed": 0, "failed": 0}
    assert batch.output_file_id is None and batch.error_file_id is None
    assert await gw.rows() == [] and await gw.mock_requests() == []


async def test_a_duplicate_custom_id_fails_the_batch(gw):
    client = gw.openai()
    _, batch = await submitted(client, [line(0), line(1), line(0), line(1)])
    batch = await ended(client, batch.id)
    assert batch.status == "failed"
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 3), ("duplicate_custom_id", 4)]
    assert await gw.rows() == []


async def test_an_empty_file_fails_the_batch(gw):
    client = gw.openai()
    _, batch = await submitted(client, [])
    batch = await ended(client, batch.id)
    assert (batch.status, [(e.code, e.line) for e in batch.errors.data]) == ("failed", [("empty_file", None)])


async def test_a_file_over_max_file_bytes_is_413_and_nothing_is_kept(harness):
    async with harness(overrides={"batches": {"max_file_bytes": 1000}}) as h:
        client = h.openai()
        with pytest.raises(openai.APIStatusError) as refused:
            await client.files.create(file=("big.jsonl", b"x" * 1001), purpose="batch")
        assert refused.value.status_code == 413
        assert refused.value.body["code"] == "file_too_large"
        assert (await client.files.list()).data == []
        assert stored(h.db, "kiln_files") == stored(h.db, "kiln_file_chunks") == 0
        kept = await client.files.create(file=("fits.jsonl", b"x" * 1000), purpose="batch")
        assert kept.bytes == 1000 and (await client.files.content(kept.id)).content == b"x" * 1000


async def test_another_purpose_is_400_and_nothing_is_kept(gw):
    client = gw.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        await client.files.create(file=("in.jsonl", jsonl([line(0)])), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"
    # the purpose after the file: the file is read, then dropped
    import aiohttp
    form = aiohttp.FormData()
    form.add_field("file", jsonl([line(0)]), filename="in.jsonl")
    form.add_field("purpose", "assistants")
    async with gw.session.post(f"{gw.url}/v1/files", data=form, headers=gw.headers()) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "purpose"
    form = aiohttp.FormData(default_to_multipart=True)
    form.add_field("purpose", "batch")
    form.add_field("expires_after", "ignored")
    async with gw.session.post(f"{gw.url}/v1/files", data=form, headers=gw.headers()) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "file"
    assert stored(gw.db, "kiln_files") == stored(gw.db, "kiln_file_chunks") == 0


async def test_another_orgs_files_and_batches_are_404(any_gw):
    gw = any_gw
    mine, theirs = gw.openai(), gw.openai(OTHER_KEY)
    upload, batch = await submitted(mine, [line(0)])
    for call in (theirs.files.retrieve, theirs.files.content, theirs.files.delete):
        with pytest.raises(openai.NotFoundError) as refused:
            await call(upload.id)
        assert refused.value.body["code"] == "file_not_found"
    for call in (theirs.batches.retrieve, theirs.batches.cancel):
        with pytest.raises(openai.NotFoundError) as refused:
            await call(batch.id)
        assert refused.value.body["code"] == "batch_not_found"
    with pytest.raises(openai.NotFoundError) as refused:  # a batch on a file of another org
        await theirs.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert refused.value.body["code"] == "file_not_found"
    assert (await theirs.batches.list()).data == [] and (await theirs.files.list()).data == []
    assert (await ended(mine, batch.id)).status == "completed"


async def test_a_batch_needs_a_known_endpoint_window_and_a_batch_file(gw):
    client = gw.openai()
    upload, batch = await submitted(client, [line(0)])
    batch = await ended(client, batch.id)
    for create, param in (({"endpoint": "/v1/messages"}, "endpoint"),
                          ({"completion_window": "1h"}, "completion_window"),
                          ({"input_file_id": batch.output_file_id}, "input_file_id"),
                          ({"metadata": {"k": 1}}, "metadata")):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.batches.create(**{"input_file_id": upload.id, "endpoint": "/v1/completions",
                                           "completion_window": "24h", **create})
        assert refused.value.body["param"] == param
    assert len((await client.batches.list()).data) == 1


async def test_cancel_of_a_finished_batch_changes_nothing(gw):
    client = gw.openai()
    _, batch = await submitted(client, [line(0)])
    done = await ended(client, batch.id)
    assert (await client.batches.cancel(batch.id)) == done
    assert (await client.batches.retrieve(batch.id)) == done


async def test_list_pages_newest_first(gw):
    client = gw.openai()
    ids = [(await submitted(client, [line(i)]))[1].id for i in range(3)]
    first = await client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:0:-1] and first.has_more
    rest = await client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == ids[:1] and not rest.has_more
    assert [b.id async for b in client.batches.list(limit=1)] == ids[::-1]  # the SDK's own paging
    async with gw.session.get(f"{gw.url}/v1/batches?limit=0", headers=gw.headers()) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "limit"


@pytest.fixture
async def gated():
    async with GatedUpstream() as upstream:
        yield upstream


def on(upstream, **batches):
    def configure(config):
        config["models"][0]["upstreams"] = [upstream.url]
        config["batches"] = {"max_in_flight": 1, **batches}
    return configure


async def test_cancel_lets_lines_in_flight_finish_and_runs_no_other(harness, store, gated):
    async with harness(overrides=store, configure=on(gated)) as h:
        client = h.openai()
        _, batch = await submitted(client, [line(i) for i in range(3)])
        await gated.arrivals(1)  # line 0 is in flight (max_in_flight = 1)
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and isinstance(cancelling.cancelling_at, int)
        await gated.allow(1)
        batch = await ended(client, batch.id)
        assert batch.status == "cancelled" and isinstance(batch.cancelled_at, int)
        assert batch.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 0}
        out = jsonl_lines((await client.files.content(batch.output_file_id)).text)
        assert [o["custom_id"] for o in out] == ["line-0"] and batch.error_file_id is None
        assert gated.arrived == 1 and len(await h.rows(batch_id=batch.id)) == 1


async def test_past_its_window_a_batch_expires_and_its_lines_not_run_are_errors(harness, gated):
    async with harness(configure=on(gated)) as h:
        client = h.openai()
        _, batch = await submitted(client, [line(i) for i in range(3)])
        await gated.arrivals(1)
        conn = sqlite3.connect(h.db)  # the window passes (24 h, as OpenAI's)
        with conn:
            conn.execute("UPDATE kiln_batches SET expires_at = 0 WHERE id = ?", (batch.id,))
        conn.close()
        h.app[BATCHES].runner.wake()
        await gated.allow(1)
        batch = await ended(client, batch.id)
        assert batch.status == "expired" and isinstance(batch.expired_at, int)
        assert batch.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
        assert [o["custom_id"] for o in jsonl_lines((await client.files.content(batch.output_file_id)).text)] == [
            "line-0"]
        errors = jsonl_lines((await client.files.content(batch.error_file_id)).text)
        assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
            ("line-1", None, "batch_expired"), ("line-2", None, "batch_expired")]
        assert gated.arrived == 1


async def test_a_line_refused_for_a_while_is_tried_again(harness, gated):
    """429 (the org's one slot taken by an interactive request): the line waits and runs once it is free."""
    def configure(config):
        on(gated)(config)
        config["orgs"][0]["max_in_flight"] = 1

    async with harness(configure=configure) as h:
        client = h.openai()
        interactive = asyncio.create_task(client.completions.create(**line(9)["body"]))
        await gated.arrivals(1)
        _, batch = await submitted(client, [line(0)])
        refused = await eventually_rows(h, batch.id, 1)
        assert refused[0]["status"] == 429 and refused[0]["cost"] == 0
        await gated.allow(2)
        await interactive
        batch = await ended(client, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 1
        rows = await h.rows(batch_id=batch.id)
        assert [r["status"] for r in rows] == [429, 200]  # each attempt one row
        (out,) = jsonl_lines((await client.files.content(batch.output_file_id)).text)
        assert out["response"]["request_id"] == rows[1]["id"]


async def eventually_rows(h, batch_id, n):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while len(rows := await h.rows(batch_id=batch_id)) < n:
        assert loop.time() < deadline
        await asyncio.sleep(0.01)
    return rows



async def test_a_file_of_several_chunks_is_stored_and_read_in_chunks(gw):
    client = gw.openai()
    data = bytes(range(256)) * (10 * 1024 + 7)  # 2.5 MiB and a bit: three chunks of at most 1 MiB
    upload = await client.files.create(file=("big.jsonl", data), purpose="batch")
    assert upload.bytes == len(data)
    conn = sqlite3.connect(gw.db)
    try:
        sizes = [n for (n,) in conn.execute("SELECT length(data) FROM kiln_file_chunks WHERE file_id = ? ORDER BY seq",
                                            (upload.id,))]
    finally:
        conn.close()
    assert sizes == [1024 * 1024, 1024 * 1024, len(data) - 2 * 1024 * 1024]
    async with gw.session.get(f"{gw.url}/v1/files/{upload.id}/content", headers=gw.headers()) as resp:
        assert resp.headers["Content-Length"] == str(len(data))
        assert await resp.read() == data


async def test_the_runners_credential_cannot_be_forged(gw):
    """Only this process's secret, naming a batch it runs, stands for a key; anything like it is 401."""
    client = gw.openai()
    _, batch = await submitted(client, [line(0)])
    batch = await ended(client, batch.id)
    credential = gw.gw.batch_credential
    real = credential.header(batch.id, "gen-000000000000aaaaaaaaaaaa")
    forged = [real.replace(real.split(".")[1], "0" * 64),  # another secret
              "Bearer kiln-batch." + real.split(".", 1)[1],  # (the real one, but the batch has ended)
              "Bearer kiln-batch.", "Bearer kiln-batch.x.y.z"]
    for header in forged:
        async with gw.session.post(f"{gw.url}/v1/completions", json=line(1)["body"],
                                   headers={"Authorization": header}) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    assert len(await gw.rows()) == 1  # the batch's line only: a refused key has no row
