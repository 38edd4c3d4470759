"""More concurrent requests than llama.cpp has slots (2), and the org's in-flight limit on top."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from .stack import N_PARALLEL
from .support import (
    GENERATION_HEADER,
    KEY,
    MODEL,
    TIGHT_KEY,
    TIGHT_LIMIT,
    events,
    expected_cost,
    frames,
    llama_metric,
    row,
    rows,
    wait_llama_idle,
)

MAX_TOKENS = 12


async def test_more_requests_than_slots_all_complete(stack, http):
    """llama.cpp queues what its slots cannot take; every request still gets its whole answer."""
    await wait_llama_idle(http, stack)
    headers = {"Authorization": f"Bearer {KEY}"}
    deferred = []

    async def one(i: int) -> tuple[int, bytes, str]:
        body = {"model": MODEL, "prompt": f"Request {i}: the capital of France is", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0, "stream": i % 2 == 0}
        async with http.post(f"{stack.url}/v1/completions", json=body, headers=headers) as resp:
            return resp.status, await resp.read(), resp.headers[GENERATION_HEADER]

    async def watch() -> None:
        while True:
            deferred.append(await llama_metric(http, stack, "requests_deferred"))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*(one(i) for i in range(3 * N_PARALLEL)))
    finally:
        watcher.cancel()
    assert max(deferred) >= 1, "llama.cpp never had to queue a request"  # the point of this test

    for i, (status, raw, generation_id) in enumerate(results):
        assert status == 200
        if i % 2 == 0:
            chunks = events(frames(raw))
            assert sum(1 for c in chunks for ch in c["choices"] if ch["text"]) <= MAX_TOKENS
            assert all(c.get("usage") is None for c in chunks)
        else:
            answer = orjson.loads(raw)
            assert answer["usage"]["completion_tokens"] == MAX_TOKENS
            usage = answer["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]  # these prompts share a prefix
            assert usage["cost"] == expected_cost(usage["prompt_tokens"], MAX_TOKENS, cached)
        r = row(stack, generation_id)
        assert (r["status"], r["completion_tokens"], r["finish_reason"], r["disconnected"]) == (
            200, MAX_TOKENS, "length", 0)


async def test_org_in_flight_limit_holds_while_llama_queues(stack, http):
    """Org "tight" may have 3 requests in flight: llama.cpp runs 2 and queues 1; a 4th and 5th get 429."""
    await wait_llama_idle(http, stack)
    headers = {"Authorization": f"Bearer {TIGHT_KEY}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    opened = [asyncio.create_task(http.post(f"{stack.url}/v1/completions", json=body, headers=headers))
              for _ in range(TIGHT_LIMIT)]
    try:
        # all three are past the gateway once llama.cpp has two slots busy and one request waiting
        async with asyncio.timeout(60):
            while await llama_metric(http, stack, "requests_deferred") < TIGHT_LIMIT - N_PARALLEL \
                    or await llama_metric(http, stack, "requests_processing") < N_PARALLEL:
                await asyncio.sleep(0.02)
        for stream in (False, True):
            async with http.post(f"{stack.url}/v1/completions", headers=headers,
                                 json={**body, "max_tokens": 2, "stream": stream}) as resp:
                assert resp.status == 429
                assert resp.headers["Content-Type"].startswith("application/json")
                assert "Retry-After" not in resp.headers
                error = (await resp.json())["error"]
                assert (error["code"], error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
                assert row(stack, resp.headers[GENERATION_HEADER])["status"] == 429
    finally:
        for task in opened:
            task.cancel()  # a request still waiting for its headers is dropped; the others are closed
        for result in await asyncio.gather(*opened, return_exceptions=True):
            if isinstance(result, aiohttp.ClientResponse):
                result.close()

    # every hung-up request is recorded, its slot is freed, and llama.cpp stops generating for it
    async with asyncio.timeout(30):
        while len(rows(stack, org="tight", disconnected=1)) < TIGHT_LIMIT:
            await asyncio.sleep(0.05)
    await wait_llama_idle(http, stack)
    async with http.post(f"{stack.url}/v1/completions", headers=headers,
                         json={**body, "max_tokens": 2, "stream": False}) as resp:
        assert resp.status == 200
    tight = rows(stack, org="tight")
    # the two llama.cpp was running had their 200 sent; the queued one got no status before its
    # client left (499); then the two refusals and the last request
    assert sorted(r["status"] for r in tight) == \
        [200] * (N_PARALLEL + 1) + [429, 429] + [499] * (TIGHT_LIMIT - N_PARALLEL)
    assert sum(r["disconnected"] for r in tight) == TIGHT_LIMIT
