"""A request asking for more output than its model's context window holds (``max_tokens``,
``max_completion_tokens``, ``max_output_tokens`` of a million on a 4,096-token model): vLLM and llama.cpp
generate at most the window less the prompt, so its hold's output part is at most the window, as it is
without any of them. An org or key with credits and tokens per minute enough for any real answer is not
refused because of what such a request asked for."""

from __future__ import annotations

import asyncio

import pytest

from kilnproxy.testing import MODEL, completion_body

HUGE = 1_000_000
WINDOW = 4096  # the test model's context_window
# the most a request of the test model can cost: a window of prompt and a window of output (USD)
WHOLE_WINDOW = (WINDOW * 0.10 + WINDOW * 0.30) / 1e6
PROMPT = "The capital of France is"
HANG = {"fail": "hang"}  # the mock holds the request before any header: it stays in flight

ASKING_TOO_MUCH = {
    "completions": {"prompt": PROMPT, "max_tokens": HUGE},
    "chat/completions": {"messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": HUGE},
    "responses": {"input": PROMPT, "max_output_tokens": HUGE},
    "messages": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": HUGE},
}
LIMITS = {
    "credits": {"orgs": [{"id": "acme", "credits": WHOLE_WINDOW * 1.5}, {"id": "globex", "credits": 100.0}]},
    "tokens_per_minute": {"orgs": [{"id": "acme", "credits": 100.0, "tokens_per_minute": 2 * WINDOW + 200},
                                   {"id": "globex", "credits": 100.0}]},
}


def serving_every_endpoint(config: dict) -> None:
    config["models"][0]["endpoints"] = ["completions", "chat/completions", "responses", "messages"]


@pytest.mark.parametrize("limit", list(LIMITS))
@pytest.mark.parametrize("endpoint", list(ASKING_TOO_MUCH))
async def test_a_request_asking_beyond_the_window_holds_at_most_the_window(harness, eventually, endpoint, limit):
    async with harness(overrides=LIMITS[limit], configure=serving_every_endpoint) as h:
        async def greedy() -> None:
            async with h.post(f"/v1/{endpoint}", {"model": MODEL, **ASKING_TOO_MUCH[endpoint], "mock": HANG}):
                pass

        in_flight = asyncio.create_task(greedy())
        await eventually(lambda: h.gw.admission.count("acme") == 1)
        async with h.post("/v1/completions", completion_body(max_tokens=1)) as resp:
            assert resp.status == 200, await resp.text()
        in_flight.cancel()
        await eventually(lambda: h.gw.admission.count("acme") == 0)
