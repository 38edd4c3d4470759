"""Completions and chat, streamed and not, through the gateway in front of a real llama.cpp.

Requests run at temperature 0 with ``cache_prompt: false`` (llama.cpp's own
switch: no prompt-cache hits, so ``cached_tokens`` is 0 and the counts do not
depend on what ran before), except the one test of cached-token pricing. What the gateway answers is compared with what
llama.cpp answers to the same body directly: same text, same token counts, and
the cost is the model's pricing applied to those counts, in the answer and in
the usage row.
"""

from __future__ import annotations

import orjson
import pytest

from .support import GENERATION_HEADER, KEY, MODEL, events, expected_cost, frames, prompt_tokens, row

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name the capital of France."}]
MAX_TOKENS = 8
SAMPLING = {"temperature": 0, "seed": 7, "cache_prompt": False}


def body(endpoint: str, **extra) -> dict:
    source = {"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES}
    return {"model": MODEL, **source, "max_tokens": MAX_TOKENS, **SAMPLING, **extra}


async def direct(http, stack, endpoint: str) -> dict:
    """llama.cpp's own non-streamed answer to the same request."""
    async with http.post(f"{stack.llama_url}/v1/{endpoint}", json=body(endpoint)) as resp:
        assert resp.status == 200
        return await resp.json()


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def streamed_text(chunks: list[dict]) -> str:
    out = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
async def test_non_streamed_answer_is_llamas_with_catalog_model_and_cost(stack, http, endpoint):
    upstream = await direct(http, stack, endpoint)
    async with http.post(f"{stack.url}/v1/{endpoint}", json=body(endpoint), headers=auth()) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        answer = await resp.json()
        generation_id = resp.headers[GENERATION_HEADER]

    assert answer["model"] == MODEL
    assert text_of(answer) == text_of(upstream) != ""
    usage = answer["usage"]
    counts = {k: upstream["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert {k: usage[k] for k in counts} == counts
    assert usage["completion_tokens"] == MAX_TOKENS and answer["choices"][0]["finish_reason"] == "length"
    if endpoint == "completions":
        assert usage["prompt_tokens"] == await prompt_tokens(http, stack, PROMPT)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["cost"] == expected_cost(usage["prompt_tokens"], usage["completion_tokens"])

    r = row(stack, generation_id)
    assert (r["status"], r["error_code"], r["stream"], r["disconnected"]) == (200, None, 0, 0)
    assert (r["model"], r["endpoint"], r["org"], r["finish_reason"]) == (MODEL, endpoint, "acme", "length")
    assert (r["prompt_tokens"], r["completion_tokens"], r["total_tokens"], r["cached_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"], 0)
    assert r["cost"] == usage["cost"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("stream", [True, "true", 1])
@pytest.mark.parametrize("include_usage", [False, True])
async def test_streamed_answer_on_the_wire(stack, http, endpoint, stream, include_usage):
    if stream is not True:  # llama.cpp itself takes only a JSON boolean: the gateway must send one
        async with http.post(f"{stack.llama_url}/v1/{endpoint}", json=body(endpoint, stream=stream)) as resp:
            assert resp.status == 400 and "'stream'" in (await resp.json())["error"]["message"]
    upstream = await direct(http, stack, endpoint)
    extra = {"stream": stream}
    if include_usage:
        extra["stream_options"] = {"include_usage": True}
    async with http.post(f"{stack.url}/v1/{endpoint}", json=body(endpoint, **extra), headers=auth()) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = await resp.read()
        generation_id = resp.headers[GENERATION_HEADER]

    chunks = events(frames(raw))
    assert chunks and all(c["model"] == MODEL for c in chunks)
    assert b'"model":"gemma3-270m"' not in raw
    assert streamed_text(chunks) == text_of(upstream)
    with_usage = [c for c in chunks if c.get("usage") is not None]
    if not include_usage:
        assert with_usage == []
        assert all(c["choices"] for c in chunks)
    else:
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
        assert chunks[-1]["choices"] == []
        assert all(c["choices"] for c in chunks[:-1])
        usage = chunks[-1]["usage"]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert usage[key] == upstream["usage"][key]
        assert usage["cost"] == expected_cost(usage["prompt_tokens"], usage["completion_tokens"])
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finish == ["length"]

    r = row(stack, generation_id)
    assert (r["status"], r["stream"], r["disconnected"], r["finish_reason"]) == (200, 1, 0, "length")
    assert (r["prompt_tokens"], r["completion_tokens"]) == (
        upstream["usage"]["prompt_tokens"], upstream["usage"]["completion_tokens"])
    assert r["cost"] == expected_cost(r["prompt_tokens"], r["completion_tokens"])


async def test_sdk_streamed_completion_with_usage(stack, client, http):
    upstream = await direct(http, stack, "completions")
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, seed=7, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_prompt": False})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_of(upstream)
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.choices == [] and last.model == MODEL
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        upstream["usage"]["prompt_tokens"], MAX_TOKENS)
    assert last.usage.model_extra["cost"] == expected_cost(last.usage.prompt_tokens, MAX_TOKENS)


async def test_sdk_chat_streamed_and_not(stack, client, http):
    upstream = await direct(http, stack, "chat/completions")
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, seed=7,
        extra_body={"cache_prompt": False})
    answer = raw.parse()
    assert answer.model == MODEL and answer.choices[0].message.content == text_of(upstream)
    assert answer.usage.model_extra["cost"] == row(stack, raw.headers[GENERATION_HEADER])["cost"] > 0

    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, seed=7, stream=True,
        extra_body={"cache_prompt": False})
    chunks = [c async for c in stream]
    assert all(c.usage is None and c.choices for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text_of(upstream)


async def test_cached_prompt_tokens_are_priced_at_the_cached_rate(stack, http):
    """llama.cpp reports its prompt-cache hits as cached_tokens: the second identical prompt hits."""
    prompt = "A prompt long enough that llama.cpp keeps it in its cache for the next request, number 41."
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    answers = []
    for _ in range(2):
        async with http.post(f"{stack.url}/v1/completions", json=request, headers=auth()) as resp:
            assert resp.status == 200
            answers.append((await resp.json(), resp.headers[GENERATION_HEADER]))
    answer, generation_id = answers[1]
    usage = answer["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < usage["prompt_tokens"], usage  # llama.cpp reuses all but the last prompt token
    assert usage["cost"] == expected_cost(usage["prompt_tokens"], usage["completion_tokens"], cached)
    r = row(stack, generation_id)
    assert (r["cached_tokens"], r["cost"]) == (cached, usage["cost"])
    assert orjson.dumps(usage["prompt_tokens_details"]) == orjson.dumps({"cached_tokens": cached})


async def test_token_id_prompt_is_forwarded_as_sent(stack, http):
    """``prompt`` is never validated or re-encoded: llama.cpp's own token ids give the same answer."""
    async with http.post(f"{stack.llama_url}/tokenize", json={"content": PROMPT, "add_special": True}) as resp:
        ids = (await resp.json())["tokens"]
    answers = []
    for prompt in (PROMPT, ids):
        async with http.post(f"{stack.url}/v1/completions", json=body("completions", prompt=prompt),
                             headers=auth()) as resp:
            assert resp.status == 200
            answers.append(await resp.json())
    assert answers[1]["choices"][0]["text"] == answers[0]["choices"][0]["text"]
    assert answers[1]["usage"]["prompt_tokens"] == answers[0]["usage"]["prompt_tokens"] == len(ids)
