"""The framed relay's frames (Responses API, Anthropic Messages) whatever the chunk boundaries and the blank
lines between them."""

from __future__ import annotations

import anthropic
import orjson
from test_apis_leftovers import MESSAGE, MESSAGES_END, claude, event, messages_stream, serving
from test_streaming import raw_upstream

from kilnproxy.testing import MODEL


def sse_events(raw: bytes) -> list[tuple[str | None, dict]]:
    """``raw`` as an SSE client reads it: each dispatched event's name and its data as JSON (a blank line with
    no data before it dispatches nothing and forgets the name)."""
    events, name, data = [], None, []
    for line in raw.split(b"\n"):
        if not line:
            if data:
                events.append((name, orjson.loads(b"\n".join(data))))
            name, data = None, []
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
    return events


async def test_a_frame_the_gateway_reads_keeps_its_event_name_when_an_extra_blank_line_follows_it(harness):
    """Some servers end each event with two blank lines. A frame the gateway rewrites (here ``message_start``,
    ``message_delta`` and ``message_stop``) at the end of a chunk then came with a newline after its data:
    it was written back with a blank line between its ``event:`` and ``data:`` lines, which an SSE client
    reads as a nameless event, and the Anthropic SDK skips (it never saw ``message_stop``)."""
    frames = messages_stream("Hi", " there") + MESSAGES_END
    async with raw_upstream(stream=b"\n".join(frames) + b"\n") as url:
        async with harness(configure=serving(url, "messages")) as h:
            body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with h.post("/v1/messages", body) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
            async with claude(h).messages.stream(model=MODEL, max_tokens=9,
                                                  messages=[{"role": "user", "content": "hi"}]) as stream:
                seen = [e.type async for e in stream]
    names = ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
             "content_block_stop", "message_delta", "message_stop"]
    assert [(name, data["type"]) for name, data in sse_events(raw)] == [(n, n) for n in names]
    assert sse_events(raw)[0][1]["message"]["model"] == MODEL and "cost" in sse_events(raw)[5][1]["usage"]
    assert seen[0] == "message_start" and seen[-1] == "message_stop"
    assert (row["status"], row["error_code"], row["prompt_tokens"], row["completion_tokens"]) == (200, None, 3, 3)
