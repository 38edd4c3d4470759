"""The end of a completions stream whose upstream loses its connection (or falls silent) once the answer is
whole: every choice has its finish reason, only the usage chunk or ``[DONE]`` is missing. The client gets
the usage chunk it asked for and ``[DONE]``, no error event; the row is a success."""

import openai
import orjson
import pytest

from kilnproxy import DROP, hookimpl
from kilnproxy.testing import MODEL
from kilnproxy.usage import estimate_prompt_tokens, round_usd

GEN = "X-Neocloud-Generation-Id"
FIXED = {"id": "chatcmpl-fixed", "created": 1700000000}
PRICE = {"prompt": 0.10, "completion": 0.30, "cached_prompt": 0.05}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WORDS = 3
# vLLM's chat stream for WORDS words: the role chunk, a chunk per word (the last with the finish reason),
# the usage chunk, [DONE]
USAGE_AT = 1 + WORDS


def cost(prompt, completion):
    return round_usd((prompt * PRICE["prompt"] + completion * PRICE["completion"]) / 1_000_000)


def chat_body(mock, include_usage=True):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": WORDS, "stream": True, "mock": {**FIXED, **mock}}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_bytes(h, body):
    async with h.post("/v1/chat/completions", body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers[GEN], await resp.read()


def last_events(raw: bytes, n: int) -> bytes:
    """The last ``n`` events of a stream, each with its blank line."""
    assert raw.endswith(b"\n\n")
    return b"".join(frame + b"\n\n" for frame in raw[:-2].split(b"\n\n")[-n:])


async def upstream_usage_chunk(h) -> dict:
    """The usage chunk the mock sends for ``chat_body`` when nothing fails, as the client gets it."""
    async with h.session.post(f"{h.mock_url}/v1/chat/completions", json=chat_body({})) as resp:
        raw = await resp.read()
    event = orjson.loads(raw[:-2].split(b"\n\n")[-2][6:])
    assert event["choices"] == [] and event["usage"]["completion_tokens"] == WORDS
    event["model"] = MODEL
    usage = event["usage"]
    usage["cost"] = cost(usage["prompt_tokens"], usage["completion_tokens"])
    return event


async def test_a_drop_after_the_finish_reason_before_the_usage_chunk_ends_with_the_estimate_and_done(gw):
    """The upstream's usage chunk never came: the client's is the gateway's estimate, as for a stream
    without one."""
    body = chat_body({"fail": "drop", "after": USAGE_AT})
    gen, raw = await stream_bytes(gw, body)
    prompt = estimate_prompt_tokens(body)
    usage = {"prompt_tokens": prompt, "completion_tokens": WORDS, "total_tokens": prompt + WORDS,
             "cost": cost(prompt, WORDS)}
    chunk = {"id": FIXED["id"], "object": "chat.completion.chunk", "created": FIXED["created"], "model": MODEL,
             "choices": [], "usage": usage}
    assert last_events(raw, 2) == b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
    assert b'"finish_reason":"length"' in last_events(raw, 3)
    assert b'"error"' not in raw
    row = await gw.row(gen)
    assert (row["status"], row["error_code"], row["finish_reason"], row["disconnected"]) == (200, None, "length", 0)
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (prompt, WORDS, usage["cost"])
    assert len(await gw.rows()) == 1


@pytest.mark.parametrize("fail", ["drop", "stall"])
async def test_a_drop_or_silence_after_the_usage_chunk_before_done_ends_with_that_usage_and_done(harness, fail):
    """Everything came but ``[DONE]``: the upstream's own counts, then ``[DONE]``; an upstream silent there
    for ``upstream_idle_timeout`` likewise."""
    async with harness(overrides={"server": {"upstream_idle_timeout": 0.3}}) as h:
        gen, raw = await stream_bytes(h, chat_body({"fail": fail, "after": "done"}))
        chunk = await upstream_usage_chunk(h)
        assert last_events(raw, 2) == b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
        assert b'"error"' not in raw
        row = await h.row(gen)
        assert (row["status"], row["error_code"], row["finish_reason"]) == (200, None, "length")
        usage = chunk["usage"]
        assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (
            usage["prompt_tokens"], usage["completion_tokens"], usage["cost"])
        assert len(await h.rows()) == 1


async def test_without_include_usage_a_drop_before_done_ends_with_done(gw):
    gen, raw = await stream_bytes(gw, chat_body({"fail": "drop", "after": "done"}, include_usage=False))
    tail = last_events(raw, 2)
    assert tail.endswith(b"\n\ndata: [DONE]\n\n") and b'"finish_reason":"length"' in tail
    assert b'"usage"' not in raw and b'"error"' not in raw
    row = await gw.row(gen)
    assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, None, WORDS)


@pytest.mark.parametrize("after", [USAGE_AT, "done"])
async def test_the_sdk_stream_ends_without_an_exception_when_only_done_was_lost(gw, after):
    client = gw.openai()
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=WORDS, stream=True, stream_options={"include_usage": True},
        extra_body={"mock": {"fail": "drop", "after": after}})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " Paris is the"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == WORDS
    assert len(await gw.rows()) == 1


async def test_the_sdk_text_completion_stream_ends_without_an_exception_when_only_done_was_lost(gw):
    client = gw.openai()
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=WORDS, stream=True,
                                             extra_body={"mock": {"fail": "drop", "after": "done"}})
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)
    rows = await gw.rows()
    assert [(r["status"], r["error_code"]) for r in rows] == [(200, None)]


@pytest.mark.parametrize("fail", ["drop", "eof"])
async def test_a_drop_or_an_end_before_every_choice_finished_is_still_an_error(gw, fail):
    """llama.cpp, ``n`` = 2 on /v1/completions: choice 1 (two words) finishes before choice 0 (three
    words); a drop, or the body's end, before choice 0's last chunk cuts the answer."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "mock": {"flavor": "llamacpp", "fail": fail, "after": 6}}
    async with gw.post("/v1/completions", body) as resp:
        gen, raw = resp.headers[GEN], await resp.read()
    assert b'"finish_reason":"length"' in raw
    error, done = raw[:-2].split(b"\n\n")[-2:]
    assert orjson.loads(error[6:])["error"]["code"] == "upstream_error" and done == b"data: [DONE]"
    row = await gw.row(gen)
    assert (row["status"], row["error_code"]) == (200, "upstream_error")


class Marker:
    """Marks each choice chunk it sees, or drops the one with the finish reason (``drop_finish``)."""

    def __init__(self, drop_finish: bool):
        self.drop_finish = drop_finish

    @hookimpl
    def transform_event(self, event):
        if event["choices"] and event["choices"][0].get("finish_reason"):
            if self.drop_finish:
                return DROP
            event["marked"] = True
        return None


@pytest.mark.parametrize("drop_finish", [False, True], ids=["a plugin sees every event", "a plugin drops the last"])
async def test_with_a_transform_event_plugin_a_drop_before_done_ends_with_usage_and_done(harness, drop_finish):
    """The finish reason the plugins' loop reads, or that of an event a plugin dropped (the client does
    not see it, the answer is whole all the same)."""
    async with harness(plugins=[Marker(drop_finish)]) as h:
        gen, raw = await stream_bytes(h, chat_body({"fail": "drop", "after": "done"}))
        chunk = await upstream_usage_chunk(h)
        assert last_events(raw, 2) == b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
        assert (b'"marked":true' in raw) != drop_finish and b'"error"' not in raw
        row = await h.row(gen)
        assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, None, WORDS)
