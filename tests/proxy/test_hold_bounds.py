"""The hold is an upper bound on what a request can cost (request rule 5, docs/reference.md), for any
tokenizer and chat template and whatever number of choices it asks for: however many requests run at
once, an org's credits, a key's ``limit`` and a ``tokens_per_minute`` bound overrun by one request at
most, on both stores.

The mock upstream counts a chat prompt as 4 tokens a message plus its words: 60 messages of "ok" (120
characters, 30 tokens at four characters a token) are 300 prompt tokens, as a real chat template makes
them. With ``flavor: llamacpp`` it answers ``n`` choices.
"""

import asyncio

import pytest

from kilnproxy.testing import MODEL, completion_body
from kilnproxy.usage import TEMPLATE_TOKENS, choice_count, estimate_prompt_tokens, prompt_count, prompt_token_bound

CONCURRENT = 30


def chat_of_short_messages() -> dict:
    return {"model": MODEL, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "ok"}] * 60, "mock": {"delay": 0.02}}


def both_limits() -> dict:
    """OpenAI's two output limits: vLLM's chat generates ``max_completion_tokens`` (the newer one), whatever
    ``max_tokens`` says."""
    return {"model": MODEL, "max_tokens": 1, "max_completion_tokens": 300, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "ok"}],
            "mock": {"delay": 0.001}}


def many_choices() -> dict:
    return completion_body(stream=True, prompt="hi", max_tokens=5, n=8, mock={"flavor": "llamacpp", "delay": 0.02})


async def run_at_once(h, path: str, body: dict, key: str | None = None) -> list[int]:
    async def one() -> int:
        async with h.post(path, body, key=key) as resp:
            await resp.read()
            return resp.status

    return await asyncio.gather(*(one() for _ in range(CONCURRENT)))


async def one_cost(harness, path: str, body: dict) -> float:
    """What one such request costs, on an org with plenty of credit."""
    async with harness() as h:
        async with h.post(path, body) as resp:
            assert resp.status == 200
            await resp.read()
        (row,) = await h.rows()
        return row["cost"]


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", chat_of_short_messages()),
                                        ("/v1/completions", many_choices()),
                                        ("/v1/chat/completions", both_limits())],
                         ids=["short-messages", "n=8", "max_tokens-and-max_completion_tokens"])
async def test_concurrent_requests_overdraw_an_org_by_one_request_at_most(harness, store, path, body):
    cost = await one_cost(harness, path, body)
    granted = cost * 3.5
    overrides = {**store, "orgs": [{"id": "acme", "credits": granted}, {"id": "globex", "credits": 100.0}],
                 "limits": {"max_in_flight_per_org": 64}}
    async with harness(overrides=overrides) as h:
        statuses = await run_at_once(h, path, body)
        assert set(statuses) <= {200, 402} and 200 in statuses
        spent = sum(r["cost"] for r in await h.rows(org="acme"))
        assert spent <= granted + cost * 1.0001
        async with h.session.get(f"{h.url}/v1/credits", headers=h.headers(None)) as resp:
            assert (await resp.json())["spent"] == pytest.approx(spent)


async def test_concurrent_requests_overrun_a_keys_limit_by_one_request_at_most(harness, store):
    body = chat_of_short_messages()
    cost = await one_cost(harness, "/v1/chat/completions", body)
    limit = cost * 3.5
    async with harness(overrides={**store, "limits": {"max_in_flight_per_org": 64}}) as h:
        secret, key = await h.gw.tenancy.create_key("acme", "batch", limit=limit)
        await h.gw.tenants.refresh()
        statuses = await run_at_once(h, "/v1/chat/completions", body, key=secret)
        assert set(statuses) <= {200, 402} and 200 in statuses
        used = sum(r["cost"] for r in await h.rows(key_id=key["id"]))
        assert used <= limit + cost * 1.0001


