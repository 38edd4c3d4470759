"""A Responses or Messages stream whose upstream (the mock, ``"after": "done"``) loses its connection or falls
silent once its last event (``response.completed``, ``message_stop``) has been sent: the answer is whole, so,
as on the completion endpoints, the client gets every event and no error event after them, the official SDK
ends without an exception, and the row is a success with the upstream's counts."""

import anthropic
import pytest

from kilnproxy.testing import Harness

SETTINGS = {"server": {"upstream_idle_timeout": 0.3}}
PROMPT, COMPLETION = 0.10 / 1e6, 0.30 / 1e6
WORDS = 3


def serving_all(config):
    config["models"][0]["endpoints"] = ["completions", "chat/completions", "embeddings", "responses", "messages"]


def columns(row):
    return {k: row[k] for k in ("endpoint", "stream", "status", "error_code", "prompt_tokens", "completion_tokens",
                                "cost", "finish_reason", "disconnected")}


def success(endpoint, finish_reason):
    return {"endpoint": endpoint, "stream": 1, "status": 200, "error_code": None, "prompt_tokens": 2,
            "completion_tokens": WORDS, "cost": round(2 * PROMPT + WORDS * COMPLETION, 10),
            "finish_reason": finish_reason, "disconnected": 0}


@pytest.mark.parametrize("fail", ["drop", "stall"])
async def test_a_responses_stream_lost_after_response_completed_ends_as_finished(tmp_path, fail):
    async with Harness(tmp_path, configure=serving_all, overrides=SETTINGS) as h:
        body = {"model": h.model, "input": "hello there", "max_output_tokens": WORDS, "stream": True,
                "mock": {"fail": fail, "after": "done"}}
        async with h.post("/v1/responses", body) as resp:
            assert resp.status == 200
            raw = await resp.read()
        frames = raw.split(b"\n\n")
        assert frames[-1] == b"" and frames[-2].startswith(b"event: response.completed\ndata: ")
        assert b"event: error" not in raw and len(frames) - 1 == 8 + WORDS
        stream = await h.openai().responses.create(model=h.model, input="hello there", max_output_tokens=WORDS,
                                                   stream=True, extra_body={"mock": {"fail": fail, "after": "done"}})
        events = [event async for event in stream]
        assert events[-1].type == "response.completed" and events[-1].response.output_text == "Paris is the"
        assert [columns(r) for r in await h.rows()] == [success("responses", "completed")] * 2


@pytest.mark.parametrize("fail", ["drop", "stall"])
async def test_a_messages_stream_lost_after_message_stop_ends_as_finished(tmp_path, fail):
    async with Harness(tmp_path, configure=serving_all, overrides=SETTINGS) as h:
        body = {"model": h.model, "max_tokens": WORDS, "messages": [{"role": "user", "content": "hi you"}],
                "stream": True, "mock": {"fail": fail, "after": "done"}}
        async with h.post("/v1/messages", body) as resp:
            assert resp.status == 200
            raw = await resp.read()
        frames = raw.split(b"\n\n")
        assert frames[-1] == b"" and frames[-2] == b'event: message_stop\ndata: {"type":"message_stop"}'
        assert b"event: error" not in raw and len(frames) - 1 == 6 + WORDS
        client = anthropic.AsyncAnthropic(base_url=h.url, api_key=h.key, max_retries=0)
        h._clients.append(client)
        async with client.messages.stream(model=h.model, max_tokens=WORDS, messages=body["messages"],
                                          extra_body={"mock": {"fail": fail, "after": "done"}}) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Paris is the" and final.stop_reason == "max_tokens"
        assert [columns(r) for r in await h.rows()] == [success("messages", "max_tokens")] * 2


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "hi", "max_output_tokens": WORDS}),
    ("/v1/messages", {"max_tokens": WORDS, "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_the_mocks_stream_that_just_ends_after_the_last_event_is_no_error(tmp_path, path, body):
    """``"fail": "eof", "after": "done"``: the body ends where it would have; nothing to tell apart."""
    async with Harness(tmp_path, configure=serving_all) as h:
        async with h.post(path, {**body, "model": h.model, "stream": True,
                                 "mock": {"fail": "eof", "after": "done"}}) as resp:
            raw = await resp.read()
        assert resp.status == 200 and b"event: error" not in raw
        assert [(r["status"], r["error_code"]) for r in await h.rows()] == [(200, None)]
