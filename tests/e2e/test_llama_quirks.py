"""llama.cpp's own ways, normalised by the gateway (the response rules (docs/reference.md)), against the real server.

Each test first shows the quirk on llama.cpp's own answer, so that a llama.cpp
that stopped having it would be noticed rather than silently tested against.
"""

from __future__ import annotations

import re

import orjson
import pytest

from .stack import LLAMA_ALIAS, N_CTX_PER_SLOT, GatewayProcess
from .support import GENERATION_HEADER, KEY, MODEL, events, expected_cost, frames, gateway_toml, row

AUTH = {"Authorization": f"Bearer {KEY}"}
STREAM_BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
               "cache_prompt": False, "stream": True, "stream_options": {"include_usage": True}}
# About 1900 tokens ("hello world " is 2): llama.cpp reads it silently for seconds on 2 threads (4 s on
# an idle 2-core machine, 3 to 4 times its 1-second ping interval); the 490 of MEDIUM_PROMPT take 1 s.
LONG_PROMPT = "hello world " * 950
MEDIUM_PROMPT = "hello world " * 245
OVERFLOW_PROMPT = "hello world " * (N_CTX_PER_SLOT // 2 + 100)


def normalised(frame: bytes) -> bytes:
    """A frame with what differs between two runs of one request blanked: id, created, timings."""
    frame = re.sub(rb'"id":"chatcmpl-[A-Za-z0-9]+"', b'"id":"ID"', frame)
    frame = re.sub(rb'"created":\d+', b'"created":0', frame)
    return re.sub(rb'"timings":\{[^}]*\}', b'"timings":{}', frame)


async def test_usage_in_last_choice_chunk_becomes_one_usage_chunk(stack, http):
    async with http.post(f"{stack.llama_url}/v1/completions", json={**STREAM_BODY, "model": LLAMA_ALIAS}) as resp:
        upstream = frames(await resp.read())
    # The quirk: llama.cpp ignores include_usage on /v1/completions and puts usage in its last choice chunk.
    last_choice = orjson.loads(upstream[-2][6:])
    assert last_choice["choices"][0]["finish_reason"] == "length" and last_choice["usage"]["completion_tokens"] == 6
    assert not any(e["choices"] == [] for e in events(upstream))

    async with http.post(f"{stack.url}/v1/completions", json=STREAM_BODY, headers=AUTH) as resp:
        raw = await resp.read()
        generation_id = resp.headers[GENERATION_HEADER]
    ours = frames(raw)

    # Every content chunk is llama.cpp's own bytes with the catalog id as model; then its last
    # choice chunk with "usage": null; then exactly one usage chunk; then [DONE].
    rename = (f'"model":"{LLAMA_ALIAS}"'.encode(), f'"model":"{MODEL}"'.encode())
    for theirs, mine in zip(upstream[:-2], ours[:-3], strict=True):
        assert normalised(mine) == normalised(theirs.replace(*rename))
    expected_last = {**last_choice, "model": MODEL, "usage": None}
    assert normalised(ours[-3]) == normalised(b"data: " + orjson.dumps(expected_last))
    usage_chunk = orjson.loads(ours[-2][6:])
    assert usage_chunk["choices"] == [] and usage_chunk["model"] == MODEL
    assert usage_chunk["object"] == "text_completion" and usage_chunk["id"] == orjson.loads(ours[0][6:])["id"]
    usage = usage_chunk["usage"]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        k: last_choice["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage["cost"] == expected_cost(usage["prompt_tokens"], usage["completion_tokens"])
    assert row(stack, generation_id)["cost"] == usage["cost"]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
async def test_usage_of_n_choices_is_added_up(stack, http, endpoint):
    """With ``n`` > 1 llama.cpp reports each choice's usage on its own (in the choice's last chunk on
    /v1/completions, in a ``choices: []`` chunk per choice on chat): the gateway adds the completions
    up and counts the prompt once, in the client's one usage chunk and in the row."""
    source = {"prompt": "The capital of France is"} if endpoint == "completions" else {
        "messages": [{"role": "user", "content": "The capital of France is"}]}
    body = {"model": MODEL, **source, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{stack.llama_url}/v1/{endpoint}", json={**body, "model": LLAMA_ALIAS}) as resp:
        reports = [e["usage"] for e in events(frames(await resp.read())) if e.get("usage")]
    # The quirk: one report per choice, each with the prompt and that choice's own completion.
    assert [r["completion_tokens"] for r in reports] == [5, 5]
    prompt = reports[0]["prompt_tokens"]
    assert reports[1]["prompt_tokens"] == prompt

    async with http.post(f"{stack.url}/v1/{endpoint}", json=body, headers=AUTH) as resp:
        parts = frames(await resp.read())
        generation_id = resp.headers[GENERATION_HEADER]
    assert parts[-1] == b"data: [DONE]"
    chunks = events(parts)
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and with_usage[0]["choices"] == []
    usage = with_usage[0]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (prompt, 10, prompt + 10)
    assert usage["cost"] == expected_cost(prompt, 10)
    r = row(stack, generation_id)
    assert (r["prompt_tokens"], r["completion_tokens"], r["cost"]) == (prompt, 10, usage["cost"])
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}


async def test_llamas_keepalive_comments_reach_the_client(stack, http):
    """While llama.cpp reads a long prompt it sends ``:`` comment lines; they pass through as sent."""
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0, "cache_prompt": False,
            "stream": True, "return_progress": True, "sse_ping_interval": 1}
    async with http.post(f"{stack.url}/v1/completions", json=body, headers=AUTH) as resp:
        assert resp.status == 200
        raw = await resp.read()
        generation_id = resp.headers[GENERATION_HEADER]
    parts = frames(raw)
    comments = [p for p in parts if p.startswith(b":")]
    assert comments and set(comments) == {b":"}, comments  # llama.cpp's own ":\n\n", not the gateway's
    chunks = events(parts)
    assert "prompt_progress" in chunks[0]  # the progress events llama.cpp sends with return_progress
    assert all(c.get("usage") is None for c in chunks)
    r = row(stack, generation_id)
    assert (r["status"], r["completion_tokens"], r["finish_reason"]) == (200, 2, "length")
    assert r["prompt_tokens"] > 1800


async def test_gateway_keepalive_while_llama_is_silent(stack, http):
    """With llama.cpp's pings off, the gateway's own ``: keepalive`` fills the silence."""
    config = stack.workdir / "keepalive.toml"
    config.write_text(gateway_toml(stack.llama_url, stack.workdir / "keepalive.db").replace(
        'port = 0\n', 'port = 0\nkeepalive_seconds = 0.2\n', 1))
    gateway = GatewayProcess(stack.workdir, ["--config", str(config)], name="kilnproxy-keepalive")
    try:
        body = {"model": MODEL, "prompt": MEDIUM_PROMPT, "max_tokens": 2, "temperature": 0, "cache_prompt": False,
                "stream": True, "return_progress": True, "sse_ping_interval": -1}
        async with http.post(f"{gateway.url}/v1/completions", json=body, headers=AUTH) as resp:
            raw = await resp.read()
    finally:
        gateway.stop()
    comments = [p for p in frames(raw) if p.startswith(b":")]
    assert comments and set(comments) == {b": keepalive"}, comments


def overflow_body(endpoint: str, stream: bool) -> dict:
    source = {"prompt": OVERFLOW_PROMPT} if endpoint == "completions" else {
        "messages": [{"role": "user", "content": OVERFLOW_PROMPT}]}
    return {"model": MODEL, **source, "max_tokens": 4, "stream": stream}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_over_the_context_window_gets_llamas_400_unchanged(stack, http, endpoint, stream):
    body = overflow_body(endpoint, stream)
    async with http.post(f"{stack.llama_url}/v1/{endpoint}", json={**body, "model": LLAMA_ALIAS}) as resp:
        assert resp.status == 400
        theirs = await resp.read()
        their_type = resp.headers["Content-Type"]
    error = orjson.loads(theirs)["error"]
    assert (error["code"], error["type"]) == (400, "exceed_context_size_error")  # llama.cpp's format
    assert error["n_ctx"] == N_CTX_PER_SLOT and error["n_prompt_tokens"] > N_CTX_PER_SLOT

    async with http.post(f"{stack.url}/v1/{endpoint}", json=body, headers=AUTH) as resp:
        assert resp.status == 400
        assert await resp.read() == theirs
        assert resp.headers["Content-Type"] == their_type
        generation_id = resp.headers[GENERATION_HEADER]
    r = row(stack, generation_id)
    assert (r["status"], r["error_code"], r["stream"], r["cost"]) == (400, "exceed_context_size_error", int(stream), 0)


@pytest.mark.parametrize("endpoint, bad", [
    ("completions", {"prompt": "hi", "max_tokens": "many"}),
    ("chat/completions", {"messages": "hi", "max_tokens": 4}),
])
async def test_llamas_validation_errors_pass_through(stack, http, endpoint, bad):
    async with http.post(f"{stack.llama_url}/v1/{endpoint}", json={"model": LLAMA_ALIAS, **bad}) as resp:
        assert resp.status == 400
        theirs = await resp.read()
    assert orjson.loads(theirs)["error"]["type"] == "invalid_request_error"
    async with http.post(f"{stack.url}/v1/{endpoint}", json={"model": MODEL, **bad}, headers=AUTH) as resp:
        assert (resp.status, await resp.read()) == (400, theirs)
        assert row(stack, resp.headers[GENERATION_HEADER])["error_code"] == "invalid_request_error"


# A grammar that is complete after one token, with ``ignore_eos``: llama.cpp has no token left to sample
# and fails with a 500 "server_error", before its first token (non-streamed) or after it (streamed).
DEAD_END = {"grammar": 'root ::= "a"', "ignore_eos": True, "max_tokens": 5, "temperature": 0}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
async def test_llamas_mid_stream_error_gets_done_added(stack, http, endpoint):
    source = {"prompt": "Say a"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Say a"}]}
    body = {"model": MODEL, **source, **DEAD_END, "stream": True}
    async with http.post(f"{stack.llama_url}/v1/{endpoint}", json={**body, "model": LLAMA_ALIAS}) as resp:
        theirs = await resp.read()
    # The quirk: the error event ends llama.cpp's stream, without [DONE].
    error_frame = theirs.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert orjson.loads(error_frame[6:])["error"]["type"] == "server_error"
    assert b"[DONE]" not in theirs

    async with http.post(f"{stack.url}/v1/{endpoint}", json=body, headers=AUTH) as resp:
        assert resp.status == 200
        parts = frames(await resp.read())
        generation_id = resp.headers[GENERATION_HEADER]
    assert parts[-2:] == [error_frame, b"data: [DONE]"]  # llama.cpp's own error event, then [DONE]
    assert [c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content")) for c in events(parts)
            if "choices" in c][-1] == "a"
    r = row(stack, generation_id)
    # status 200 was sent before the error; llama.cpp's code is a number, so the row has the gateway's own code
    assert (r["status"], r["error_code"], r["finish_reason"], r["disconnected"]) == (200, "upstream_error", None, 0)


async def test_llamas_500_before_streaming_is_a_502(stack, http):
    body = {"model": MODEL, "prompt": "Say a", **DEAD_END}
    async with http.post(f"{stack.llama_url}/v1/completions", json={**body, "model": LLAMA_ALIAS}) as resp:
        assert resp.status == 500
    async with http.post(f"{stack.url}/v1/completions", json=body, headers=AUTH) as resp:
        assert resp.status == 502
        assert resp.headers["Content-Type"].startswith("text/plain")
        assert (await resp.text()).startswith("Bad gateway: ")
        generation_id = resp.headers[GENERATION_HEADER]
    assert row(stack, generation_id)["status"] == 502
