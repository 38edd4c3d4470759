"""The fixture sub-commands: ``record``, ``replay FIXTURE --against URL`` and ``mock-upstream --replay``."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import aiohttp

from ..errors import KilnError
from ..mock_servers.format import Fixture, load, load_all


def add_fixture_commands(sub) -> None:
    rec = sub.add_parser("record", help="a recording pass-through: save what a model server sends as fixtures")
    rec.add_argument("--upstream", required=True, metavar="URL", help="the OpenAI-compatible server to record")
    rec.add_argument("--out", required=True, metavar="DIR", help="folder the fixtures are written to")
    rec.add_argument("--host", default="127.0.0.1")
    rec.add_argument("--port", type=int, default=8001)
    rec.add_argument("--secret-env", action="append", default=[], metavar="NAME",
                     help="an environment variable whose value must never be written (repeatable)")
    rec.set_defaults(func=cmd_record)

    rep = sub.add_parser("replay", help="send a fixture's request to another server; show how the answer's "
                                        "shape differs (exit 1 when it does)")
    rep.add_argument("fixture", help="a fixture file")
    rep.add_argument("--against", required=True, metavar="URL", help="the OpenAI-compatible server to ask")
    rep.add_argument("--model", help="the model name that server knows (default: the fixture's)")
    rep.set_defaults(func=cmd_replay)


def add_replay_options(mock: argparse.ArgumentParser) -> None:
    mock.add_argument("--replay", metavar="DIR", help="serve the fixtures of this folder instead of mock answers")
    mock.add_argument("--timing", action="store_true", help="with --replay: wait the recorded delays")


def cmd_record(args) -> int:
    from ..mock_servers.recorder import create_recorder_app
    from ..web import server
    missing = [name for name in args.secret_env if not os.environ.get(name)]
    if missing:
        raise KilnError(f"--secret-env {missing[0]}: that variable is not set")
    app = create_recorder_app(args.upstream, Path(args.out), [os.environ[n] for n in args.secret_env])

    async def main() -> None:
        try:
            running = await server.start_app(app, args.host, args.port)
        except OSError as exc:
            raise KilnError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
        try:
            await server.wait_for_signal(lambda: print(
                f"recording {args.upstream} on {running.url}/v1 into {args.out}", flush=True))
        finally:
            await running.stop()

    server.run(main)
    return 0


def serve_replay(args) -> int:
    from ..mock_servers.replay_server import create_replay_app
    from ..web import server
    fixtures = load_all(args.replay)
    if not fixtures:
        raise KilnError(f"--replay {args.replay}: no *.json fixture in that folder")

    async def main() -> None:
        running = await server.start_app(create_replay_app(fixtures, timing=args.timing), args.host, args.port)
        try:
            await server.wait_for_signal(lambda: print(
                f"replaying {len(fixtures)} fixture(s) from {args.replay} on {running.url}/v1", flush=True))
        finally:
            await running.stop()

    server.run(main)
    return 0


def cmd_replay(args) -> int:
    from ..mock_servers.shape import differences, shape
    fixture = load(args.fixture)
    recorded = shape(fixture.status, fixture.headers.get("Content-Type", ""), [c.data for c in fixture.chunks])
    frames = fixture.content.count(b"\n\n") if fixture.end == "client_gone" else None
    status, content_type, chunks = asyncio.run(ask(fixture, args.against, args.model, frames))
    lines = differences(recorded, shape(status, content_type, chunks))
    if frames is not None:
        print(f"(its client left after {frames} frames: those are compared)")
    for line in lines:
        print(line)
    print(f"{args.fixture}: {len(lines)} difference(s) in shape against {args.against}")
    return 1 if lines else 0


async def ask(fixture: Fixture, url: str, model: str | None,
              frames: int | None = None) -> tuple[int, str, list[bytes]]:
    """Send the fixture's request to ``url``; the answer's status, content type and chunks (only its
    first ``frames`` SSE frames when given, as the recording's client did)."""
    body = fixture.body
    if model is not None and isinstance(body, dict):
        body = {**body, "model": model}
    origin = url.rstrip("/").removesuffix("/v1")
    try:
        async with aiohttp.ClientSession(auto_decompress=True) as session:
            send = {"data": body.encode()} if isinstance(body, str) else {"json": body}
            async with session.request(fixture.method, origin + fixture.path, **send) as resp:
                chunks = []
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
                    if frames is not None and b"".join(chunks).count(b"\n\n") >= frames:
                        kept = b"".join(chunks).split(b"\n\n")[:frames]
                        chunks = [b"".join(f + b"\n\n" for f in kept)]
                        break
                return resp.status, resp.headers.get("Content-Type", ""), chunks
    except aiohttp.ClientError as exc:
        raise KilnError(f"{url}: {type(exc).__name__}: {exc}") from None
