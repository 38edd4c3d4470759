"""The load read from the real llama.cpp server (SPEC 13's load_poll; issue 40): requests sent to it from
elsewhere (here: straight to it, bypassing every gateway) are seen by ``LoadPoller``, from its ``/metrics``
(processing + deferred) and, when only ``/slots`` is read, from its slots; and the load falls back to 0."""

from __future__ import annotations

import asyncio

from kilnproxy.proxy.upstream.load_readers import LoadPoller

from .stack import LLAMA_ALIAS, N_PARALLEL
from .support import wait_llama_idle


async def test_requests_from_elsewhere_are_read_as_the_servers_load(stack, http, eventually):
    await wait_llama_idle(http, stack)
    url = f"{stack.llama_url}/v1"
    metrics, slots = LoadPoller(0.05, read_timeout=5), LoadPoller(0.05, read_timeout=5)
    slots.PATHS = ("/slots",)  # a llama.cpp started without --metrics
    metrics.watch([url])
    slots.watch([url])
    seen: dict[str, set[int | None]] = {"metrics": set(), "slots": set()}

    async def one(i: int) -> int:
        body = {"model": LLAMA_ALIAS, "prompt": f"Request {i}: tell a long story about the sea.", "max_tokens": 16,
                "ignore_eos": True, "temperature": 0}
        async with http.post(f"{stack.llama_url}/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status

    async def watch() -> None:
        while True:
            seen["metrics"].add(metrics.load(url))
            seen["slots"].add(slots.load(url))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        sent = asyncio.gather(*(one(i) for i in range(N_PARALLEL + 1)))
        await eventually(lambda: N_PARALLEL + 1 in seen["metrics"] and N_PARALLEL in seen["slots"], timeout=120)
        assert await sent == [200] * (N_PARALLEL + 1)
        await eventually(lambda: metrics.load(url) == 0 and slots.load(url) == 0)
    finally:
        watcher.cancel()
        await metrics.close()
        await slots.close()
    assert max(v for v in seen["slots"] if v is not None) == N_PARALLEL  # /slots never counts the one deferred
    assert metrics.origins() == {} and slots.origins() == {}
