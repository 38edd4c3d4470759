"""The shipped llama.cpp recordings of the Responses API, Anthropic Messages and embeddings, replayed.

The same contract points ``make e2e`` checks live (tests/e2e/test_other_endpoints.py), on what
llama.cpp + Gemma 3 270M really sent (kilnproxy/recordings/llamacpp, recorded by
tests/e2e/test_record_replay.py). What the client must get is derived from the
recording itself:

* a stream is llama.cpp's, frame for frame: the ``event:`` lines unchanged, no
  ``[DONE]`` added, a frame the gateway has nothing to change in as llama.cpp's
  own bytes; ``model`` is the catalog id wherever llama.cpp named its own, and
  ``cost`` is added to the usage the format reports last (the Responses API:
  ``response.completed``'s ``response.usage``; Messages: the last
  ``message_delta``'s ``usage``, never ``message_start``'s);
* a JSON answer is llama.cpp's with the catalog id as ``model`` and ``usage.cost``;
* one usage row with llama.cpp's counts (Messages: the prompt is ``input_tokens``
  + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``, the reads its
  cached part), priced as the test model.
"""

from __future__ import annotations

import orjson
import pytest

from kilnproxy.testing import MODEL, RECORDINGS

FIXTURES = RECORDINGS / "llamacpp"
PRICING = {"prompt": 0.10, "completion": 0.30, "cached_prompt": 0.05}  # kilnproxy.testing's test model
ENDPOINTS = ["completions", "chat/completions", "embeddings", "responses", "messages"]
JSON_ANSWERS = ["responses", "messages", "embeddings"]
STREAMS = ["responses-stream", "messages-stream"]


def allow_every_endpoint(config: dict) -> None:
    config["models"][0]["endpoints"] = ENDPOINTS  # the test model answers completions and chat only


def cost(prompt: int, completion: int, cached: int) -> float:
    """The test model's price of these counts (USD, rounded to 10 decimals, as the gateway states it)."""
    usd = (prompt - cached) * PRICING["prompt"] + cached * PRICING["cached_prompt"] + completion * PRICING["completion"]
    return round(usd / 1e6, 10)


def counts(endpoint: str, usage: dict) -> tuple[int, int, int]:
    """Prompt, completion and cached tokens out of the format's own usage object."""
    if endpoint == "responses":
        return usage["input_tokens"], usage["output_tokens"], usage["input_tokens_details"]["cached_tokens"]
    if endpoint == "messages":
        read = usage.get("cache_read_input_tokens", 0)
        return usage["input_tokens"] + read + usage.get("cache_creation_input_tokens", 0), usage["output_tokens"], read
    return usage["prompt_tokens"], 0, 0


def split(raw: bytes) -> list[tuple[list[bytes], bytes]]:
    """An ``event:`` + ``data:`` stream as its frames: the lines before the data, and the data."""
    assert raw.endswith(b"\n\n") and b"\r" not in raw
    out = []
    for frame in raw[:-2].split(b"\n\n"):
        *lines, data = frame.split(b"\n")
        assert data.startswith(b"data: "), frame
        out.append((lines, data[6:]))
    return out


def expected_stream(endpoint: str, content: bytes) -> tuple[list[tuple[list[bytes], dict | bytes]], tuple, str]:
    """What the client must get of llama.cpp's stream (a frame's data: its bytes when the gateway has
    nothing to change in it, else the JSON it must be), the counts, and the finish reason."""
    frames, reported, finish, last_delta = [], {}, None, None
    for lines, data in split(content):
        event = orjson.loads(data)
        assert lines == [b"event: " + event["type"].encode()]  # llama.cpp names every event
        changed = orjson.loads(data)
        if endpoint == "responses":
            response = changed.get("response", {})
            if "model" in response:
                response["model"] = MODEL
            if event["type"] == "response.completed":
                usage, finish = response["usage"], response["status"]
                reported = dict(usage)
        else:
            if "message" in changed and "model" in changed["message"]:
                changed["message"]["model"] = MODEL
            usage = changed.get("usage") or changed.get("message", {}).get("usage")
            if usage:
                reported.update(usage)  # each count as last reported
            if event["type"] == "message_delta":
                finish, last_delta = event["delta"]["stop_reason"], len(frames)
        frames.append((lines, data, event, changed))
    assert reported, "llama.cpp reported no usage in this recording"
    prompt, completion, cached = counts(endpoint, reported)
    priced = cost(prompt, completion, cached)
    if endpoint == "responses":
        completed = frames[-1][3]
        assert completed["type"] == "response.completed", "llama.cpp's last event"
        completed["response"]["usage"]["cost"] = priced
    else:
        frames[last_delta][3]["usage"]["cost"] = priced
    out = [(lines, changed if changed != event else data) for lines, data, event, changed in frames]
    return out, (prompt, completion, cached, priced), finish


