"""``n`` > 1 on llama.cpp: each choice reports its own usage (the mock's ``llamacpp`` flavor does the
same; tests/e2e/test_llama_quirks.py checks the real server). The request's usage adds up the
choices' completions and counts the prompt once, in the client's usage chunk and in the row."""

import orjson
import pytest

from kilnproxy.testing import completion_body

LLAMA = {"flavor": "llamacpp"}
MAX_TOKENS = 4  # choice i of the mock writes MAX_TOKENS - i words


def usage_chunks(raw: bytes) -> list[dict]:
    events = [orjson.loads(f[6:]) for f in raw.split(b"\n\n") if f.startswith(b"data: {")]
    return [e for e in events if e.get("usage")]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion_body(prompt="one two three")),
    ("/v1/chat/completions", {"model": "test-model", "messages": [{"role": "user", "content": "one two three"}]}),
])
@pytest.mark.parametrize("n", [1, 2, 3])
async def test_the_choices_usage_adds_up(gw, path, body, n):
    request = {**body, "max_tokens": MAX_TOKENS, "n": n, "stream": True, "stream_options": {"include_usage": True},
               "mock": LLAMA}
    async with gw.post(path, request) as resp:
        raw = await resp.read()
        generation_id = resp.headers["X-Neocloud-Generation-Id"]
    completion = sum(MAX_TOKENS - i for i in range(n))
    prompt = 3 if path == "/v1/completions" else 4 + 3
    (chunk,) = usage_chunks(raw)
    assert chunk["choices"] == []
    usage = chunk["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        prompt, completion, prompt + completion)
    cost = round((prompt * 0.10 + completion * 0.30) / 1e6, 10)
    assert usage["cost"] == cost
    row = await gw.row(generation_id)
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (prompt, completion, cost)


async def test_the_sum_is_kept_when_the_client_did_not_ask_for_usage(gw):
    request = {**completion_body(prompt="one two three"), "max_tokens": MAX_TOKENS, "n": 3, "stream": True,
               "mock": LLAMA}
    async with gw.post("/v1/completions", request) as resp:
        raw = await resp.read()
        generation_id = resp.headers["X-Neocloud-Generation-Id"]
    assert usage_chunks(raw) == []
    assert (await gw.row(generation_id))["completion_tokens"] == 4 + 3 + 2
