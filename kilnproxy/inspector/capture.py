"""Capture of bodies and streams for the inspector: opt-in, bounded, off the path when off.

With ``[inspector] capture = false`` (the default) ``Gateway.capture`` is
``None`` and the request path checks that once per request; nothing else runs.
With capture on, ``CaptureRing.tap()`` gives each request a ``Tap`` that keeps:

* the client's body (as parsed, before any rule or plugin touched it);
* the body sent upstream (after the stream rules and ``rewrite_request``);
* streamed: each chunk of upstream bytes as the relay read it, and each write
  to the client (relayed events, keep-alives, the usage chunk, ``[DONE]``),
  both with their time since the request started;
* not streamed: the upstream's answer and the client's answer.

A tap stops recording once it holds ``capture_bytes`` and says ``truncated``.
The ring keeps the last ``capture_requests`` taps (oldest dropped first), so the
memory held is at most about their product. ``fixture_of`` turns a capture
into a fixture (docs/fixtures.md), for the inspector's "save as fixture".
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any

import orjson

from ..mock_servers.format import Chunk, Fixture
from ..mock_servers.scrub import Scrubber
from ..proxy.relay.event_json import read, write
from ..proxy.request_record import RequestRecord
from ..sse import COMMENT, SSEParser


class CaptureRing:
    """The taps of the last ``size`` requests, by generation id."""

    def __init__(self, size: int, max_bytes: int):
        self.size = size
        self.max_bytes = max_bytes
        self.taps: OrderedDict[str, Tap] = OrderedDict()
        self.on_start = None  # told of each request as its capture starts (the live feed's "started")

    def tap(self, record: RequestRecord, body: dict) -> "Tap":
        tap = Tap(record, self.max_bytes)
        tap.client_body = tap.keep(write(body))  # a lone surrogate escape as the client sent it
        self.taps[record.call.generation_id] = tap
        while len(self.taps) > self.size:
            self.taps.popitem(last=False)
        if self.on_start is not None:
            self.on_start(record)
        return tap

    def get(self, generation_id: str) -> "Tap | None":
        return self.taps.get(generation_id)

    def __contains__(self, generation_id: str) -> bool:
        return generation_id in self.taps


class Tap:
    """What one request carried; filled by the request path, read by the API."""

    __slots__ = ("started", "max_bytes", "used", "truncated", "client_body", "upstream_body",
                 "upstream_answer", "client_answer", "upstream_chunks", "client_writes")

    def __init__(self, record: RequestRecord, max_bytes: int):
        self.started = record.started  # not the record: the ring must hold no more than the bytes it counts
        self.max_bytes = max_bytes
        self.used = 0
        self.truncated = False
        self.client_body: bytes | None = None
        self.upstream_body: bytes | None = None
        self.upstream_answer: bytes | None = None
        self.client_answer: bytes | None = None
        self.upstream_chunks: list[tuple[float, bytes]] = []  # (ms, bytes read)
        self.client_writes: list[tuple[float, bytes]] = []  # (ms, bytes written)

    def keep(self, data: bytes) -> bytes | None:
        """``data`` if it fits in what is left, else as much as fits (and truncated is set)."""
        if self.truncated:
            return None
        room = self.max_bytes - self.used
        if len(data) > room:
            self.truncated = True
            data = data[:room]
        self.used += len(data)
        return data

    def ms(self) -> float:
        return round((time.perf_counter() - self.started) * 1000, 3)

    def snapshot(self) -> "Tap":
        """A copy that ``describe`` can read in another thread while the request adds to this one."""
        copy = Tap.__new__(Tap)
        for name in Tap.__slots__:
            setattr(copy, name, getattr(self, name))
        copy.upstream_chunks, copy.client_writes = list(self.upstream_chunks), list(self.client_writes)
        return copy

    # -- called by the request path (kilnproxy.proxy.request_observers.Tap) ------

    def sent_upstream(self, payload: bytes) -> None:
        self.upstream_body = self.keep(payload)

    def answer(self, upstream: bytes, client: bytes) -> None:
        self.upstream_answer = self.keep(upstream)
        self.client_answer = self.keep(client)

    def upstream_chunk(self, chunk: bytes) -> None:
        kept = self.keep(chunk)
        if kept:
            self.upstream_chunks.append((self.ms(), kept))

    def client_write(self, data: bytes) -> None:
        kept = self.keep(bytes(data))
        if kept:
            self.client_writes.append((self.ms(), kept))


# -- what the API shows -----------------------------------------------------------


def describe(tap: Tap, row: dict | None) -> dict[str, Any]:
    """The JSON form of a capture: bodies as text, both streams as timed events. A stream of more
    than ``LISTED_EVENTS`` events lists its first and last ``LISTED_EVENTS // 2``, with one event of
    kind ``omitted`` (and its ``count``) in their place: a capture of tiny events (1 MiB holds half
    a million ``:`` lines) would be a JSON answer twenty times its size, and a page no browser draws.

    It reads every byte of the capture (up to ``capture_bytes``): run it off the event loop
    (``asyncio.to_thread``) on a copy of the lists (``Tap.snapshot``)."""
    parser, upstream, datas = SSEParser(), _Events(), []  # datas: (ms, payload) of each data event

    def add(ms: float, items: list[tuple[int, bytes]]) -> None:
        for kind, payload in items:
            upstream.add(ms, "comment" if kind == COMMENT else "data", payload)
            if kind != COMMENT:
                datas.append((ms, payload))

    for ms, chunk in tap.upstream_chunks:
        add(ms, parser.feed(chunk))
    if tap.upstream_chunks:
        add(tap.upstream_chunks[-1][0], parser.close())
    client = _Events()
    for ms, chunk in tap.client_writes:
        for frame in chunk.split(b"\n\n"):
            if frame:
                client.add(ms, "comment" if frame[:1] == b":" else "data",
                           frame[6:] if frame[:6] == b"data: " else frame)
    return {
        "truncated": tap.truncated,
        "bytes": tap.used,
        "client_body": _text(tap.client_body),
        "upstream_body": _text(tap.upstream_body),
        "upstream_answer": _text(tap.upstream_answer),
        "client_answer": _text(tap.client_answer),
        "upstream_events": upstream.listed(),
        "client_events": client.listed(),
        "timing": _timing(datas, row),
    }


LISTED_EVENTS = 2000


class _Events:
    """A stream's events as ``describe`` lists them: the first and the last ``LISTED_EVENTS // 2``
    kept as they come, the others only counted."""

    __slots__ = ("head", "tail", "count", "omitted_ms")

    def __init__(self) -> None:
        self.head: list[tuple[float, str, bytes]] = []
        self.tail: deque[tuple[float, str, bytes]] = deque(maxlen=LISTED_EVENTS // 2)
        self.count = 0
        self.omitted_ms: float | None = None  # when the first event left out came

    def add(self, ms: float, kind: str, payload: bytes) -> None:
        self.count += 1
        if len(self.head) < LISTED_EVENTS // 2:
            self.head.append((ms, kind, payload))
            return
        if len(self.tail) == self.tail.maxlen and self.omitted_ms is None:
            self.omitted_ms = self.tail[0][0]
        self.tail.append((ms, kind, payload))

    def listed(self) -> list[dict[str, Any]]:
        events = [{"ms": ms, "kind": kind, "data": _text(payload)} for ms, kind, payload in self.head]
        omitted = self.count - len(self.head) - len(self.tail)
        if omitted:
            events.append({"ms": self.omitted_ms, "kind": "omitted", "count": omitted})
        events += [{"ms": ms, "kind": kind, "data": _text(payload)} for ms, kind, payload in self.tail]
        return events


def fixture_of(tap: Tap, row: dict, secrets: tuple[str, ...] = ()) -> Fixture | None:
    """The exchange with the upstream as a fixture: the body sent, and the chunks received with their
    delays (status and ``Content-Type`` are rebuilt from the row); None when nothing was received."""
    if tap.upstream_body is None or tap.truncated:
        return None
    if tap.upstream_chunks:
        times = [0.0, *(ms for ms, _ in tap.upstream_chunks)]
        chunks = [Chunk(round(times[i + 1] - times[i], 3) if i else 0.0, data)
                  for i, (_, data) in enumerate(tap.upstream_chunks)]
        content_type, headers_ms = "text/event-stream", tap.upstream_chunks[0][0]
    elif tap.upstream_answer is not None:
        chunks, content_type, headers_ms = [Chunk(0.0, tap.upstream_answer)], "application/json", row["ttft_ms"] or 0
    else:
        return None
    scrub = Scrubber(secrets)
    body = read(tap.upstream_body)
    scrub.learn_body(body)
    status = row["status"] if row["status"] in (400, 422) else 200
    datas = scrub.chunks([c.data for c in chunks])
    return Fixture(path=f"/v1/{row['endpoint']}", body=scrub.body(body), status=status,
                   headers={"Content-Type": content_type}, headers_ms=float(headers_ms),
                   chunks=[Chunk(c.ms, d) for c, d in zip(chunks, datas)],
                   end="client_gone" if row["disconnected"] else "eof", recorded_at=row["created_at"],
                   source=f"kilnproxy inspector capture {row['id']}")


def _timing(datas: list[tuple[float, bytes]], row: dict | None) -> dict[str, Any]:
    """TTFT, and tokens per second between the first and the last upstream event with choices
    (``datas``: the upstream's data events in order, parsed from each end until one has some)."""
    first = next((ms for ms, payload in datas if _has_choices(payload)), None)
    last = next((ms for ms, payload in reversed(datas) if _has_choices(payload)), None)
    tokens = row["completion_tokens"] if row else None
    rate = None
    if tokens and tokens > 1 and first is not None and last > first:
        rate = round((tokens - 1) / ((last - first) / 1000), 2)  # n tokens, n - 1 gaps
    return {"first_event_ms": first, "last_event_ms": last,
            "ttft_ms": row["ttft_ms"] if row else first, "tokens_per_second": rate}


def _has_choices(data: bytes) -> bool:
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(event, dict) and bool(event.get("choices"))


def _text(data: bytes | None) -> str | None:
    return None if data is None else data.decode("utf-8", errors="replace")
