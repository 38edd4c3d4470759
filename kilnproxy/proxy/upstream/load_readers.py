"""An upstream server's own load, read from the server (SPEC 13's ``load_poll``), off the request path.

A model server knows how many requests it is running and holding waiting,
including those that another gateway replica, or a client that bypasses the
gateway, sent it. Three kinds say so at their origin (an upstream
``http://h:8000/v1`` is read at ``http://h:8000/...``):

- llama.cpp: ``GET /metrics`` (with ``--metrics``): ``llamacpp:requests_processing``
  + ``llamacpp:requests_deferred``; or ``GET /slots``: the slots whose
  ``is_processing`` is true (it does not count the requests deferred);
- vLLM: ``GET /metrics``: ``vllm:num_requests_running`` + ``vllm:num_requests_waiting``,
  summed over their label sets (one per engine with data parallelism);
- SGLang: ``GET /metrics``: ``sglang:num_running_reqs`` + ``sglang:num_queue_reqs``,
  summed over their label sets; when the series carry a ``priority`` label
  (priority scheduling), only the aggregate ``priority=""`` ones count.

``load_of_metrics(text)`` and ``load_of_slots(body)`` read a body; either gives
None, never an exception, for a body that says nothing usable: garbage, none
of the families, a value that is not a finite count (NaN, ±Inf, negative, or
beyond ``MAX_LOAD``). Names are matched whole: ``vllm:num_requests_waiting_by_reason``
or ``sglang:num_running_reqs_offline_batch`` are other families.

``LoadPoller`` runs one background task per upstream origin in this process.
Each task reads ``/metrics``, then ``/slots``, remembers which answered (and
goes back to trying both when it stops answering), every ``interval`` seconds;
each read has a bounded time (``read_timeout``) and body (``MAX_BODY``). A
server that answers neither is tried again less and less often (up to every
``MAX_RETRY_SECONDS``). ``load(upstream_url)`` is a dict lookup: the last
read's load, or None when there is none or it is older than 3 × ``interval``
(the server stopped answering, hangs, or lies); so a request never waits for
a read, and a server that cannot be read costs nothing. This module knows
nothing of routes: the caller says which upstream URLs to watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from typing import Iterable, Mapping

import aiohttp
import orjson

log = logging.getLogger(__name__)

MAX_BODY = 4 * 1024 * 1024  # bytes read of one answer at most; a longer one says nothing
MAX_LOAD = 1_000_000  # requests: a server that says more lies
MAX_RETRY_SECONDS = 30.0  # a server that answers nothing usable is tried at least this often
STALE_AFTER = 3  # reads older than this many intervals are not used

# (running, waiting) families of each kind, in the order they are looked for
KINDS = (
    ("llamacpp", "llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ("vllm", "vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs"),
)
_WANTED = frozenset(name for _, running, waiting in KINDS for name in (running, waiting))
_PREFIXES = tuple(sorted({name.split(":", 1)[0] + ":" for name in _WANTED}))

Labels = tuple[tuple[str, str], ...]
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class _Malformed(Exception):
    """A sample line that is not Prometheus' text format."""


