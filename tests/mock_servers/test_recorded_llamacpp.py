"""The shipped llama.cpp recordings (kilnproxy/recordings/llamacpp) replayed through the gateway.

The same contract points ``make e2e`` checks live (the response rules (docs/reference.md)), on what
llama.cpp + Gemma 3 270M really sent, so that a change that breaks real
llama.cpp streams fails ``make test`` without building llama.cpp. What the
client must get is derived from the recording itself: every event as
llama.cpp's own bytes with the catalog id as ``model``; usage taken out of the
last choice chunk (llama.cpp's place for it on /v1/completions) or out of its
``choices: []`` chunk, and given back as exactly one priced usage chunk before
``[DONE]`` when the client asked. ``make fixtures`` re-records the files.
"""

from __future__ import annotations

import orjson
import pytest

from kilnproxy.sse import COMMENT, DONE, SSEParser
from kilnproxy.testing import MODEL, RECORDINGS, sse_frames

FIXTURES = RECORDINGS / "llamacpp"
UPSTREAM_MODEL = b'"model":"gemma3-270m"'
PRICING = {"prompt": 0.10, "completion": 0.30}  # kilnproxy.testing's test model
NON_STREAMED = ["completions", "chat", "chat-n2"]
STREAMED = ["completions-stream", "chat-stream", "completions-stream-n2", "completions-stream-pings"]
JSON_ANSWERS = ["responses", "messages", "embeddings"]  # the names test_recorded_llamacpp_apis.py replays
STREAMS = ["responses-stream", "messages-stream"]


def fixture_path(name: str):
    return FIXTURES / f"{name}.json"


def cost(usage: dict) -> float:
    """The price of ``usage`` as the gateway states it (USD, rounded to 10 decimals)."""
    return round(
        (usage["prompt_tokens"] * PRICING["prompt"] + usage["completion_tokens"] * PRICING["completion"]) / 1e6, 10)


def upstream_items(content: bytes) -> list[tuple[int, bytes]]:
    parser = SSEParser()
    return parser.feed(content) + parser.close()


def expected_frames(content: bytes, include_usage: bool) -> tuple[list[bytes], dict | None]:
    """What the response rules (docs/reference.md) makes of llama.cpp's stream, except the usage chunk: the frames, and the
    request's usage: llama.cpp's last report, or with ``n`` > 1 its reports per choice added up
    (completions summed, the prompt once)."""
    frames, usage, per_choice = [], None, {}
    for kind, payload in upstream_items(content):
        if kind == COMMENT:
            frames.append(payload)
            continue
        if payload == DONE:
            break
        event = orjson.loads(payload)
        if isinstance(event.get("usage"), dict):
            usage = event["usage"]
            per_choice[event["choices"][0]["index"] if event["choices"] else len(per_choice)] = usage
            if event["choices"]:
                frames.append(b"data: " + orjson.dumps({**event, "model": MODEL, "usage": None}))
            continue
        frames.append(b"data: " + payload.replace(UPSTREAM_MODEL, f'"model":"{MODEL}"'.encode()))
    if len(per_choice) > 1:
        prompt = max(u["prompt_tokens"] for u in per_choice.values())
        completion = sum(u["completion_tokens"] for u in per_choice.values())
        usage = {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return frames, usage


async def send(h, body) -> tuple[int, str, bytes, str]:
    async with h.post(h.fixtures[0].path, json=body) as resp:
        return resp.status, resp.headers["Content-Type"], await resp.read(), resp.headers["X-Neocloud-Generation-Id"]


def test_every_shipped_fixture_is_replayed_here_and_small():
    names = {p.stem for p in FIXTURES.glob("*.json")}
    assert names == {*NON_STREAMED, *STREAMED, "completions-stream-over-context", "completions-stream-error",
                     "completions-500", "chat-stream-client-leaves",
                     *JSON_ANSWERS, *STREAMS}  # the other APIs', replayed in test_recorded_llamacpp_apis.py
    for name in names:
        raw = fixture_path(name).read_bytes()
        assert len(raw) < 24_000, name
        assert b"Authorization" not in raw and b"sk-e2e" not in raw  # the e2e gateway's client key


@pytest.mark.parametrize("name", NON_STREAMED)
async def test_non_streamed_answer(harness, name):
    async with harness(replay=fixture_path(name)) as h:
        status, content_type, raw, generation_id = await send(h, h.client_body())
        row = await h.row(generation_id)
    upstream = orjson.loads(h.fixtures[0].content)
    assert (status, content_type) == (200, "application/json")
    answer = orjson.loads(raw)
    assert answer == {**upstream, "model": MODEL, "usage": {**upstream["usage"], "cost": cost(upstream["usage"])}}
    assert len(answer["choices"]) == h.fixtures[0].body.get("n", 1)
    assert (row["status"], row["stream"], row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (
        200, 0, upstream["usage"]["prompt_tokens"], upstream["usage"]["completion_tokens"], cost(upstream["usage"]))
    assert row["finish_reason"] == upstream["choices"][-1]["finish_reason"]


@pytest.mark.parametrize("name", STREAMED)
@pytest.mark.parametrize("include_usage", [True, False])
async def test_streamed_answer_on_the_wire(harness, name, include_usage):
    async with harness(replay=fixture_path(name)) as h:
        body = {k: v for k, v in h.client_body().items() if k != "stream_options"}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        status, content_type, raw, generation_id = await send(h, body)
        row = await h.row(generation_id)
        [seen] = await h.mock_requests()
    assert seen["fixture"] == f"{name}.json"  # the gateway sent the recorded body: an exact match
    assert (status, content_type) == (200, "text/event-stream; charset=utf-8")
    frames = sse_frames(raw)
    expected, usage = expected_frames(h.fixtures[0].content, include_usage)
    assert usage is not None, "llama.cpp reported no usage in this recording"
    assert UPSTREAM_MODEL not in raw
    if include_usage:
        assert frames[:-2] == expected and frames[-1] == b"data: [DONE]"
        usage_chunk = orjson.loads(frames[-2][6:])
        assert usage_chunk["choices"] == [] and usage_chunk["model"] == MODEL
        assert usage_chunk["usage"] == {**usage, "cost": cost(usage)}
    else:
        assert frames[:-1] == expected and frames[-1] == b"data: [DONE]"
    events = [orjson.loads(f[6:]) for f in frames if f.startswith(b"data: {")]
    assert all(e.get("usage") is None for e in (events[:-1] if include_usage else events))
    indexes = {c["index"] for e in events for c in e["choices"]}
    assert indexes == set(range(h.fixtures[0].body.get("n", 1)))
    assert (row["status"], row["stream"], row["disconnected"], row["error_code"]) == (200, 1, 0, None)
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], cost(usage))
    assert row["finish_reason"] == "length"
    if name == "completions-stream-pings":  # llama.cpp's ":" while it read the prompt, passed through
        assert b":" in frames and "prompt_progress" in events[0]


