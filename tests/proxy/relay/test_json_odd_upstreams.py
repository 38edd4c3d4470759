"""Non-streamed answers of upstreams that bend HTTP or the format, through a running gateway: what the
client gets and the usage row. Each upstream answers one request per connection with the bytes given."""

import gzip
import logging

import orjson
import pytest
from raw_upstreams import answering, http
from rawhttp import exchange_all, request

from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.testing import KEY, MODEL
from kilnproxy.usage import COLUMNS, MAX_TOKENS

ANSWER = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "up",
          "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


async def answered(harness, raw: bytes) -> tuple[int, dict, bytes, dict]:
    """Status, headers and body the client got for the upstream's ``raw``, and the request's row."""
    async with answering(raw) as url:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
            async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi"}) as resp:
                body = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
                return resp.status, dict(resp.headers), body, row


@pytest.mark.parametrize("usage, shown, counts", [
    ({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 2**63},
     {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": MAX_TOKENS}, (10, 5, MAX_TOKENS, 0)),
    ({"prompt_tokens": 2**63 - 1, "completion_tokens": 1},
     {"prompt_tokens": MAX_TOKENS, "completion_tokens": 1}, (MAX_TOKENS, 1, MAX_TOKENS, 0)),
    ({"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2**64 - 1}},
     {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": MAX_TOKENS}},
     (10, 5, 15, MAX_TOKENS)),
])
async def test_counts_beyond_what_a_row_holds_are_capped_alike_in_the_answer_and_the_row(harness, usage, shown,
                                                                                          counts):
    status, _, body, row = await answered(harness, http(orjson.dumps({**ANSWER, "usage": usage})))
    assert status == 200 and orjson.loads(body)["usage"] == {**shown, "cost": row["cost"]}
    assert (row["prompt_tokens"], row["completion_tokens"], row["total_tokens"], row["cached_tokens"]) == counts


async def test_a_value_sqlite_cannot_bind_is_stored_as_text_and_its_batch_committed(tmp_path):
    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    try:
        rows = [{**dict.fromkeys(COLUMNS, 0), "id": f"gen-{i}", "created_at": "2026-12-01T00:00:00.000+00:00",
                 "org": "acme", "key_id": "k", "endpoint": "completions"} for i in range(3)]
        rows[1]["total_tokens"] = 2**64
        for future in [ledger.submit(row) for row in rows]:
            await future
        # bound as text, which the column's INTEGER affinity reads as the nearest REAL
        assert [(r["id"], r["total_tokens"]) for r in [await ledger.get(f"gen-{i}") for i in range(3)]] == [
            ("gen-0", 0), ("gen-1", 2.0**64), ("gen-2", 0)]
    finally:
        await ledger.close()


async def test_a_rejection_with_a_content_type_that_is_not_utf8_goes_back_as_it_came(harness):
    rejection = http(b'{"error":{"code":"ctx"}}', "400 Bad Request", Content_Type="application/json; x=\udcff")
    async with answering(rejection) as url:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
            post = request("POST", "/v1/completions", {"Authorization": f"Bearer {KEY}", "Content-Type":
                           "application/json"}, orjson.dumps({"model": MODEL, "prompt": "hi"}))
            first, second = await exchange_all(h.url, post, post)  # the kept-alive connection still serves
            rows = await h.rows()
    assert first.status == second.status == 400 and first.body == b'{"error":{"code":"ctx"}}'
    assert first.headers["content-type"] == "application/json; x=\xff"  # the byte 0xff, as sent
    assert [(r["status"], r["error_code"]) for r in rows] == [(400, "ctx")] * 2


async def test_a_gzipped_rejection_reaches_the_client_decoded(harness):
    error = b'{"error":{"message":"too long","code":"context_length_exceeded"}}'
    status, headers, body, row = await answered(
        harness, http(gzip.compress(error), "400 Bad Request", Content_Encoding="gzip"))
    assert (status, body, headers.get("Content-Encoding")) == (400, error, None)
    assert row["error_code"] == "context_length_exceeded"


async def test_an_answer_nested_deeper_than_json_can_be_written_back_is_a_bad_response(harness):
    deep = orjson.dumps(ANSWER)[:-1] + b',"extra":' + b"[" * 300 + b"]" * 300 + b"}"
    status, _, body, row = await answered(harness, http(deep))
    assert (status, row["error_code"], row["cost"]) == (502, "upstream_bad_response", 0)


async def test_an_upstream_that_switches_protocols_is_a_502_without_a_traceback(harness, caplog):
    with caplog.at_level(logging.ERROR):
        status, _, _, row = await answered(
            harness, b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nhello")
    assert status == 502 and row["status"] == 502
    assert "Traceback" not in caplog.text and "Fatal error" not in caplog.text


@pytest.mark.parametrize("usage", [None, "lots", [1, 2], "absent"])
async def test_an_answer_without_a_usage_object_carries_the_gateways_zeros(harness, usage):
    answer = {k: v for k, v in ANSWER.items() if k != "usage"} if usage == "absent" else {**ANSWER, "usage": usage}
    status, _, body, row = await answered(harness, http(orjson.dumps(answer)))
    assert status == 200
    assert orjson.loads(body)["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cost": 0.0}
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (0, 0, 0)


async def test_a_finish_reason_that_is_not_a_string_is_stored_as_its_json(harness):
    answer = {**ANSWER, "choices": [{"index": 0, "text": "hi", "finish_reason": {"x": 1}}]}
    _, _, _, row = await answered(harness, http(orjson.dumps(answer)))
    assert row["finish_reason"] == '{"x":1}'


@pytest.mark.parametrize("coding", ["identity", "Identity"])
async def test_a_body_without_length_nor_chunks_ends_with_the_connection(harness, coding):
    status, _, body, row = await answered(
        harness, http(orjson.dumps(ANSWER), Content_Length="", Transfer_Encoding=coding))
    assert status == 200 and orjson.loads(body)["choices"][0]["text"] == "hi"
    assert (row["error_code"], row["completion_tokens"]) == (None, 5)


@pytest.mark.parametrize("code, stored", [
    ("a\u0000b", "a\ufffdb"),  # PostgreSQL's text cannot hold a NUL: the row would never settle
    ("c" * 100_000, "c" * 255 + "…"),
])
async def test_an_upstreams_error_code_is_stored_as_other_text_from_outside(harness, store, committed, code, stored):
    body = orjson.dumps({"error": {"message": "no", "type": "invalid_request_error", "code": code}})
    async with answering(http(body, status="400 Bad Request")) as url, \
            harness(overrides=store, configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == code  # the client gets the upstream's own
        [row] = await committed(h, 1)
    assert (row["status"], row["error_code"]) == (400, stored)
