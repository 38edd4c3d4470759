"""Recorded model-server streams in tests (docs/fixtures.md); ``kilnproxy.testing`` re-exports all of it.

``Replay`` serves fixtures as a model server (alone, or as a ``Harness``'s
upstream with ``replay=``), ``Recorder`` records a real one, ``RECORDINGS`` is
the folder of the recordings shipped with kilnproxy (``llamacpp/``: llama.cpp
serving Gemma 3 270M), and ``sse_frames`` / ``sse_events`` read what a client got.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from ..mock_servers.format import Fixture, load_all
from ..mock_servers.recorder import SAVED, create_recorder_app
from ..mock_servers.replay_server import create_replay_app
from ..sse import COMMENT, DONE, SSEParser
from ..web.server import Running, start_app

RECORDINGS = Path(__file__).parent.parent / "recordings"  # kilnproxy/recordings: shipped in the package


class Replay:
    """A replaying upstream: the fixtures of ``sources`` (files, folders or ``Fixture`` objects),
    with their recorded delays when ``timing`` is true, else as fast as possible. Give it to a
    ``Harness`` (``replay=``), or run it alone: ``async with Replay(path) as upstream`` (``upstream.url``)."""

    def __init__(self, *sources: Any, timing: bool = False):
        self.fixtures = [s for s in sources if isinstance(s, Fixture)]
        self.fixtures += load_all(*(s for s in sources if not isinstance(s, Fixture)))
        self.timing = timing

    @classmethod
    def of(cls, replay: Any) -> "Replay":
        if isinstance(replay, Replay):
            return replay
        return cls(*replay) if isinstance(replay, (list, tuple)) else cls(replay)

    async def start(self) -> Running:
        return await start_app(create_replay_app(self.fixtures, timing=self.timing), "127.0.0.1", 0)

    async def __aenter__(self) -> Running:
        self._running = await self.start()
        return self._running

    async def __aexit__(self, *exc) -> None:
        await self._running.stop()


class Recorder:
    """``async with Recorder(upstream_url, out_dir) as rec``: the recording pass-through of
    ``python -m kilnproxy record`` on a free port; send requests to ``rec.url``; ``rec.saved``
    lists the fixture files written so far."""

    def __init__(self, upstream: str, out: Path, secrets: tuple[str, ...] = ()):
        self.app = create_recorder_app(upstream, out, secrets)
        self.running: Running | None = None

    async def __aenter__(self) -> "Recorder":
        self.running = await start_app(self.app, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.running.stop()

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def saved(self) -> list[Path]:
        return self.app[SAVED]


def sse_frames(raw: bytes) -> list[bytes]:
    """A gateway's SSE body as its frames, checked: one ``data:`` or comment line and a blank line
    each, and the body ends right after its one ``data: [DONE]``."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    parts = raw[:-2].split(b"\n\n")
    for part in parts:
        assert b"\n" not in part and b"\r" not in part and (part[:6] == b"data: " or part[:1] == b":"), part
    assert parts.count(b"data: [DONE]") == 1, parts
    return parts


def sse_events(raw: bytes) -> list[Any]:
    """The JSON events of an SSE body (comments and ``[DONE]`` left out)."""
    parser = SSEParser()
    items = parser.feed(raw) + parser.close()
    return [orjson.loads(p) for kind, p in items if kind != COMMENT and p != DONE]
