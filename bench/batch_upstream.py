"""The Batch API bench's model server: each completion answered after ``--service`` seconds (one slot turn).

``GET /stats?prefix=`` counts the requests whose prompt starts with ``prefix``
(``{"requests": n, "repeated": prompts asked more than once}``);
``GET /arrivals`` gives the time (Unix seconds) each prompt starting with ``live-`` arrived (the bench's
interactive requests: how long each took to get through the gateway to here).

    python bench/batch_upstream.py --port 9003 --service 0.02
"""

import argparse
import asyncio
import time
from collections import Counter

import orjson
import uvloop
from aiohttp import web

SEEN = web.AppKey("seen", Counter)
SERVICE = web.AppKey("service", float)
ARRIVED = web.AppKey("arrived", dict)


async def completions(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    prompt = str(body.get("prompt"))
    if prompt.startswith("live-"):
        request.app[ARRIVED][prompt] = time.time()
    request.app[SEEN][prompt] += 1
    await asyncio.sleep(request.app[SERVICE])
    return web.Response(body=orjson.dumps({
        "id": "cmpl-batch-bench", "object": "text_completion", "created": 0, "model": body.get("model"),
        "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}), content_type="application/json")


async def arrivals(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(request.app[ARRIVED]), content_type="application/json")


async def stats(request: web.Request) -> web.Response:
    prefix = request.query.get("prefix", "")
    seen = [n for prompt, n in request.app[SEEN].items() if prompt.startswith(prefix)]
    return web.json_response({"requests": sum(seen), "repeated": sum(1 for n in seen if n > 1)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", type=float, default=0.02)
    args = parser.parse_args()
    app = web.Application()
    app[SEEN], app[SERVICE], app[ARRIVED] = Counter(), args.service, {}
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/stats", stats)
    app.router.add_get("/arrivals", arrivals)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
