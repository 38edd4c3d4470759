"""The yardstick: the thinnest HTTP pass-through that could stand in for the gateway.

One shared ``ClientSession``; the request body is forwarded as it came, the
answer comes back with the upstream's status and content type; a streamed
answer is written to the client chunk by chunk as it arrives (each event of
a token-by-token upstream is written as soon as it is read). No auth, no
parsing, no accounting, no limits: whatever the gateway costs above this is
the price of its features.

    python bench/passthrough.py --port 9001 --upstream http://127.0.0.1:9000

The path is kept: ``POST /json/v1/completions`` goes to ``<upstream>/json/v1/completions``.
"""

import argparse
import asyncio

import aiohttp
import uvloop
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    session = request.app[SESSION]
    async with session.post(request.app[UPSTREAM] + request.path, data=body,
                            headers={"Content-Type": "application/json"}) as up:
        content_type = up.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": content_type})
        response = web.StreamResponse(status=up.status, headers={"Content-Type": content_type,
                                                                 "Cache-Control": "no-cache"})
        await response.prepare(request)
        async for chunk in up.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def session_ctx(app: web.Application):
    connector = aiohttp.TCPConnector(limit=0)
    app[SESSION] = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                         timeout=aiohttp.ClientTimeout(total=None))
    yield
    await app[SESSION].close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL; the request's path is appended")
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None,
                backlog=4096, shutdown_timeout=1, handler_cancellation=True, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
