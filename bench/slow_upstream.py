"""M5's upstream: streams that stay open until ``POST /release``.

Each ``POST /v1/completions`` gets its headers and one text chunk at once,
then waits; ``POST /release`` ends every open stream (finish chunk, usage
chunk, ``[DONE]``). ``GET /stats`` counts open and finished streams.

    python bench/slow_upstream.py --port 9002
"""

import argparse
import asyncio

import orjson
import uvloop
from aiohttp import web

RELEASE = web.AppKey("release", asyncio.Event)
STATS = web.AppKey("stats", dict)


def frame(text: str | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    event = {"id": "cmpl-slow", "object": "text_completion", "created": 0, "model": "org/Bench-7B",
             "choices": choices}
    if usage is not None:
        event["usage"] = usage
    return b"data: " + orjson.dumps(event) + b"\n\n"


FIRST = frame(" Paris")
LAST = (frame("", "length") + frame(None, usage={"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2})
        + b"data: [DONE]\n\n")


async def completions(request: web.Request) -> web.StreamResponse:
    await request.read()
    stats = request.app[STATS]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    stats["open"] += 1
    try:
        await response.write(FIRST)
        await request.app[RELEASE].wait()
        await response.write(LAST)
        await response.write_eof()
        stats["finished"] += 1
    finally:
        stats["open"] -= 1
    return response


async def release(request: web.Request) -> web.Response:
    request.app[RELEASE].set()
    return web.json_response(request.app[STATS])


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS])


async def on_startup(app: web.Application) -> None:
    app[RELEASE] = asyncio.Event()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application()
    app[STATS] = {"open": 0, "finished": 0}
    app.on_startup.append(on_startup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/release", release)
    app.router.add_get("/stats", stats)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096,
                shutdown_timeout=1, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