def origin_of(url: str) -> str:
    """``scheme://host[:port]`` of an upstream base URL (userinfo kept: the reads authenticate as the
    requests do), its path, query and fragment dropped."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not an absolute URL: {url!r}")
    for stop in "/?#":
        rest = rest.split(stop, 1)[0]
    return f"{scheme}://{rest}"


def samples(text: str, names: frozenset[str] = _WANTED) -> dict[str, list[tuple[Labels, float]]] | None:
    """The samples of the families ``names`` in a Prometheus (or OpenMetrics) text: name -> [(labels,
    value)]. Comments, blank lines and other families are skipped unread; a timestamp or an exemplar
    after the value is allowed. None when a line of a wanted family is malformed."""
    found: dict[str, list[tuple[Labels, float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith(_PREFIXES):
            continue
        end = _NAME.match(line).end()
        name = line[:end]
        if name not in names:
            continue
        try:
            labels, value = _sample(line, end)
        except (_Malformed, ValueError, IndexError):
            return None
        found.setdefault(name, []).append((labels, value))
    return found


def _sample(line: str, i: int) -> tuple[Labels, float]:
    labels: list[tuple[str, str]] = []
    n = len(line)
    if i < n and line[i] == "{":
        i += 1
        while True:
            while i < n and line[i] in " \t,":
                i += 1
            if i < n and line[i] == "}":
                i += 1
                break
            eq = line.index("=", i)
            key = line[i:eq].strip()
            if not key or line[eq + 1] != '"':
                raise _Malformed(line)
            i = eq + 2
            value: list[str] = []
            while True:
                ch = line[i]
                if ch == "\\":
                    nxt = line[i + 1]
                    value.append("\n" if nxt == "n" else nxt)
                    i += 2
                elif ch == '"':
                    i += 1
                    break
                else:
                    value.append(ch)
                    i += 1
            labels.append((key, "".join(value)))
    elif i < n and line[i] not in " \t":
        raise _Malformed(line)
    rest = line[i:].split("#", 1)[0].split()  # value [timestamp], then an OpenMetrics exemplar
    if not 1 <= len(rest) <= 2 or "_" in rest[0]:  # (Python's float() takes "1_000"; Prometheus does not)
        raise _Malformed(line)
    return tuple(labels), float(rest[0])


def _total(series: list[tuple[Labels, float]]) -> float:
    """The sum over label sets; with a ``priority`` label (SGLang's priority scheduling), the aggregate
    series (``priority=""``) alone when there is one."""
    if any(key == "priority" for labels, _ in series for key, _ in labels):
        aggregate = [v for labels, v in series if ("priority", "") in labels]
        if aggregate:
            return sum(aggregate)
    return sum(v for _, v in series)


def read_metrics(text: str) -> tuple[str, int] | None:
    """(kind, requests running plus waiting) by the first kind whose running family the text has
    (``llamacpp``, ``vllm``, ``sglang``); None when it has none, or a line of them is malformed, or the
    count is not a finite one below ``MAX_LOAD``."""
    found = samples(text)
    if not found:
        return None
    for kind, running, waiting in KINDS:
        if running in found:
            parts = [found[running], found.get(waiting, [])]
            if any(not math.isfinite(v) or v < 0 for series in parts for _, v in series):
                return None
            load = _count(_total(parts[0]) + _total(parts[1]))
            return None if load is None else (kind, load)
    return None


def load_of_metrics(text: str) -> int | None:
    """``read_metrics``' load alone."""
    read = read_metrics(text)
    return None if read is None else read[1]


def load_of_slots(body: bytes) -> int | None:
    """llama.cpp's ``GET /slots``: the slots with ``is_processing`` true; None for anything but a list
    of objects."""
    try:
        slots = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return None
    return _count(sum(1 for s in slots if s.get("is_processing") is True))


def _count(total: float) -> int | None:
    return int(round(total)) if 0 <= total < MAX_LOAD else None


class _Origin:
    """One origin's reads: what answered last and the last load read (monotonic time)."""

    __slots__ = ("origin", "headers", "path", "kind", "load", "at", "task", "reads", "failures", "stale_after")

    def __init__(self, origin: str, headers: Mapping[str, str] | None, stale_after: float = math.inf):
        self.origin = origin
        self.headers = dict(headers or {})
        self.path: str | None = None  # "/metrics" or "/slots" once one answered
        self.kind: str | None = None  # "llamacpp", "vllm" or "sglang" once read
        self.load: int | None = None
        self.at = -math.inf
        self.task: asyncio.Task | None = None
        self.reads = 0  # reads that gave a load, for tests and /metrics
        self.failures = 0  # polls in a row that gave none
        self.stale_after = stale_after  # seconds after which a read is not used (its poller's 3 intervals)


class LoadPoller:
    """The upstream servers' own loads, read every ``interval`` seconds by one task per origin."""

    PATHS = ("/metrics", "/slots")

    def __init__(self, interval: float = 1.0, read_timeout: float | None = None):
        if interval <= 0:
            raise ValueError("interval must be greater than 0 (load_poll = 0: no poller)")
        self.interval = float(interval)
        self.read_timeout = read_timeout if read_timeout is not None else max(0.25, min(self.interval, 5.0))
        self.stale_after = STALE_AFTER * self.interval
        self._origins: dict[str, _Origin] = {}
        self._of_url: dict[str, _Origin] = {}  # upstream base URL -> its origin's state
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def load(self, upstream_url: str) -> int | None:
        """The server's own load as last read, or None (not watched, never read, or read too long ago)."""
        state = self._of_url.get(upstream_url)
        if state is None or state.load is None or time.monotonic() - state.at > self.stale_after:
            return None
        return state.load

    def watch(self, urls: Iterable[str], headers: Mapping[str, Mapping[str, str]] | None = None) -> None:
        """Read the origins of ``urls`` from now on (``headers``: by URL, sent with its origin's reads,
        e.g. an upstream's Authorization); origins no longer among them are no longer read. Call it
        again after a reload; it must run in the event loop."""
        if self._closed:
            raise RuntimeError("the poller is closed")
        headers = headers or {}
        of_url: dict[str, _Origin] = {}
        for url in urls:
            origin = origin_of(url)
            state = self._origins.get(origin)
            if state is None:
                state = self._origins[origin] = _Origin(origin, headers.get(url), self.stale_after)
            elif url in headers:
                state.headers = dict(headers[url])
            of_url[url] = state
        kept = {id(s) for s in of_url.values()}
        for origin, state in list(self._origins.items()):
            if id(state) not in kept:
                del self._origins[origin]
                if state.task is not None:
                    state.task.cancel()
        self._of_url = of_url
        for state in self._origins.values():
            if state.task is None:
                state.task = asyncio.get_running_loop().create_task(self._poll(state), name=f"load {state.origin}")

    def state_of(self, upstream_url: str) -> _Origin | None:
        """The watched origin of ``upstream_url`` (its ``load``, ``at`` and ``stale_after``), or None: what
        a slot pool holds to read the load itself, with no call per request."""
        return self._of_url.get(upstream_url)

    def origins(self) -> dict[str, _Origin]:
        return dict(self._origins)

    async def close(self) -> None:
        """Stop every task and close the session."""
        self._closed = True
        tasks = [s.task for s in self._origins.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._origins.clear()
        self._of_url = {}
        if self._session is not None:
            await self._session.close()

    async def read_once(self, state: _Origin) -> int | None:
        """One poll of an origin: the remembered path, else each path in turn; the load or None."""
        paths = (state.path,) if state.path else self.PATHS
        for path in paths:
            load = await self._read(state, path)
            if load is not None:
                state.path = path
                return load
        if state.path is not None:  # what answered before does not: try every path next time
            state.path = None
        return None

    async def _poll(self, state: _Origin) -> None:
        while True:
            try:
                load = await self.read_once(state)
            except Exception:  # whatever a server answers, the task reads on (and the load is unknown)
                log.exception("reading the load of %s", state.origin)
                load = None
            if load is not None:
                state.load, state.at = load, time.monotonic()
                state.reads += 1
                state.failures = 0
                await asyncio.sleep(self.interval)
            else:
                state.failures += 1
                await asyncio.sleep(min(self.interval * 2 ** min(state.failures - 1, 16), max(self.interval,
                                                                                             MAX_RETRY_SECONDS)))

    async def _read(self, state: _Origin, path: str) -> int | None:
        """GET origin+path within ``read_timeout``: its load, or None for any failure whatsoever."""
        try:
            async with asyncio.timeout(self.read_timeout):
                async with self._client().get(state.origin + path, headers=state.headers) as resp:
                    if resp.status != 200:
                        return None
                    body = await _read_capped(resp.content, MAX_BODY)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None
        if body is None:
            return None
        if path == "/slots":
            load = load_of_slots(body)
            if load is not None:
                state.kind = "llamacpp"
            return load
        try:
            read = read_metrics(body.decode("utf-8"))
        except UnicodeDecodeError:
            return None
        if read is None:
            return None
        state.kind = read[0]
        return read[1]

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # its own session: no cookie jar, no decompression surprises, few connections
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, limit_per_host=2, enable_cleanup_closed=False),
                timeout=aiohttp.ClientTimeout(total=None), cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent",), raise_for_status=False)
        return self._session


async def _read_capped(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The body, or None when it is longer than ``limit`` bytes (no more than that is read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await content.read(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
