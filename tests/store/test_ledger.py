"""The usage ledger: one row per request with a known key, whatever way it ends (usage accounting (docs/reference.md))."""

import asyncio
from datetime import datetime, timedelta, timezone

import orjson
import pytest

from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import KEY, MODEL, OTHER_KEY
from kilnproxy.testing import completion_body as body
from kilnproxy.usage import COLUMNS, round_usd

GEN = "X-Neocloud-Generation-Id"
PRICE = {"prompt": 0.10, "completion": 0.30, "cached_prompt": 0.05}  # the Harness model, USD per million


def price(prompt, completion, cached=0):
    return round_usd(((prompt - cached) * PRICE["prompt"] + cached * PRICE["cached_prompt"]
                      + completion * PRICE["completion"]) / 1_000_000)



async def read_stream(resp) -> list:
    """The parsed data events of an SSE body, ``"[DONE]"`` included."""
    events = []
    for line in (await resp.read()).split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[6:]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


def assert_row_shape(row, *, endpoint="completions", stream=0, status=200, error_code=None):
    assert set(row) == set(COLUMNS)
    created = datetime.fromisoformat(row["created_at"])
    assert created.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - created) < timedelta(minutes=5)
    assert row["org"] == "acme" and row["key_id"] == "acme-key" and KEY not in row.values()
    assert (row["endpoint"], row["stream"], row["status"], row["error_code"]) == (endpoint, stream, status,
                                                                                 error_code)
    assert row["duration_ms"] >= 0
    assert row["disconnected"] == 0


async def test_non_streamed_200_row_matches_what_the_client_saw(gw):
    async with gw.post("/v1/completions", body()) as resp:
        answer = await resp.json()
        gen_id = resp.headers[GEN]
    row = await gw.row(gen_id)  # committed by the time the response ended
    assert_row_shape(row)
    assert row["model"] == MODEL
    usage = answer["usage"]
    assert (row["prompt_tokens"], row["completion_tokens"], row["total_tokens"], row["cached_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"], 0) == (5, 4, 9, 0)
    assert row["cost"] == usage["cost"] == price(5, 4)
    assert row["finish_reason"] == "length"
    assert row["ttft_ms"] is not None and 0 <= row["ttft_ms"] <= row["duration_ms"]


async def test_streamed_chat_200_row_matches_what_the_client_saw(gw):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    async with gw.post("/v1/chat/completions", chat) as resp:
        gen_id = resp.headers[GEN]
        events = await read_stream(resp)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    row = await gw.row(gen_id)
    assert_row_shape(row, endpoint="chat/completions", stream=1)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage["prompt_tokens"], 3)
    assert row["cost"] == usage["cost"] == price(usage["prompt_tokens"], 3)
    assert row["finish_reason"] == "length"
    assert row["ttft_ms"] is not None


async def test_cached_tokens_are_priced_at_cached_prompt(gw):
    async with gw.post("/v1/completions", body(mock={"cached_tokens": 3})) as resp:
        usage = (await resp.json())["usage"]
        gen_id = resp.headers[GEN]
    async with gw.post("/v1/completions", body(stream=True, mock={"cached_tokens": 3})) as resp:
        stream_usage = (await read_stream(resp))[-2]["usage"]
        stream_id = resp.headers[GEN]
    for gid, seen in ((gen_id, usage), (stream_id, stream_usage)):
        row = await gw.row(gid)
        assert row["cached_tokens"] == seen["prompt_tokens_details"]["cached_tokens"] == 3
        assert row["cost"] == seen["cost"] == price(5, 4, cached=3) < price(5, 4)


async def test_streamed_row_without_include_usage_is_still_priced(gw):
    async with gw.post("/v1/completions", {**body(), "stream": True}) as resp:
        events = await read_stream(resp)
        gen_id = resp.headers[GEN]
    assert all("usage" not in e or e["usage"] is None for e in events[:-1])
    row = await gw.row(gen_id)
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (5, 4, price(5, 4))


