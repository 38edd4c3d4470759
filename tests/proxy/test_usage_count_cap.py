"""Usage counts beyond 2**53 - 1 (docs/reference.md, the usage table): an upstream may report any integer,
and llama.cpp's ``n`` choices each their own count, whose sum the gateway makes. Each count the gateway
reports and stores is capped at 2**53 - 1 (``usage.MAX_TOKENS``), its cost computed from the capped
counts: the client's usage object or chunk and the row say the same, and neither store refuses the row
(SQLite kept a count past 2**63 - 1 as text, PostgreSQL's BIGINT refused the settlement)."""

from __future__ import annotations

import orjson
import pytest

from kilnproxy.testing import MODEL, completion_body
from kilnproxy.usage import MAX_TOKENS, Usage, cap_counts

COST = round((MAX_TOKENS * 0.10 + MAX_TOKENS * 0.30) / 1e6, 10)  # the test model's prices, per million tokens
CAPPED = {"prompt_tokens": MAX_TOKENS, "completion_tokens": MAX_TOKENS, "total_tokens": MAX_TOKENS, "cost": COST}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 3}
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}


def usage_chunks(raw: bytes) -> list[dict]:
    events = [orjson.loads(f[6:]) for f in raw.split(b"\n\n") if f.startswith(b"data: {")]
    return [e for e in events if e.get("usage")]


@pytest.mark.parametrize("path, body", [
    # a JSON answer's integer beyond 64 bits is read exactly (2**70)
    ("/v1/completions", completion_body(max_tokens=3, mock={"usage_tokens": str(2**70)})),
    ("/v1/chat/completions", {**CHAT, "mock": {"usage_tokens": str(2**70)}}),
    # a streamed event's integer is read as one up to 2**64 - 1 (orjson)
    ("/v1/completions", completion_body(max_tokens=3, **STREAMED, mock={"usage_tokens": str(2**64 - 1)})),
    ("/v1/chat/completions", {**CHAT, **STREAMED, "mock": {"usage_tokens": str(2**64 - 1)}}),
    # llama.cpp's choices, each reporting its own: their sum
    ("/v1/chat/completions", {**CHAT, **STREAMED, "n": 8, "mock": {"flavor": "llamacpp",
                                                                    "usage_tokens": str(2**64 - 1)}}),
], ids=["completions", "chat", "completions streamed", "chat streamed", "chat streamed n=8"])
async def test_counts_past_a_bigint_are_capped_alike_in_the_answer_and_the_row(harness, store, path, body):
    overrides = {**store, "orgs": [{"id": "acme", "credits": 1e12}, {"id": "globex", "credits": 100.0}]}
    async with harness(overrides=overrides) as h:
        async with h.post(path, body) as resp:
            raw = await resp.read()
            generation_id = resp.headers["X-Neocloud-Generation-Id"]
        assert resp.status == 200, raw
        if body.get("stream"):
            (chunk,) = usage_chunks(raw)
            usage = chunk["usage"]
        else:
            usage = orjson.loads(raw)["usage"]
        assert {k: usage[k] for k in CAPPED} == CAPPED
        rows = await h.rows()
        assert len(rows) == 1
        row = rows[0]
        assert (row["id"], row["status"], row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"],
                row["total_tokens"], row["cost"]) == (generation_id, 200, MAX_TOKENS, MAX_TOKENS, 0, MAX_TOKENS, COST)
        assert type(row["total_tokens"]) is int  # SQLite: an integer, not text
        # the store is up: the next request is served and recorded
        async with h.post("/v1/completions", completion_body(max_tokens=2)) as resp:
            assert resp.status == 200, await resp.text()
            following = resp.headers["X-Neocloud-Generation-Id"]
        assert (await h.row(following))["completion_tokens"] == 2
        assert len(await h.rows()) == 2


