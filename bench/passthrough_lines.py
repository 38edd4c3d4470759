"""The pass-through of ``passthrough.py``, relaying a stream line by line instead of chunk by chunk.

What a proxy that reads SSE the usual way does (``async for line in
up.content``): one ``write`` per line, each line found by aiohttp's reader.
M3 shows it beside the chunk-copying pass-through and kilnproxy: the price of
touching each line in Python at all, before any rule is applied.

    python bench/passthrough_lines.py --port 9001 --upstream http://127.0.0.1:9000
"""

import passthrough
from aiohttp import web


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    session = request.app[passthrough.SESSION]
    async with session.post(request.app[passthrough.UPSTREAM] + request.path, data=body,
                            headers={"Content-Type": "application/json"}) as up:
        content_type = up.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": content_type})
        response = web.StreamResponse(status=up.status, headers={"Content-Type": content_type,
                                                                 "Cache-Control": "no-cache"})
        await response.prepare(request)
        async for line in up.content:
            await response.write(line)
        await response.write_eof()
        return response


if __name__ == "__main__":
    passthrough.forward = forward  # main() routes every POST to passthrough.forward
    passthrough.main()