async def test_no_row_for_an_unknown_or_missing_key(gw):
    async with gw.post("/v1/completions", body(), key="sk-nobody") as resp:
        assert resp.status == 401
        assert GEN not in resp.headers
    async with gw.session.post(f"{gw.url}/v1/completions", json=body()) as resp:
        assert resp.status == 401
    assert await gw.rows() == []


@pytest.mark.parametrize("case", ["not_json", "not_object", "no_model", "bad_stream", "options_no_stream",
                                  "chat_param"])
async def test_400_of_the_gateway_is_recorded(gw, case):
    path, kwargs, code = "/v1/completions", {}, "invalid_request"
    if case == "not_json":
        kwargs["data"] = b"{nope"
    elif case == "not_object":
        kwargs["json"] = [1, 2]
    elif case == "no_model":
        kwargs["json"] = {"prompt": "hi"}
    elif case == "bad_stream":
        kwargs["json"] = {**body(), "stream": "yes"}
    elif case == "options_no_stream":
        kwargs["json"] = body(stream_options={"include_usage": True})
    else:
        path, code = "/v1/chat/completions", "unsupported_parameter"
        kwargs["json"] = {"model": MODEL, "messages": [], "ignore_eos": True}
    async with gw.session.post(gw.url + path, headers=gw.headers(), **kwargs) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == code
        gen_id = resp.headers[GEN]
    row = await gw.row(gen_id)
    assert (row["status"], row["error_code"], row["cost"]) == (400, code, 0)
    assert row["endpoint"] == path.removeprefix("/v1/")
    assert await gw.mock_requests() == []


async def test_404_unknown_model_is_recorded_with_the_asked_model(gw):
    async with gw.post("/v1/completions", {**body(), "model": "no-such-model"}) as resp:
        assert resp.status == 404
        gen_id = resp.headers[GEN]
    row = await gw.row(gen_id)
    assert (row["status"], row["error_code"], row["model"], row["cost"]) == (404, "model_not_found",
                                                                           "no-such-model", 0)


async def test_403_disabled_key_and_model_outside_the_allow_list(harness):
    keys = [{"key": KEY, "org": "acme", "id": "acme-key", "models": ["other-model"]},
            {"key": "sk-off", "org": "acme", "id": "acme-off", "disabled": True}]
    models = [{"id": m, "upstreams": ["http://127.0.0.1:9/v1"]} for m in (MODEL, "other-model")]
    async with harness(overrides={"keys": keys, "models": models}) as h:
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 403
            not_allowed = resp.headers[GEN]
        async with h.post("/v1/completions", body(), key="sk-off") as resp:
            assert resp.status == 403
            disabled = resp.headers[GEN]
        assert await h.mock_requests() == []
        row = await h.row(not_allowed)
        assert (row["status"], row["error_code"], row["key_id"], row["model"]) == (403, "forbidden", "acme-key",
                                                                                 MODEL)
        row = await h.row(disabled)
        assert (row["status"], row["error_code"], row["key_id"], row["org"]) == (403, "forbidden", "acme-off",
                                                                               "acme")


async def test_503_maintenance_and_413_are_recorded(harness):
    overrides = {"maintenance": {"enabled": True, "retry_after": "Mon, 30 Nov 2026 06:00:00 GMT"}}
    async with harness(overrides=overrides) as h:
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "Mon, 30 Nov 2026 06:00:00 GMT"
            row = await h.row(resp.headers[GEN])
        assert (row["status"], row["error_code"]) == (503, "maintenance")
    async with harness(overrides={"server": {"max_request_bytes": 1000}}) as h:
        async with h.post("/v1/completions", body(prompt="x" * 2000)) as resp:
            assert resp.status == 413
            row = await h.row(resp.headers[GEN])
        assert (row["status"], row["error_code"]) == (413, "request_too_large")
        assert await h.mock_requests() == []


