"""Batch API inputs and waits, for the tests of ``kilnproxy.batches`` (in-process gateways and processes).

``jsonl(lines)`` writes an input file's bytes; ``line(i, ...)`` one request line for the test model;
``ended(client, batch_id)`` waits (a few ms at a time) until the batch reached a status where it stays;
``jsonl_lines(text)`` reads an output or error file back.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kilnproxy.testing import MODEL

FINAL = ("completed", "failed", "expired", "cancelled")


def line(i: int, url: str = "/v1/completions", **body: Any) -> dict[str, Any]:
    """A line asking the test model for a short completion of its own prompt (``p<i>``)."""
    if url == "/v1/chat/completions":
        base = {"model": MODEL, "messages": [{"role": "user", "content": f"p{i}"}], "max_tokens": 3}
    elif url == "/v1/embeddings":
        base = {"model": MODEL, "input": f"p{i}"}
    else:
        base = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 3}
    return {"custom_id": f"line-{i}", "method": "POST", "url": url, "body": {**base, **body}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in lines)


def jsonl_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(t) for t in text.splitlines() if t.strip()]


async def ended(client, batch_id: str, statuses: tuple[str, ...] = FINAL, timeout: float = 60.0):
    """The batch (the SDK's object) once its status is one of ``statuses``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (batch := await client.batches.retrieve(batch_id)).status not in statuses:
        assert loop.time() < deadline, f"batch {batch_id} still {batch.status} after {timeout} s"
        await asyncio.sleep(0.01)
    return batch


async def submitted(client, lines: list[Any], endpoint: str = "/v1/completions", **create: Any):
    """Upload ``lines`` and create a batch on them: (the file, the batch)."""
    upload = await client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h",
                                        **create)
    return upload, batch


class GatedUpstream:
    """A model server in the test's process that answers each completion only when the test lets it:
    ``allow(n)`` lets ``n`` more answers go; ``arrived`` counts the requests that came (``arrivals(n)``
    waits for them). Answers are whole JSON completions of 2 prompt and 1 completion tokens."""

    def __init__(self) -> None:
        from aiohttp import web
        self.allowed = 0
        self.arrived = 0
        self.bodies: list[dict] = []
        self._changed = asyncio.Condition()
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._answer)
        self.app.router.add_post("/v1/chat/completions", self._answer)
        self.runner: Any = None
        self.url = ""

    async def __aenter__(self) -> "GatedUpstream":
        from aiohttp import web
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    async def allow(self, n: int = 1) -> None:
        async with self._changed:
            self.allowed += n
            self._changed.notify_all()

    async def arrivals(self, n: int, timeout: float = 30.0) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.arrived >= n), timeout)

    async def _answer(self, request):
        from aiohttp import web
        body = await request.json()
        async with self._changed:
            self.arrived += 1
            self.bodies.append(body)
            self._changed.notify_all()
            await self._changed.wait_for(lambda: self.allowed > 0)
            self.allowed -= 1
        return web.json_response({
            "id": "cmpl-gated", "object": "text_completion", "created": 1, "model": body.get("model"),
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})
