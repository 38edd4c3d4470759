"""A model server that replays fixtures: ``python -m kilnproxy mock-upstream --replay DIR``.

Matching (SPEC section 1): the fixture whose path and body equal the
request's; else the first (by file name) with the same path, the same body
``model`` and the same ``stream`` truth value; else a 404 JSON error whose
message names the path, model and stream asked for. The response is the
recorded status and headers, and the body as the recorded chunks, one write
each (the same chunk boundaries on the wire, though a slow reader's TCP stack
may still join them). ``timing=True`` also waits the recorded delays; the
default sends everything at once. How the recorded body ended is replayed:
``eof`` ends it, ``reset`` drops the connection, ``client_gone`` keeps it open
until the client leaves, as the model server would have gone on generating.

``GET /v1/models`` lists the fixtures' models; ``/mock/requests``,
``/mock/stats`` and ``/mock/wait`` work as the mock upstream's do (so
``Harness`` helpers work on both), and each logged request names its fixture.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from .fixture import Fixture, truthy
from .mock_upstream import CHANGED, LOG, STATS, bump, make_condition, health, requests_seen, stats, wait

FIXTURES = web.AppKey("replay_fixtures", list)
SKIP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


def find(fixtures: list[Fixture], method: str, path: str, body: Any) -> Fixture | None:
    """The fixture that answers this request (SPEC section 1), or None."""
    same_path = [f for f in fixtures if f.method == method and f.path == path]
    for fixture in same_path:
        if fixture.body == body:
            return fixture
    if not isinstance(body, dict):
        return None
    stream = truthy(body.get("stream"))
    for fixture in same_path:
        if fixture.model == body.get("model") and fixture.stream == stream:
            return fixture
    return None


def create_replay_app(fixtures: list[Fixture], *, timing: bool = False) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[FIXTURES] = list(fixtures)
    app[STATS] = {"requests": 0, "open": 0, "hangups": 0, "completed": 0}
    app[LOG] = []
    app.on_startup.append(make_condition)

    async def models(request: web.Request) -> web.Response:
        ids = dict.fromkeys(f.model for f in app[FIXTURES] if isinstance(f.model, str))
        return _json({"object": "list", "data": [{"id": i, "object": "model", "owned_by": "replay"} for i in ids]})

    async def answer(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        app[STATS]["requests"] += 1
        fixture = find(app[FIXTURES], request.method, request.path, body)
        app[LOG].append({"path": request.path, "body": body,
                         "headers": {str(k): v for k, v in request.headers.items()},
                         "fixture": fixture.file.name if fixture is not None and fixture.file else None})
        del app[LOG][:-200]
        if fixture is None:
            return _not_found(request, body, len(app[FIXTURES]))
        return await play(request, fixture, timing)

    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/mock/requests", requests_seen)
    app.router.add_get("/mock/stats", stats)
    app.router.add_get("/mock/wait", wait)
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


async def play(request: web.Request, fixture: Fixture, timing: bool) -> web.StreamResponse:
    app = request.app
    if timing:
        await asyncio.sleep(fixture.headers_ms / 1000)
    response = web.StreamResponse(status=fixture.status, headers={
        k: v for k, v in fixture.headers.items() if k.lower() not in SKIP_HEADERS})
    await response.prepare(request)
    await bump(app, "open")
    try:
        for chunk in fixture.chunks:
            if timing and chunk.ms:
                await asyncio.sleep(chunk.ms / 1000)
            await response.write(chunk.data)
        if fixture.end == "reset":
            request.transport.close()
            return response
        if fixture.end == "client_gone":
            await asyncio.Event().wait()  # until the client hangs up and this handler is cancelled
        await response.write_eof()
        await bump(app, "completed")
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        await bump(app, "hangups")
        raise
    finally:
        app[STATS]["open"] -= 1
        async with app[CHANGED]:
            app[CHANGED].notify_all()


def _not_found(request: web.Request, body: Any, loaded: int) -> web.Response:
    model = body.get("model") if isinstance(body, dict) else None
    stream = truthy(body.get("stream")) if isinstance(body, dict) else False
    message = (f"No fixture answers {request.method} {request.path} with model `{model}` and stream "
               f"{str(stream).lower()} ({loaded} fixture(s) loaded).")
    return _json({"error": {"message": message, "type": "not_found_error", "param": "model",
                            "code": "fixture_not_found"}}, 404)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")
