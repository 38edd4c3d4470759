"""Upstream slots in front of the real server: llama.cpp with 2 slots behind ``max_in_flight = 2``.

The stack's llama.cpp runs ``--parallel 2``; a second gateway (this module's)
lists it as ``upstreams = [{url = ..., max_in_flight = 2}]`` with a long
``queue_timeout``. Six long requests at once: the gateway sends two, queues
four (first come, first served), and every one is answered; llama.cpp's own
``/slots`` never shows more than two busy and its ``requests_deferred`` never
rises (it never had to queue one itself, unlike ``test_concurrency.py``).

Half of them are streamed: llama.cpp closes its connection right after every
streamed answer (``test_llama_closes_its_connection_after_a_stream``), and a
request that the queue sends at once on that pooled connection meets the
close; the gateway sends it again on another connection, so none fails.
"""

from __future__ import annotations

import asyncio
import re
import signal

import aiohttp
import orjson
import pytest

from kilnproxy.testing import usage_rows

from .stack import LLAMA_ALIAS, N_PARALLEL, GatewayProcess
from .support import (
    GENERATION_HEADER,
    KEY,
    expected_cost,
    gateway_toml,
    llama_busy_slots,
    llama_metric,
    model_toml,
    wait_llama_idle,
)

MODEL = "gemma-slots"
REQUESTS = 3 * N_PARALLEL
MAX_TOKENS = 64  # about 3 s of generation each on 2 threads: the requests overlap


@pytest.fixture(scope="module")
def slotted(stack, tmp_path_factory):
    """A gateway whose only model sends at most N_PARALLEL requests at once to the stack's llama.cpp."""
    workdir = tmp_path_factory.mktemp("slots")
    config = workdir / "kilnproxy.toml"
    slots = f'{{url = "{stack.llama_url}/v1", max_in_flight = {N_PARALLEL}}}'
    config.write_text(gateway_toml(stack.llama_url, workdir / "usage.db", models=model_toml(
        MODEL, slots, LLAMA_ALIAS, ["completions", "chat/completions"], extra="queue_timeout = 120")))
    gateway = GatewayProcess(workdir, ["--config", str(config)], name="kilnproxy-slots")
    try:
        yield gateway, workdir / "usage.db"
    finally:
        gateway.stop(signal.SIGINT)  # no drain: nothing is in flight


async def gateway_queue(http: aiohttp.ClientSession, gateway_url: str, upstream: str) -> tuple[float, float]:
    """The gateway's own view of the upstream: (slots busy, requests waiting), from its /metrics."""
    async with http.get(f"{gateway_url}/metrics") as resp:
        text = await resp.text()

    def gauge(name: str) -> float:
        match = re.search(rf'^{name}\{{upstream="{re.escape(upstream)}"\}} (\S+)$', text, re.M)
        assert match, f"the gateway's /metrics has no {name} for {upstream}"
        return float(match.group(1))

    return gauge("kilnproxy_upstream_slots_busy"), gauge("kilnproxy_upstream_queued_requests")


async def test_six_requests_through_two_slots(stack, slotted, http):
    gateway, db = slotted
    upstream = f"{stack.llama_url}/v1"
    await wait_llama_idle(http, stack)
    deferred_before = await llama_metric(http, stack, "requests_deferred")
    headers = {"Authorization": f"Bearer {KEY}"}
    seen = {"busy": [], "deferred": [], "gateway_busy": [], "queued": []}

    async def one(i: int) -> tuple[int, bytes, str]:
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0}
        if i % 2:
            body.update(stream=True, stream_options={"include_usage": True})
        async with http.post(f"{gateway.url}/v1/completions", json=body, headers=headers) as resp:
            return resp.status, await resp.read(), resp.headers[GENERATION_HEADER]

    async def watch() -> None:
        while True:
            seen["busy"].append(await llama_busy_slots(http, stack.llama_url))
            seen["deferred"].append(await llama_metric(http, stack, "requests_deferred"))
            busy, queued = await gateway_queue(http, gateway.url, upstream)
            seen["gateway_busy"].append(busy)
            seen["queued"].append(queued)
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        async with asyncio.timeout(240):
            results = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    # the requests overlapped: both slots were busy at once, and the gateway held the others back
    assert max(seen["busy"]) == N_PARALLEL, seen["busy"]
    assert max(seen["gateway_busy"]) == N_PARALLEL, seen["gateway_busy"]
    assert max(seen["queued"]) >= 1, seen["queued"]
    # llama.cpp never had more than it has slots: it never had to defer one itself
    assert max(seen["deferred"]) == deferred_before == 0, seen["deferred"]

    for status, raw, generation_id in results:
        assert status == 200, raw
        if raw.startswith(b"data: "):  # a stream: its usage chunk comes just before [DONE]
            assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
            raw = raw.rsplit(b"data: ", 2)[1]
        usage = orjson.loads(raw)["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["cost"] == expected_cost(usage["prompt_tokens"], MAX_TOKENS,
                                              usage["prompt_tokens_details"]["cached_tokens"])
        found = usage_rows(db, id=generation_id)
        assert len(found) == 1
        r = found[0]
        assert (r["model"], r["status"], r["completion_tokens"], r["finish_reason"], r["disconnected"],
                r["error_code"]) == (MODEL, 200, MAX_TOKENS, "length", 0, None)
    assert len(usage_rows(db)) == REQUESTS
    assert await gateway_queue(http, gateway.url, upstream) == (0, 0)  # every slot given back


@pytest.mark.parametrize("stream", [False, True])
async def test_llama_closes_its_connection_after_a_stream(stack, stream):
    """What llama.cpp does with its connection after an answer, on the raw socket: a JSON answer's is
    kept alive; a stream's is closed right after its last chunk (``0\\r\\n\\r\\n``), although its
    headers said ``Keep-Alive: timeout=5, max=100`` and no ``Connection: close``."""
    host, port = stack.llama_url.removeprefix("http://").split(":")
    body = orjson.dumps({"model": LLAMA_ALIAS, "prompt": "Hi", "max_tokens": 2, "stream": stream})
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"Keep-Alive: timeout=5, max=100\r\n" in head and b"Connection: close" not in head
        if stream:
            assert b"Transfer-Encoding: chunked\r\n" in head
            raw = await reader.readuntil(b"\r\n0\r\n\r\n")
            assert raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        else:
            length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
            await reader.readexactly(length)
        try:
            async with asyncio.timeout(1):
                after = await reader.read(1)
        except TimeoutError:
            after = None  # still open
        assert after == (b"" if stream else None)  # b"": the server closed it
    finally:
        writer.close()
