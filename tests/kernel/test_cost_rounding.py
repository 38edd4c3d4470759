"""``cost`` is rounded to a fixed number of decimals (kilnproxy.usage.COST_DECIMALS) wherever a
client or the ledger sees it: 1 prompt token and 5 completion tokens at 0.10/0.30 USD per million
are 1.6e-06 USD, which floating point computes as 1.6000000000000001e-06."""

import orjson
from rawhttp import exchange, request

from kilnproxy.testing import completion_body

EXPECTED = 1.6e-06
BODY = completion_body(prompt="hi", max_tokens=5)


async def test_cost_is_rounded_in_answers_rows_and_credits(gw):
    async with gw.post("/v1/completions", BODY) as resp:
        raw = await resp.read()
        first = resp.headers["X-Neocloud-Generation-Id"]
    assert b'"cost":1.6e-6}' in raw, raw
    assert orjson.loads(raw)["usage"]["cost"] == EXPECTED

    async with gw.post("/v1/completions", {**BODY, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        raw = await resp.read()
        second = resp.headers["X-Neocloud-Generation-Id"]
    usage_event = [line for line in raw.split(b"\n\n") if b'"choices":[]' in line]
    assert len(usage_event) == 1 and b'"cost":1.6e-6}' in usage_event[0], raw

    assert [(await gw.row(g))["cost"] for g in (first, second)] == [EXPECTED, EXPECTED]
    credits = (await exchange(gw.url, request("GET", "/v1/credits", gw.headers()))).json()
    assert (credits["spent"], credits["remaining"]) == (3.2e-06, 99.9999968)
