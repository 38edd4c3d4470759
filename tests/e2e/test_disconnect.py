"""A client that hangs up mid-generation: the gateway hangs up on llama.cpp, which stops generating.

Shown from llama.cpp's side: once no slot is processing any more, its
``tokens_predicted_total`` counter has grown by a few tokens, not by the 400
the request asked for (``ignore_eos`` keeps the model from stopping by itself).
"""

from __future__ import annotations

import pytest

from .support import GENERATION_HEADER, KEY, MODEL, events, expected_cost, llama_metric, wait_for_row, wait_llama_idle

MAX_TOKENS = 400
READ_CHUNKS = 5


def body(endpoint: str) -> dict:
    source = {"prompt": "Once upon a time"} if endpoint == "completions" else {
        "messages": [{"role": "user", "content": "Tell me a long story."}]}
    return {"model": MODEL, **source, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False, "stream": True}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
async def test_client_gone_mid_stream_stops_llama_and_is_recorded(stack, http, endpoint):
    await wait_llama_idle(http, stack)
    predicted_before = await llama_metric(http, stack, "tokens_predicted_total")

    resp = await http.post(f"{stack.url}/v1/{endpoint}", json=body(endpoint),
                           headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status == 200
    generation_id = resp.headers[GENERATION_HEADER]
    raw = b""
    while raw.count(b"\n\n") < READ_CHUNKS:
        raw += await resp.content.readany()
    resp.close()  # hang up mid-generation
    received = events([f for f in raw.split(b"\n\n")[:READ_CHUNKS] if f.startswith(b"data: {")])
    assert len(received) == READ_CHUNKS and all(c["choices"][0]["finish_reason"] is None for c in received)

    await wait_llama_idle(http, stack)
    generated = await llama_metric(http, stack, "tokens_predicted_total") - predicted_before
    assert READ_CHUNKS - 1 <= generated < 100, f"llama.cpp generated {generated} of {MAX_TOKENS} tokens"

    r = await wait_for_row(stack, generation_id)
    assert (r["disconnected"], r["stream"], r["finish_reason"], r["error_code"]) == (1, 1, None, None)
    # the tokens streamed so far: at least what this client read, at most what llama.cpp made
    assert READ_CHUNKS - 1 <= r["completion_tokens"] <= generated + 1
    assert r["prompt_tokens"] > 0
    assert r["cost"] == expected_cost(r["prompt_tokens"], r["completion_tokens"]) > 0
