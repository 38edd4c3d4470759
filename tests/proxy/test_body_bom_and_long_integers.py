"""Request bodies the model servers read and orjson alone would not read as they do, through a running
gateway on a real port, what the upstream received read from its raw bytes.

* A body that begins with a UTF-8 byte order mark: vLLM (its Python reads the body's bytes with the json
  module, which skips one) and llama.cpp (its JSON reader skips one at the start) both take it; the
  gateway does too, and sends the body on without it.
* An integer beyond 64 bits (a JSON schema's bound, a seed): orjson reads one as a float, which would go
  upstream as another number (``1.8446744073709552e+19``); vLLM reads it whole. The gateway sends the
  client's digits on.
"""

from __future__ import annotations

import json
import math
from contextlib import asynccontextmanager

import orjson
import pytest
from rawhttp import exchange, raw_server, read_request, request

from kilnproxy.proxy.relay import event_json
from kilnproxy.testing import KEY, MODEL, UPSTREAM_MODEL, completion_body

BOM = b"\xef\xbb\xbf"
ANSWER = orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "up",
                       "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
COST = round(10 * 0.10 / 1e6 + 5 * 0.30 / 1e6, 10)


@asynccontextmanager
async def recording():
    """An upstream that answers every request with ``ANSWER``: its base URL and the bodies it received."""
    bodies: list[bytes] = []

    async def serve(reader, writer):
        _, body = await read_request(reader)
        bodies.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(ANSWER)).encode() + b"\r\nConnection: close\r\n\r\n" + ANSWER)
        await writer.drain()
        writer.close()

    async with raw_server(serve) as url:
        yield url, bodies


async def post(harness, raw: bytes, path: str = "/v1/completions"):
    """``raw`` sent as it is: the client's response, the row, and the bodies the upstream received."""
    async with recording() as (url, bodies):
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
            answer = await exchange(h.url, request("POST", path, {"Authorization": f"Bearer {KEY}",
                                                                  "Content-Type": "application/json"}, raw))
            row = await h.row(answer.headers["x-neocloud-generation-id"])
    return answer, row, bodies


@pytest.mark.parametrize("sent", [
    {"model": MODEL, "prompt": "hi", "max_tokens": 5},
    {"model": MODEL, "prompt": "Paris is \ud83d", "max_tokens": 5},  # and a lone surrogate's escape
], ids=["plain", "lone surrogate"])
async def test_a_body_after_a_byte_order_mark_is_read_and_sent_on_without_it(harness, sent):
    answer, row, (forwarded,) = await post(harness, BOM + json.dumps(sent).encode())
    assert answer.status == 200, answer.body
    assert answer.json()["usage"]["cost"] == COST
    assert (row["status"], row["error_code"], row["cost"]) == (200, None, COST)
    assert not forwarded.startswith(BOM)
    assert json.loads(forwarded) == {**sent, "model": UPSTREAM_MODEL}


@pytest.mark.parametrize("raw", [BOM, BOM + b"{not json", BOM + BOM + b'{"model": "test-model"}',
                                 b' \xef\xbb\xbf{"model": "test-model"}'])
async def test_a_byte_order_mark_before_what_is_not_json_is_a_400(harness, raw):
    answer, row, bodies = await post(harness, raw)
    assert answer.status == 400 and answer.error_code == "invalid_request"
    assert answer.json()["error"]["message"].startswith("The request body is not valid JSON: ")
    assert (row["status"], row["error_code"]) == (400, "invalid_request") and bodies == []


LONG = {  # name: the integer as the client wrote it
    "seed": b"18446744073709551616",  # 2**64: orjson reads 1.8446744073709552e+19
    "below": b"-9223372036854775809",  # -2**63 - 1, 19 digits
    "u64_max": b"18446744073709551615",  # orjson reads it whole too
    "long": b"123456789012345678901234567890",
}