async def test_upstream_400_passthrough_is_recorded(gw):
    async with gw.post("/v1/completions", body(temperature=5)) as resp:
        assert resp.status == 400
        assert "temperature" in (await resp.json())["error"]["message"]
        gen_id = resp.headers[GEN]
    row = await gw.row(gen_id)
    assert row["status"] == 400 and row["error_code"] and row["cost"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_502_is_recorded(gw, stream):
    async with gw.post("/v1/completions", body(stream=stream, mock={"fail": "500"})) as resp:
        assert resp.status == 502
        assert resp.content_type == "text/plain"
        gen_id = resp.headers[GEN]
    row = await gw.row(gen_id)
    assert (row["status"], row["stream"], row["cost"]) == (502, int(stream), 0)
    assert row["error_code"]


@pytest.mark.parametrize("fail", ["error_event", "drop"])
async def test_mid_stream_upstream_failure_is_recorded_and_charged(gw, fail):
    async with gw.post("/v1/completions", body(stream=True, max_tokens=8, mock={"fail": fail, "after": 3})) as resp:
        events = await read_stream(resp)
        gen_id = resp.headers[GEN]
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert sum(1 for e in events if isinstance(e, dict) and e.get("choices")) == 3
    row = await gw.row(gen_id)
    assert (row["status"], row["stream"], row["disconnected"]) == (200, 1, 0)
    assert row["error_code"] is not None
    assert (row["prompt_tokens"], row["completion_tokens"]) == (6, 3)  # estimated: 24 chars / 4; 3 chunks streamed
    assert row["cost"] == price(6, 3)


async def test_429_is_recorded(harness, eventually):
    async with harness(overrides={"orgs": [{"id": "acme", "credits": 100.0, "max_in_flight": 1},
                                           {"id": "globex", "credits": 100.0}]}) as h:
        hanging = asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(),
                                                     json=body(mock={"fail": "hang"})))
        await eventually(lambda: h.app[GATEWAY].admission.count("acme") == 1)
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 429
            row = await h.row(resp.headers[GEN])
        assert (row["status"], row["error_code"], row["cost"]) == (429, "rate_limit_exceeded", 0)
        hanging.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hanging
        await h.mock_wait(hangups=1)
        await eventually(lambda: h.app[GATEWAY].admission.count("acme") == 0)
        await eventually(lambda: h.app[GATEWAY].ledger.queue_depth() == 0 and _rows(h, 2))


async def _rows(h, n):
    return len(await h.rows()) == n


async def test_client_disconnect_mid_stream(gw, eventually):
    """The upstream is hung up on at once; the row says disconnected, with what was streamed, charged."""
    resp = await gw.post("/v1/completions", body(stream=True, max_tokens=10, mock={"fail": "stall", "after": 3}))
    gen_id = resp.headers[GEN]
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += await resp.content.readany()
    resp.close()  # hang up mid-stream
    stats = await gw.mock_wait(hangups=1)
    assert stats["hangups"] == 1 and stats["open"] == 0
    rows = await eventually(gw.rows)
    assert [r["id"] for r in rows] == [gen_id]
    row = rows[0]
    assert (row["status"], row["stream"], row["disconnected"]) == (200, 1, 1)
    assert row["completion_tokens"] == 3
    assert row["prompt_tokens"] == 6  # estimated from the prompt: the upstream never reported usage
    assert row["cost"] == price(6, 3) > 0
    assert row["finish_reason"] is None
    assert gw.app[GATEWAY].credits.spent["acme"] == row["cost"]


async def test_client_disconnect_before_a_non_streamed_answer(gw, eventually):
    task = asyncio.create_task(gw.session.post(f"{gw.url}/v1/completions", headers=gw.headers(),
                                               json=body(mock={"fail": "hang"})))
    await eventually(lambda: gw.app[GATEWAY].admission.count("acme") == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await gw.mock_wait(hangups=1))["hangups"] == 1  # the upstream request was closed
    rows = await eventually(gw.rows)
    assert len(rows) == 1
    row = rows[0]
    assert (row["stream"], row["disconnected"], row["completion_tokens"]) == (0, 1, 0)
    assert row["status"] == 499  # nothing was sent: nginx's "client closed request"
    assert gw.app[GATEWAY].admission.count("acme") == 0


