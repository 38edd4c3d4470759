"""The model servers' own catalogs: ``[[models]] discover = true`` (and the demo's ``--upstream``).

Each ``discover`` entry's upstreams are asked ``GET <base>/models`` at start-up
and again every ``INTERVAL`` seconds; every model listed is served under the
entry's ``id`` + its own id, sent upstream under its own id, with the entry's
pricing, context window and endpoints (``upstream.routes_from``). An upstream
that answers no list (an error, not JSON, no ``data``) adds nothing; when no
upstream of an entry answers one, the entry keeps what it found last, and
serves only its ``alias`` (sent as its ``upstream_model``) if it never found any.

The ids come from a server the gateway does not control, and become catalog
ids: in URLs (``/v1/models/{id}``), the usage table, metrics labels, the log.
An id with a control character (C0, DEL, C1, or a Unicode line or paragraph
separator) or longer than ``MAX_ID_CHARS`` is refused: it is not served, and
the log says so once (again only when what an upstream lists that way
changes). The log shows ids escaped (``repr``) and cut to ``SHOWN_CHARS``, and
at most ``SHOWN_IDS`` of them a line, so a list cannot write lines of its own
or lines of any length into it.

What one list can make the gateway hold is bounded too: an answer is read up to
``MAX_LIST_BYTES`` (after decompression; a longer one is dropped unparsed and
counts as no list), and an entry serves the first ``MAX_MODELS`` usable ids its
upstreams list (the rest are not looked at). Each is said in the log once, and
again only when it stops and starts again (or, for the count, when the list's
length changes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Collection, NamedTuple

import aiohttp
import orjson

from ..config import ModelConfig
from .gateway import Gateway
from .upstream.routes import carry_over, routes_from

INTERVAL = 60.0  # seconds between two reads of the upstreams' lists
TIMEOUT = 5.0
MAX_LIST_BYTES = 1 << 20  # an answer read past this is dropped: self-hosted servers' lists are a few kB
MAX_MODELS = 1000  # served from one entry's lists: parsing and routing stay cheap, metrics and logs short
MAX_ID_CHARS = 256  # a longer id is refused: a model name or a model path, as servers list them, is shorter
NOT_IN_AN_ID = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # controls and line breaks
SHOWN_CHARS = 80  # of one id, in the log
SHOWN_IDS = 20  # ids named in one log line

log = logging.getLogger("kilnproxy")


class Discovery:
    def __init__(self, gw: Gateway, interval: float | None = None):
        self.gw = gw
        self.interval = INTERVAL if interval is None else interval
        self.task: asyncio.Task | None = None
        self.refused: dict[str, tuple[str, ...]] = {}  # an upstream's ids refused at its last answer
        self.too_long: set[str] = set()  # upstreams whose last answer was over MAX_LIST_BYTES
        self.cut: dict[str, int] = {}  # an upstream's list length, when its last list was cut at MAX_MODELS

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
        gw.routes_replaced()
        log.info("model discovery: %d model(s) served%s", len(gw.routes),
                 f"; new: {shown_ids(added)}" if added else "")

    async def _listed(self, entry: ModelConfig) -> tuple[str, ...]:
        names: dict[str, None] = {}  # in the upstreams' order, each once
        token = os.environ.get(entry.upstream_api_key_env) if entry.upstream_api_key_env else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        for base in entry.upstreams:
            try:
                async with self.gw.session.get(f"{base}/models", headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as resp:
                    raw = await bounded_body(resp) if resp.status == 200 else b""
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("model discovery: %s/models: %s", base, type(exc).__name__)
                continue
            if raw is None:
                if base not in self.too_long:
                    self.too_long.add(base)
                    log.warning("model discovery: %s/models: the list is over %d bytes; it is not read",
                                base, MAX_LIST_BYTES)
                continue
            self.too_long.discard(base)
            listed = model_ids(raw, MAX_MODELS - len(names), names)
            for name in listed.kept:
                names.setdefault(name)
            self._say_refused(base, listed.refused)
            self._say_cut(base, listed.length if listed.unread else 0)
        return tuple(names)

    def _say_refused(self, base: str, refused: list[str]) -> None:
        if tuple(refused) != self.refused.get(base, ()):
            self.refused[base] = tuple(refused)
            if refused:
                log.warning("model discovery: %s/models: %d model id(s) refused, with a control character "
                            "or longer than %d characters: %s", base, len(refused), MAX_ID_CHARS,
                            shown_ids(refused))

    def _say_cut(self, base: str, listed: int) -> None:
        """``listed``: the length of ``base``'s list when it was cut at ``MAX_MODELS``, else 0."""
        if listed != self.cut.get(base, 0):
            self.cut[base] = listed
            if listed:
                log.warning("model discovery: %s/models: the list names %d models; only the first %d that "
                            "can be served are", base, listed, MAX_MODELS)

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


async def bounded_body(resp: aiohttp.ClientResponse) -> bytes | None:
    """``resp``'s body, or None once it is over ``MAX_LIST_BYTES`` (then no more of it is read)."""
    if resp.content_length is not None and resp.content_length > MAX_LIST_BYTES:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > MAX_LIST_BYTES:
            return None
    return bytes(body)


class Listed(NamedTuple):
    kept: list[str]  # ids that can be served, in the list's order, each once
    refused: list[str]  # ids that cannot (``usable_id``)
    length: int  # the list's entries
    unread: int  # entries not looked at: the list had more than room for


def model_ids(raw: bytes, room: int = MAX_MODELS, known: Collection[str] = ()) -> Listed:
    """The ids of an OpenAI-style model list (``{"data": [{"id": ...}]}``; Ollama's and vLLM's too),
    each once, none of ``known``.

    At the first usable id past ``room`` new ones, the rest of the list is not looked at."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Listed([], [], 0, 0)
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return Listed([], [], 0, 0)
    seen = set(known)
    kept: list[str] = []
    refused: list[str] = []
    for i, m in enumerate(data):
        if not (isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]):
            continue
        name = m["id"]
        if not usable_id(name):
            refused.append(name)
        elif name not in seen:
            if len(seen) - len(known) >= room:
                return Listed(kept, refused, len(data), len(data) - i)
            seen.add(name)
            kept.append(name)
    return Listed(kept, refused, len(data), 0)


def usable_id(name: str) -> bool:
    """At most ``MAX_ID_CHARS`` characters, none of them a control character or a line break."""
    return len(name) <= MAX_ID_CHARS and not NOT_IN_AN_ID.search(name)


def shown_ids(names: list[str]) -> str:
    """``names`` for one log line: each escaped and cut (``shown``), at most ``SHOWN_IDS`` of them."""
    out = ", ".join(shown(n) for n in names[:SHOWN_IDS])
    return out + (f" and {len(names) - SHOWN_IDS} more" if len(names) > SHOWN_IDS else "")


def shown(name: str) -> str:
    """``repr`` of ``name`` (every character that is not printable escaped), its first ``SHOWN_CHARS``
    characters only, with its length when it was cut."""
    if len(name) <= SHOWN_CHARS:
        return repr(name)
    return f"{name[:SHOWN_CHARS]!r}... ({len(name)} characters)"
