"""What llama.cpp's real token counts turn into: the usage row, its API view, and the org's credits."""

from __future__ import annotations

import sqlite3

import pytest

from .support import GENERATION_HEADER, KEY, MODEL, events, frames, row


async def test_row_generation_endpoint_and_credits_agree(stack, http):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers) as resp:
        generation_id = resp.headers[GENERATION_HEADER]
        usage = events(frames(await resp.read()))[-1]["usage"]

    r = row(stack, generation_id)
    async with http.get(f"{stack.url}/v1/generations/{generation_id}", headers=headers) as resp:
        assert resp.status == 200
        assert await resp.json() == r
    assert (r["prompt_tokens"], r["completion_tokens"], r["cost"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["cost"])

    db = sqlite3.connect(stack.db)
    try:
        (spent,), = db.execute("SELECT SUM(cost) FROM usage_events WHERE org = 'acme'")
    finally:
        db.close()
    async with http.get(f"{stack.url}/v1/credits", headers=headers) as resp:
        credits = await resp.json()
    assert credits["org"] == "acme" and credits["granted"] == 100.0
    assert credits["spent"] == pytest.approx(spent, rel=1e-9) and spent > 0
    assert credits["remaining"] == pytest.approx(100.0 - spent, rel=1e-9)