async def test_row_id_is_the_generation_header_and_rows_are_unique(gw):
    ids = set()
    for stream in (False, True, False, True):
        async with gw.post("/v1/completions", body(stream=stream)) as resp:
            await resp.read()
            ids.add(resp.headers[GEN])
    assert len(ids) == 4
    assert {r["id"] for r in await gw.rows()} == ids


async def test_group_commit_uses_fewer_transactions_than_rows(harness):
    async with harness(overrides={"limits": {"max_in_flight_per_org": 64}}) as h:
        await _group_commit(h)


async def _group_commit(gw):
    ledger = gw.app[GATEWAY].ledger
    before = ledger.commits

    async def one(i):
        async with gw.post("/v1/completions", body(stream=bool(i % 2))) as resp:
            await resp.read()
            return resp.status

    statuses = await asyncio.gather(*(one(i) for i in range(64)))
    assert statuses == [200] * 64
    assert len(await gw.rows()) == 64
    commits = ledger.commits - before
    assert 1 <= commits < 64
    assert ledger.queue_depth() == 0
    assert ledger.last_commit_seconds > 0


async def test_openai_sdk_sees_the_same_cost_as_the_row(gw):
    client = gw.openai()
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt="Hello there", max_tokens=5)
    completion = raw.parse()
    row = await gw.row(raw.headers[GEN])
    assert row["cost"] == completion.usage.model_extra["cost"] == price(2, 5)


async def test_other_org_rows_are_charged_to_it(gw):
    async with gw.post("/v1/completions", body(), key=OTHER_KEY) as resp:
        row = await gw.row(resp.headers[GEN])
    assert (row["org"], row["key_id"]) == ("globex", "globex-key")


async def test_chat_disconnect_counts_content_chunks_not_the_role_chunk(gw, eventually):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 10,
            "stream": True, "mock": {"fail": "stall", "after": 3}}
    resp = await gw.post("/v1/chat/completions", chat)
    seen = b""
    while seen.count(b"data: ") < 3:  # the role chunk, then two words
        seen += await resp.content.readany()
    assert b'"role":"assistant"' in seen.split(b"\n\n")[0]
    resp.close()
    await gw.mock_wait(hangups=1)
    row = (await eventually(gw.rows))[0]
    assert (row["disconnected"], row["completion_tokens"]) == (1, 2)


async def test_a_gateway_bug_mid_stream_still_writes_one_row_and_ends_the_stream(gw, monkeypatch, eventually):
    """An unexpected exception once the stream has begun: the client gets an ``internal_error`` event and
    ``[DONE]`` (never a second HTTP response inside the first), the row says internal_error."""
    from kilnproxy.proxy import stream_writer as stream_module

    class Broken(stream_module.EventRelay):
        calls = 0

        def feed_chunk(self, chunk):
            Broken.calls += 1
            if Broken.calls == 2:
                raise ZeroDivisionError("a bug")
            return super().feed_chunk(chunk)

    monkeypatch.setattr(stream_module, "EventRelay", Broken)
    async with gw.post("/v1/completions", body(stream=True, max_tokens=8, mock={"delay": 0.01})) as resp:
        assert resp.status == 200
        gen_id = resp.headers[GEN]
        raw = await resp.read()
    assert raw.endswith(b'data: {"error":{"message":"The gateway failed unexpectedly; see its log.",'
                        b'"type":"server_error","param":null,"code":"internal_error"}}\n\ndata: [DONE]\n\n')
    frames = raw.split(b"\n\n")[:-1]  # the first chunk's events, the error, [DONE]
    assert len(frames) >= 3 and all(b'"choices"' in frame for frame in frames[:-2])
    row = await eventually(lambda: _row_or_none(gw, gen_id))
    assert (row["status"], row["error_code"], row["disconnected"]) == (200, "internal_error", 0)
    assert gw.app[GATEWAY].admission.count("acme") == 0


async def _row_or_none(h, generation_id):
    rows = await h.rows(id=generation_id)
    return rows[0] if rows else None