async def send(h, body: dict, endpoint: str):
    headers = h.headers()
    if endpoint == "messages":  # as Anthropic's SDK sends it: the key in x-api-key, the API's version
        headers = {"x-api-key": h.key, "anthropic-version": "2023-06-01"}
    async with h.session.post(f"{h.url}{h.fixtures[0].path}", json=body, headers=headers) as resp:
        return resp.status, resp.headers["Content-Type"], await resp.read(), resp.headers["X-Neocloud-Generation-Id"]


def assert_row(row: dict, endpoint: str, stream: bool, usage: tuple, finish: str | None) -> None:
    assert (row["model"], row["endpoint"], row["stream"], row["status"], row["error_code"], row["disconnected"]) == (
        MODEL, endpoint, int(stream), 200, None, 0)
    assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"], row["cost"]) == usage
    assert row["total_tokens"] == usage[0] + usage[1]
    assert row["finish_reason"] == finish


@pytest.mark.parametrize("name", JSON_ANSWERS)
async def test_json_answer(harness, name):
    async with harness(replay=FIXTURES / f"{name}.json", configure=allow_every_endpoint) as h:
        fixture = h.fixtures[0]
        endpoint = fixture.path.removeprefix("/v1/")
        status, content_type, raw, generation_id = await send(h, h.client_body(), endpoint)
        row = await h.row(generation_id)
        [seen] = await h.mock_requests()
    assert seen["fixture"] == f"{name}.json" and seen["body"] == fixture.body  # sent as recorded: an exact match
    upstream = orjson.loads(fixture.content)
    assert upstream["model"] == fixture.body["model"] != MODEL  # llama.cpp named the model as it was asked
    usage = (*counts(endpoint, upstream["usage"]), cost(*counts(endpoint, upstream["usage"])))
    assert (status, content_type) == (200, "application/json")
    assert orjson.loads(raw) == {**upstream, "model": MODEL, "usage": {**upstream["usage"], "cost": usage[3]}}
    finish = {"responses": upstream.get("status"), "messages": upstream.get("stop_reason")}.get(endpoint)
    assert_row(row, endpoint, False, usage, finish)
    if endpoint == "messages":
        assert seen["headers"]["anthropic-version"] == "2023-06-01"
    if endpoint == "embeddings":
        assert [d["index"] for d in upstream["data"]] == list(range(len(fixture.body["input"])))
        assert row["prompt_tokens"] > 0 and row["finish_reason"] is None


@pytest.mark.parametrize("name", STREAMS)
async def test_stream_keeps_llamas_framing(harness, name):
    async with harness(replay=FIXTURES / f"{name}.json", configure=allow_every_endpoint) as h:
        fixture = h.fixtures[0]
        endpoint = fixture.path.removeprefix("/v1/")
        status, content_type, raw, generation_id = await send(h, h.client_body(), endpoint)
        row = await h.row(generation_id)
        [seen] = await h.mock_requests()
    assert seen["fixture"] == f"{name}.json" and seen["body"] == fixture.body
    assert fixture.headers["Content-Type"] == "text/event-stream" and b"[DONE]" not in fixture.content
    assert (status, content_type) == (200, "text/event-stream; charset=utf-8")
    expected, usage, finish = expected_stream(endpoint, fixture.content)
    ours = split(raw)
    assert b"[DONE]" not in raw and f'"model":"{fixture.body["model"]}"'.encode() not in raw
    assert [lines for lines, _ in ours] == [lines for lines, _ in expected]  # the event: lines, unchanged
    for (_, data), (_, want) in zip(ours, expected, strict=True):
        if isinstance(want, bytes):
            assert data == want  # nothing to change: llama.cpp's own bytes
        else:
            assert orjson.loads(data) == want
    with_cost = [orjson.loads(d) for _, d in ours if b'"cost"' in d]
    assert len(with_cost) == 1 and with_cost[0]["type"] == {"responses": "response.completed",
                                                            "messages": "message_delta"}[endpoint]
    assert_row(row, endpoint, True, usage, finish)
    if endpoint == "messages":  # llama.cpp: the prompt counts in message_start only, the output's in message_delta
        start = orjson.loads(ours[0][1])["message"]
        assert start["model"] == MODEL and "cost" not in start["usage"]