def test_the_sum_of_1024_choices_counts_is_capped():
    """llama.cpp's ``n`` of at most 1024 choices (``usage.MAX_CHOICES``), each reporting 2**53 - 1: their
    completions added up and prompt + completion would pass 2**63 - 1."""
    report = Usage.from_upstream({"prompt_tokens": MAX_TOKENS, "completion_tokens": MAX_TOKENS})
    combined = Usage.combined([report] * 1024)
    assert (combined.prompt_tokens, combined.completion_tokens, combined.cached_tokens, combined.total_tokens) == \
        (MAX_TOKENS, MAX_TOKENS, 0, MAX_TOKENS)


def test_the_usage_object_is_capped_as_the_row_is_read():
    usage = {"prompt_tokens": 2**70, "completion_tokens": 7, "total_tokens": -2**70, "input_tokens": "9" * 30,
             "prompt_tokens_details": {"cached_tokens": 2**64, "other": 2.0**70}, "cost": 1e30}
    cap_counts(usage)
    assert usage == {"prompt_tokens": MAX_TOKENS, "completion_tokens": 7, "total_tokens": -2**70,
                     "input_tokens": "9" * 30, "prompt_tokens_details": {"cached_tokens": MAX_TOKENS, "other": 2.0**70},
                     "cost": 1e30}


def sse_usages(raw: bytes) -> list[dict]:
    """The usage objects of a Responses or Messages stream's events, in order."""
    usages = []
    for frame in raw.split(b"\n\n"):
        data = next((line[6:] for line in frame.split(b"\n") if line.startswith(b"data: ")), None)
        event = orjson.loads(data) if data else {}
        usage = event.get("usage", (event.get("response") or event.get("message") or {}).get("usage"))
        if usage:
            usages.append(usage)
    return usages


def serving_apis(config: dict) -> None:
    config["models"][0]["endpoints"] = ["completions", "responses", "messages"]


RESPONSES = {"input_tokens": MAX_TOKENS, "output_tokens": MAX_TOKENS, "total_tokens": MAX_TOKENS, "cost": COST}
MESSAGES_COST = round((MAX_TOKENS * 0.05 + MAX_TOKENS * 0.30) / 1e6, 10)  # the prompt all cache reads: cached_prompt
MESSAGES = {"input_tokens": MAX_TOKENS, "cache_read_input_tokens": MAX_TOKENS, "cache_creation_input_tokens": MAX_TOKENS,
            "output_tokens": MAX_TOKENS, "cost": MESSAGES_COST}


@pytest.mark.parametrize("path, body, shown, cached, cost", [
    ("/v1/responses", {"input": "one two", "max_output_tokens": 3}, RESPONSES, 0, COST),
    ("/v1/messages", {"messages": [{"role": "user", "content": "one two"}], "max_tokens": 3}, MESSAGES,
     MAX_TOKENS, MESSAGES_COST),
], ids=["responses", "messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
async def test_the_other_apis_counts_are_capped_alike_in_the_answer_and_the_row(harness, store, path, body, shown,
                                                                                 cached, cost, stream):
    """The Responses API's and Anthropic's usage objects (Anthropic's prompt the sum of three counts,
    each capped, and the sum capped again)."""
    usage_tokens = str(2**64 - 1) if stream else str(2**70)
    request = {**body, "model": MODEL, "stream": stream, "mock": {"usage_tokens": usage_tokens}}
    overrides = {**store, "orgs": [{"id": "acme", "credits": 1e12}, {"id": "globex", "credits": 100.0}]}
    async with harness(overrides=overrides, configure=serving_apis) as h:
        async with h.post(path, request) as resp:
            raw = await resp.read()
        assert resp.status == 200, raw
        usages = sse_usages(raw) if stream else [orjson.loads(raw)["usage"]]
        assert usages[-1] == shown
        assert all(v <= MAX_TOKENS for usage in usages for k, v in usage.items() if k != "cost")  # message_start's
        (row,) = await h.rows()
        assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"], row["total_tokens"],
                row["cost"]) == (MAX_TOKENS, MAX_TOKENS, cached, MAX_TOKENS, cost)
        async with h.post("/v1/completions", completion_body(max_tokens=2)) as resp:
            assert resp.status == 200, await resp.text()
        assert len(await h.rows()) == 2
