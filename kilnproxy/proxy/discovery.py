"""The model servers' own catalogs: ``[[models]] discover = true`` (and the demo's ``--upstream``).

Each ``discover`` entry's upstreams are asked ``GET <base>/models`` at start-up
and again every ``INTERVAL`` seconds; every model listed is served under the
entry's ``id`` + its own id, sent upstream under its own id, with the entry's
pricing, context window and endpoints (``upstream.routes_from``). An upstream
that answers no list (an error, not JSON, no ``data``) adds nothing; when no
upstream of an entry answers one, the entry keeps what it found last, and
serves only its ``alias`` (sent as its ``upstream_model``) if it never found any.
"""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp
import orjson

from ..config import ModelConfig
from .gateway import Gateway
from .upstream import carry_over, routes_from

INTERVAL = 60.0  # seconds between two reads of the upstreams' lists
TIMEOUT = 5.0

log = logging.getLogger("kilnproxy")


class Discovery:
    def __init__(self, gw: Gateway, interval: float | None = None):
        self.gw = gw
        self.interval = INTERVAL if interval is None else interval
        self.task: asyncio.Task | None = None

    def entries(self) -> list[ModelConfig]:
        return [m for m in self.gw.config.models if m.discover]

    async def refresh(self) -> None:
        """Read every entry's lists once and swap the new routes in."""
        gw = self.gw
        found = dict(gw.discovered)
        for entry in self.entries():
            names = await self._listed(entry)
            if names:
                found[entry.id] = names
        found = {k: v for k, v in found.items() if any(e.id == k for e in self.entries())}
        if found == gw.discovered:
            return
        added = sorted(set(sum(found.values(), ())) - set(sum(gw.discovered.values(), ())))
        gw.discovered = found
        gw.routes = carry_over(gw.routes, routes_from(gw.config.models, gw.config.server, found))
        log.info("model discovery: %d model(s) served%s", len(gw.routes),
                 f"; new: {', '.join(added)}" if added else "")

    async def _listed(self, entry: ModelConfig) -> tuple[str, ...]:
        names: dict[str, None] = {}  # in the upstreams' order, each once
        token = os.environ.get(entry.upstream_api_key_env) if entry.upstream_api_key_env else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        for base in entry.upstreams:
            try:
                async with self.gw.session.get(f"{base}/models", headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as resp:
                    raw = await resp.read() if resp.status == 200 else b""
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("model discovery: %s/models: %s", base, type(exc).__name__)
                continue
            for name in model_ids(raw):
                names.setdefault(name)
        return tuple(names)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a bug; the catalog stays as it was and the next round tries again
                log.exception("model discovery failed")

    async def start(self) -> None:
        if not self.entries():
            return
        await self.refresh()
        self.task = asyncio.create_task(self.run(), name="kilnproxy-discovery")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
            self.task = None


def model_ids(raw: bytes) -> list[str]:
    """The ids of an OpenAI-style model list (``{"data": [{"id": ...}]}``; Ollama's and vLLM's too)."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return []
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]]