async def test_concurrent_requests_overrun_tokens_per_minute_by_one_request_at_most(harness, store):
    body = chat_of_short_messages()  # 300 prompt tokens and 1 completion token each
    bound = 1000
    overrides = {**store, "orgs": [{"id": "acme", "credits": 100.0, "tokens_per_minute": bound},
                                   {"id": "globex", "credits": 100.0}], "limits": {"max_in_flight_per_org": 64}}
    async with harness(overrides=overrides) as h:
        statuses = await run_at_once(h, "/v1/chat/completions", body)
        assert set(statuses) <= {200, 429} and 200 in statuses
        rows = [r for r in await h.rows(org="acme") if r["status"] == 200]
        assert sum(r["total_tokens"] for r in rows) <= bound + max(r["total_tokens"] for r in rows)


def test_the_prompt_bound_covers_every_field_that_makes_a_prompt():
    text = "ключ 鍵 ok"  # 10 characters, 15 UTF-8 bytes
    nbytes = len(text.encode())
    base = TEMPLATE_TOKENS
    assert prompt_token_bound({"prompt": text}) == base + nbytes > estimate_prompt_tokens({"prompt": text})
    assert prompt_token_bound({"prompt": [text, text]}) == base + 2 * (nbytes + 8)
    assert prompt_token_bound({"prompt": [1, 2, 3]}) == base + 3  # token ids
    assert prompt_token_bound({"messages": [{"role": "user", "content": text}]}) == base + 8 + 4 + nbytes
    parts = {"role": "user", "content": [{"type": "text", "text": text}]}
    assert prompt_token_bound({"messages": [parts]}) >= base + 8 + nbytes
    assert prompt_token_bound({"input": [text, text]}) == base + 2 * (nbytes + 8)  # embeddings
    assert prompt_token_bound({"input": text, "instructions": text}) == base + 2 * nbytes  # responses
    assert prompt_token_bound({"system": text, "messages": []}) == base + nbytes  # messages
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert prompt_token_bound({"messages": [], "tools": tools}) > base + 60
    assert prompt_token_bound({"prompt": "x" * 10_000}, context_window=4096) == 4096
    assert prompt_token_bound({"prompt": ["x" * 10_000] * 2}, context_window=4096) == 2 * 4096
    assert [choice_count({"n": n}) for n in (8, 0, -1, True, "8", 2.0, None)] == [8, 1, 1, 1, 1, 2, 1]  # 2.0: 2, as vLLM reads it
    assert choice_count({"n": 10**30}) == choice_count({"best_of": 1e300}) == 1024  # refused later: a hold in 64 bits
    assert choice_count({"n": 2, "best_of": 5}) == 5
    assert prompt_count({"prompt": ["a", "b", "c"]}) == 3 and prompt_count({"prompt": [1, 2]}) == 1


def test_the_estimate_reads_the_first_field_that_holds_a_prompt():
    """A chat body that also carries ``"prompt": null`` is estimated from its messages (it was 1 token)."""
    messages = [{"role": "user", "content": "The capital of France is a long question with many words in it"}]
    assert estimate_prompt_tokens({"prompt": None, "messages": messages}) == \
        estimate_prompt_tokens({"messages": messages}) == 16


@pytest.mark.parametrize("prompts", [2, 3], ids=["beyond 2**63", "beyond 2**64"])
async def test_a_hold_beyond_what_a_bigint_holds_is_placed_capped(harness, store, prompts):
    """``max_tokens`` 2**53 - 1 (the most a hold reads) × ``n`` 1024 × several prompts, on a model without a
    context window, under a ``tokens_per_minute`` bound: the hold's tokens are capped at 2**53 - 1 (no usage
    count can settle it higher), so the request is admitted on either store and reaches the upstream, whose
    own refusal (the mock's context window) the client gets."""
    body = {"model": MODEL, "prompt": ["a"] * prompts, "max_tokens": 2**53 - 1, "n": 1024}
    overrides = {**store, "orgs": [{"id": "acme", "credits": 100.0, "tokens_per_minute": 2**63 - 1},
                                   {"id": "globex", "credits": 100.0}]}
    async with harness(overrides=overrides, configure=lambda c: c["models"][0].pop("context_window")) as h:
        async with h.post("/v1/completions", body) as resp:
            answer = await resp.json()
        assert resp.status == 400 and "maximum context length" in answer["error"]["message"], answer
        async with h.post("/v1/completions", completion_body(max_tokens=2)) as resp:
            assert resp.status == 200, await resp.text()
        rows = await h.rows(org="acme")
        assert sorted(r["status"] for r in rows) == [200, 400]