async def test_prompt_over_the_context_window_gets_llamas_400_unchanged(harness):
    async with harness(replay=fixture_path("completions-stream-over-context")) as h:
        status, content_type, raw, generation_id = await send(h, h.client_body())
        row = await h.row(generation_id)
    fixture = h.fixtures[0]
    assert (status, raw) == (400, fixture.content) and content_type == fixture.headers["Content-Type"]
    assert orjson.loads(raw)["error"]["type"] == "exceed_context_size_error"
    assert (row["status"], row["error_code"], row["stream"], row["cost"]) == (400, "exceed_context_size_error", 1, 0)


async def test_llamas_mid_stream_error_gets_done_added(harness):
    async with harness(replay=fixture_path("completions-stream-error")) as h:
        status, _, raw, generation_id = await send(h, h.client_body())
        row = await h.row(generation_id)
    recorded = h.fixtures[0].content
    error_frame = recorded.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert b"[DONE]" not in recorded and orjson.loads(error_frame[6:])["error"]["type"] == "server_error"
    assert status == 200 and sse_frames(raw)[-2:] == [error_frame, b"data: [DONE]"]
    assert (row["status"], row["error_code"], row["finish_reason"]) == (200, "upstream_error", None)


async def test_llamas_500_before_streaming_is_a_502(harness):
    async with harness(replay=fixture_path("completions-500")) as h:
        status, content_type, raw, generation_id = await send(h, h.client_body())
        row = await h.row(generation_id)
    assert h.fixtures[0].status == 500
    assert (status, content_type) == (502, "text/plain; charset=utf-8") and raw.startswith(b"Bad gateway: ")
    assert (row["status"], row["error_code"]) == (502, "upstream_error")


async def test_client_gone_mid_stream(harness, eventually):
    def allow_ignore_eos(config):  # the test model refuses it on chat; the recording used it
        config["models"][0]["reject_chat_params"] = []

    async with harness(replay=fixture_path("chat-stream-client-leaves"), configure=allow_ignore_eos) as h:
        resp = await h.post("/v1/chat/completions", json=h.client_body())
        assert resp.status == 200
        generation_id = resp.headers["X-Neocloud-Generation-Id"]
        raw = b""
        while raw.count(b"\n\n") < 5:
            chunk = await resp.content.readany()
            assert chunk, raw
            raw += chunk
        resp.close()
        assert (await h.mock_wait(hangups=1))["hangups"] == 1  # the gateway hung up on the replaying llama.cpp
        rows = await eventually(lambda: h.rows(id=generation_id))
    assert (rows[0]["disconnected"], rows[0]["stream"], rows[0]["finish_reason"]) == (1, 1, None)
    assert rows[0]["completion_tokens"] >= 4 and rows[0]["prompt_tokens"] > 0
    assert h.fixtures[0].end == "client_gone"
