"""Request rule 5 (docs/reference.md): the credit hold placed with the in-flight slot, on both stores.

A hold is the most a request can cost: a bound on its prompt (its UTF-8 bytes
plus a chat template's tokens) plus ``max_tokens`` (or the model's
``context_window``) at the completion price (tests/proxy/test_hold_bounds.py). An org whose remaining credits minus its other holds are not above zero
gets 402, so it is never overdrawn by more than one request.
"""

import asyncio

import pytest

from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import completion_body

# test model: prompt 0.10 and completion 0.30 USD per million tokens, context_window 4096
PROMPT = "The capital of France is"  # 24 bytes: a hold counts 24 + 64 (TEMPLATE_TOKENS) prompt tokens
GRANT = 0.001  # USD


def hold_of(max_tokens: int) -> float:
    return (88 * 0.10 + max_tokens * 0.30) / 1e6


def grant(store: dict, credits: float = GRANT) -> dict:
    """The ``store`` fixture's overrides with acme's grant set to ``credits``."""
    return {**store, "orgs": [{"id": "acme", "credits": credits}, {"id": "globex", "credits": 100.0}]}


def stalled(**extra):
    return completion_body(stream=True, mock={"fail": "stall", "after": 1}, **extra)


def without_max_tokens(body: dict) -> dict:
    del body["max_tokens"]
    return body


async def test_a_hold_larger_than_what_is_left_refuses_the_next_request_with_402(harness, store, eventually,
                                                                                 committed):
    async with harness(overrides=grant(store)) as h:
        small = await h.post("/v1/completions", stalled(max_tokens=1000))  # holds 0.0003 of 0.001
        large = await h.post("/v1/completions", stalled(max_tokens=4000))  # admitted: 0.0007 was left
        for resp in (small, large):
            assert resp.status == 200
            await resp.content.readline()
        async with h.post("/v1/completions", completion_body(max_tokens=1)) as resp:  # nothing left to hold
            assert resp.status == 402
            assert (await resp.json())["error"]["code"] == "insufficient_credits"
            refused = resp.headers["X-Neocloud-Generation-Id"]
        large.close()
        await eventually(lambda: h.app[GATEWAY].admission.count("acme") == 1)
        await committed(h, 2)  # the 402's row and the closed stream's
        async with h.post("/v1/completions", completion_body(max_tokens=4)) as resp:  # the hold became its cost
            assert resp.status == 200
        small.close()
        by_id = {r["id"]: r for r in await h.rows()}
        assert (by_id[refused]["status"], by_id[refused]["error_code"]) == (402, "insufficient_credits")


async def test_without_max_tokens_the_hold_is_the_context_window(harness, store, eventually, committed):
    async with harness(overrides=grant(store, credits=hold_of(4096) * 0.9)) as h:
        for rounds, (first_body, second_status) in enumerate(((without_max_tokens(stalled()), 402),
                                                              (stalled(max_tokens=100), 200)), 1):
            first = await h.post("/v1/completions", first_body)
            assert first.status == 200
            await first.content.readline()
            async with h.post("/v1/completions", completion_body(max_tokens=1)) as resp:
                assert resp.status == second_status
            first.close()
            await eventually(lambda: h.app[GATEWAY].admission.count("acme") == 0)
            await committed(h, 2 * rounds)


async def test_many_requests_at_once_overdraw_an_org_by_one_request_at_most(harness, store):
    granted = hold_of(8) * 5.5
    async with harness(overrides={**grant(store, credits=granted), "limits": {"max_in_flight_per_org": 64}}) as h:
        async def one():
            body = completion_body(stream=True, max_tokens=8, mock={"delay": 0.005})
            async with h.post("/v1/completions", body) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one() for _ in range(40)))
        assert set(statuses) == {200, 402}
        assert statuses.count(200) <= 6
        spent = sum(r["cost"] for r in await h.rows() if r["org"] == "acme")
        assert spent <= granted + hold_of(8)
        async with h.session.get(f"{h.url}/v1/credits", headers=h.headers(None)) as resp:
            assert (await resp.json())["spent"] == pytest.approx(spent)
