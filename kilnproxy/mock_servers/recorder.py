"""``python -m kilnproxy record``: a pass-through that saves what a model server sends, as fixtures.

Every request is forwarded to the upstream (its path appended to the
upstream's origin, so ``--upstream`` may end in ``/v1`` or not) and every
response comes back as it arrives, byte chunk by byte chunk. Each POST below
``/v1/`` is also written to the output folder as one fixture (``kilnproxy.mock_servers.format``)
before its response ends: after the upstream's last byte, before the end of the
body goes to the client; when the client leaves first, as it leaves
(``end: client_gone``).

The upstream is asked for an uncompressed body (``Accept-Encoding: identity``).
A request may name its fixture with the ``X-Kilnproxy-Fixture`` header (not
forwarded); otherwise the file is ``NNNN-<endpoint>-<stream|json>-<status>.json``
with the next free number. Nothing secret is written (``kilnproxy.mock_servers.scrub``).
"""

from __future__ import annotations

import asyncio
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

import aiohttp
from aiohttp import web

from .json_text import loads
from .format import Chunk, Fixture
from .scrub import Scrubber, safe_url

NAME_HEADER = "X-Kilnproxy-Fixture"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "host", "content-length"}
SESSION = web.AppKey("recorder_session", aiohttp.ClientSession)
SAVED = web.AppKey("recorder_saved", list)


def create_recorder_app(upstream: str, out: Path, secrets: Iterable[str] = ()) -> web.Application:
    """The recording pass-through in front of ``upstream``; fixtures go to ``out`` (created if needed).

    ``secrets`` are extra values never to be written (e.g. an upstream key from the environment);
    ``app[SAVED]`` lists the files written, in order.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    origin = upstream.rstrip("/").removesuffix("/v1")
    extra = tuple(secrets)
    source = safe_url(origin)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SAVED] = []

    async def session(app: web.Application):
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as s:
            app[SESSION] = s
            yield

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        record = request.method == "POST" and request.path.startswith("/v1/")
        name = request.headers.get(NAME_HEADER)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_BY_HOP and k.lower() != NAME_HEADER.lower()}
        headers["Accept-Encoding"] = "identity"  # readable bytes, and no secret hidden in compressed data
        started = time.perf_counter()
        try:
            up = await app[SESSION].request(request.method, origin + request.path_qs, data=body,
                                            headers=headers, allow_redirects=False)
        except aiohttp.ClientError as exc:
            return web.Response(status=502, text=f"Bad gateway: {origin} failed: {type(exc).__name__}\n")
        async with up:
            take = _Take(request, body, up, started, time.perf_counter()) if record else None
            response = web.StreamResponse(status=up.status, reason=up.reason, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP})
            await response.prepare(request)
            try:
                async for data in up.content.iter_any():
                    if take is not None:
                        take.chunk(data)
                    await response.write(data)
            except aiohttp.ClientError:
                if take is None:
                    raise
                take.end = "reset"
            except (asyncio.CancelledError, ConnectionResetError):
                if take is not None:
                    take.end = "client_gone"
                    _save(app, take, source, out, name, extra)
                raise
            if take is not None:
                _save(app, take, source, out, name, extra)
            if take is not None and take.end == "reset":
                request.transport.close()  # the client sees the upstream's break too
                return response
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


class _Take:
    """One exchange being recorded."""

    def __init__(self, request: web.Request, body: bytes, up: aiohttp.ClientResponse, started: float,
                 headed: float):
        self.request = request
        self.body = body
        self.status = up.status
        self.headers = {str(k): v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP | {"date"}}
        self.headers_ms = _ms(headed - started)
        self.last = headed
        self.chunks: list[Chunk] = []
        self.end = "eof"

    def chunk(self, data: bytes) -> None:
        now = time.perf_counter()
        self.chunks.append(Chunk(_ms(now - self.last), data))
        self.last = now

    def fixture(self, source: str, scrubber: Scrubber) -> Fixture:
        try:
            body = loads(self.body)
        except ValueError:
            body = self.body.decode("utf-8", "replace")
        scrubber.learn_headers(self.request.headers)
        scrubber.learn_body(body)
        datas = scrubber.chunks([c.data for c in self.chunks])
        return Fixture(path=self.request.path, body=scrubber.body(body), status=self.status,
                       headers=scrubber.headers(self.headers), headers_ms=self.headers_ms,
                       chunks=[Chunk(c.ms, d) for c, d in zip(self.chunks, datas)], end=self.end,
                       recorded_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), source=source)


def _save(app: web.Application, take: _Take, source: str, out: Path, name: str | None,
          secrets: tuple[str, ...]) -> None:
    fixture = take.fixture(source, Scrubber(secrets))
    path = out / f"{_safe_name(name)}.json" if name else _next_free(out, fixture)
    app[SAVED].append(fixture.save(path))


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-") or "fixture"


def _next_free(out: Path, fixture: Fixture) -> Path:
    endpoint = fixture.path.removeprefix("/v1/").replace("/", "-")
    kind = "stream" if fixture.stream else "json"
    n = len(list(out.glob("*.json"))) + 1
    while True:
        path = out / f"{n:04d}-{endpoint}-{kind}-{fixture.status}.json"
        if not path.exists():
            return path
        n += 1


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