async def test_an_integer_beyond_64_bits_goes_upstream_as_the_client_wrote_it(harness):
    schema = b'{"type": "integer", "maximum": 99999999999999999999999}'
    raw = (b'{"model": "test-model", "prompt": "0123456789012345678901234", "max_tokens": 5, '
           + b", ".join(b'"%s": %s' % (name.encode(), digits) for name, digits in LONG.items())
           + b', "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": '
           + schema + b"}}}")
    answer, row, (forwarded,) = await post(harness, raw)
    assert answer.status == 200, answer.body
    assert (row["status"], row["error_code"], row["cost"]) == (200, None, COST)
    for name, digits in LONG.items():
        assert b'"%s":%s' % (name.encode(), digits) in forwarded
    assert b'"maximum":99999999999999999999999' in forwarded
    assert json.loads(forwarded) == {**json.loads(raw), "model": UPSTREAM_MODEL}


@pytest.mark.parametrize("raw", [
    b'{"model": "test-model", "prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}",
    b'{"model": "test-model", "prompt": "\\ud83d", "max_tokens": 1' + b"0" * 400 + b"}",
], ids=["plain", "lone surrogate"])
async def test_an_integer_beyond_a_double_is_not_json_as_before(harness, raw):
    answer, row, bodies = await post(harness, raw)
    assert answer.status == 400 and answer.error_code == "invalid_request", answer.body
    with pytest.raises(orjson.JSONDecodeError) as refusal:
        orjson.loads(raw)
    assert answer.json()["error"]["message"] == f"The request body is not valid JSON: {refusal.value}"
    assert (row["status"], row["error_code"]) == (400, "invalid_request") and bodies == []


async def test_digits_that_are_no_long_integer_never_reach_the_json_module(harness, monkeypatch):
    """Numbers and digits in strings, short runs 9 bytes apart included: orjson's reading stands."""
    class Refused:
        def __getattr__(self, name):
            raise AssertionError(f"json.{name} was used")

    monkeypatch.setattr(event_json, "json", Refused())
    raw = (b'{"model": "test-model", "prompt": "12345678 12345678 123456789012345678x 2024-12-02", '
           b'"max_tokens": 5, "seed": 922337203685477580, "temperature": 0.12345678901234567}')
    answer, row, (forwarded,) = await post(harness, raw)
    assert answer.status == 200 and row["status"] == 200
    assert orjson.loads(forwarded) == {**orjson.loads(raw), "model": UPSTREAM_MODEL}


def test_the_sample_finds_every_run_of_19_digits():
    """Wherever a run of 19 digits begins, every 9th byte shows two digits in a row."""
    from kilnproxy.proxy.relay.event_json import DIGITS, LONG_RUN, SAMPLE
    for start in range(2 * SAMPLE):
        raw = b" " * start + b"1" * LONG_RUN + b" " * 20
        assert b"00" in raw[::SAMPLE].translate(DIGITS), start



def no_window(config: dict) -> None:
    """The test model without a context window (its hold then counts ``max_tokens`` as sent), its completion
    tokens at a million USD per million."""
    model = config["models"][0]
    del model["context_window"]
    model["pricing"]["completion"] = 1e6


async def test_a_huge_max_tokens_is_held_as_a_finite_amount(harness):
    """An integer ``max_tokens`` just below a double's limit, for two prompts: its hold is the most tokens a
    count may be (``usage.MAX_TOKENS``) for each, not ``inf``, which once taken from the org's holds while
    another request holds some made them ``nan`` (and ``nan`` refuses nothing)."""
    huge = b'{"model": "test-model", "prompt": ["hi", "hi"], "max_tokens": 1' + b"0" * 307 + b"}"
    async with harness(configure=no_window) as h:
        gate = h.gw.admission
        async with h.post("/v1/completions", completion_body(stream=True, prompt="hi", max_tokens=2,
                                                             mock={"delay": 30})) as slow:
            assert slow.status == 200  # admitted, its hold placed
            alone = gate.held("acme")
            answer = await exchange(h.url, request("POST", "/v1/completions", {"Authorization": f"Bearer {KEY}"},
                                                   huge))
            assert answer.status == 400  # the mock, like vLLM, refuses such a max_tokens
            after = gate.held("acme")
            # a number again, the slow request's hold, but for what a sum with 1.8e16 rounds off (its ulp: 2)
            assert math.isfinite(after) and abs(after - alone) <= 4, (after, alone)
