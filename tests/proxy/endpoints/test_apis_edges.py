"""Edges of the Responses API and embeddings that a bug hunt found: the tokens their admission reserves,
and a Responses error event whose ``code`` is null."""

import asyncio

import orjson
import pytest
from aiohttp import web
from raw_upstreams import raw_upstream

from kilnproxy.testing import MODEL

BODIES = {"embeddings": {"model": MODEL, "input": "hi"},
          "responses": {"model": MODEL, "input": "hi", "max_output_tokens": 5}}
ANSWERS = {
    "embeddings": {"object": "list", "model": "m", "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
                   "usage": {"prompt_tokens": 1, "total_tokens": 1}},
    "responses": {"id": "resp_1", "object": "response", "status": "completed", "model": "m", "output": [],
                  "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}},
}


@pytest.mark.parametrize("endpoint", list(BODIES))
async def test_admission_reserves_the_tokens_the_hold_counts(harness, endpoint):
    """An embedding reserves its input only, a Responses request its input and ``max_output_tokens``: with
    a bound of 1,000 tokens a minute and a context window of 32,768, a second request is admitted while the
    first is still at the upstream."""
    entered: asyncio.Queue = asyncio.Queue()
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        entered.put_nowait(None)
        await release.wait()
        return web.json_response(ANSWERS[endpoint])
    app = web.Application()
    app.router.add_post(f"/v1/{endpoint}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"

    def configure(config):
        config["models"][0].update(upstreams=[url], endpoints=[endpoint], context_window=32768)
        config["orgs"][0]["tokens_per_minute"] = 1000
    try:
        async with harness(configure=configure) as h:
            async def post() -> int:
                async with h.post(f"/v1/{endpoint}", BODIES[endpoint]) as resp:
                    return resp.status
            first = asyncio.create_task(post())
            await entered.get()
            second = asyncio.create_task(post())
            reached = asyncio.create_task(entered.get())
            done, _ = await asyncio.wait({second, reached}, return_when=asyncio.FIRST_COMPLETED)
            release.set()
            assert reached in done, f"the second request was answered {second.result()} at admission"
            assert (await first, await second) == (200, 200)
    finally:
        await runner.cleanup()


async def test_a_responses_error_event_whose_code_is_null_is_an_upstream_error(harness):
    def event(kind: str, **data) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"
    stream = event("response.created", sequence_number=0, response={"id": "resp_1", "status": "in_progress",
                                                                    "model": "m", "output": []}) \
        + event("error", code=None, message="boom", param=None, sequence_number=1)
    async with raw_upstream(stream=stream) as url:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url], endpoints=["responses"])) as h:
            async with h.post("/v1/responses", {"model": MODEL, "input": "hi", "stream": True}) as resp:
                assert resp.status == 200
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert raw.endswith(b'"message":"boom","param":null,"sequence_number":1}\n\n')
    assert (row["status"], row["error_code"]) == (200, "upstream_error")
