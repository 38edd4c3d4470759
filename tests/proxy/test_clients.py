"""Real clients against a real gateway: the official openai SDK and aiohttp-sse-client."""

import json

import openai
import pytest
from aiohttp_sse_client import client as sse_client

from kilnproxy.testing import MODEL

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


async def test_sdk_completion_not_streamed(gw):
    client = gw.openai()
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt="The capital of France is",
                                                            max_tokens=3)
    out = raw.parse()
    assert out.choices[0].text == " Paris is the"
    assert out.model == MODEL
    assert out.usage.completion_tokens == 3 and out.usage.model_extra["cost"] > 0
    gen = raw.headers["x-neocloud-generation-id"]
    assert (await gw.row(gen))["endpoint"] == "completions"


async def test_sdk_chat_not_streamed_and_streamed(gw):
    client = gw.openai()
    out = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert out.choices[0].message.content == "Paris is"
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " Paris is the capital"
    assert [c.usage is not None for c in chunks].count(True) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    rows = await gw.rows()
    assert [r["endpoint"] for r in rows] == ["chat/completions"] * 2


async def test_sdk_stream_without_include_usage_sees_no_usage(gw):
    client = gw.openai()
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True)
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_sdk_raises_on_an_error_event_mid_stream(gw):
    client = gw.openai()
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True,
                                             extra_body={"mock": {"fail": "error_event", "after": 2}})
    seen = []
    with pytest.raises(openai.APIError, match="mock failure mid-stream"):
        async for chunk in stream:
            seen.append(chunk)
    assert len(seen) == 2


@pytest.mark.parametrize("body, status, code, exc", [
    ({"model": "nope"}, 404, "model_not_found", openai.NotFoundError),
    ({"model": MODEL, "stream": "sometimes"}, 400, "invalid_request", openai.BadRequestError),
])
async def test_sdk_sees_status_and_code(gw, body, status, code, exc):
    client = gw.openai()
    with pytest.raises(exc) as info:
        await client.completions.create(prompt="x", **{k: v for k, v in body.items() if k == "model"},
                                        extra_body={k: v for k, v in body.items() if k != "model"})
    assert info.value.status_code == status and info.value.code == code


async def test_sdk_bad_key_is_authentication_error(gw):
    client = gw.openai(key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as info:
        await client.models.list()
    assert info.value.code == "invalid_api_key"


async def test_aiohttp_sse_client_reads_the_stream(gw):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
                       "stream_options": {"include_usage": True}})
    data = []
    async with sse_client.EventSource(f"{gw.url}/v1/completions", session=gw.session, option={"method": "POST"},
                                      headers={**gw.headers(), "Content-Type": "application/json"},
                                      data=body) as source:
        async for event in source:
            assert event.type is None and event.last_event_id == ""  # no event: or id: lines
            data.append(event.data)
            if event.data == "[DONE]":
                break
    assert data[-1] == "[DONE]"
    parsed = [json.loads(d) for d in data[:-1]]
    assert "".join(p["choices"][0]["text"] for p in parsed if p["choices"]) == " Paris is the"
    assert parsed[-1]["usage"]["total_tokens"] == 4
