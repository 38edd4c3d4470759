"""Live updates: committed usage rows fanned out to the inspector's SSE subscribers.

With capture on, requests are also announced as they start (``started``),
so the page can show them in flight and their streams as they grow.

``LiveHub.publish`` is a ``Gateway.commit_listeners`` entry: it runs in the
ledger's writer right after a commit, so it never waits and never raises.
Each subscriber has a bounded queue; one that falls ``QUEUE_SIZE`` rows behind
loses its queue and is told ``{"type": "reset"}`` (the page then reloads its
list), so a slow browser can never hold the gateway back or grow its memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from ..proxy.request_record import stored_text

log = logging.getLogger("kilnproxy.inspector")

QUEUE_SIZE = 1000
RESET = object()
CLOSED = object()


class Subscriber:
    __slots__ = ("queue", "lagging")

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue(QUEUE_SIZE)
        self.lagging = False

    def offer(self, item: Any) -> None:
        if self.lagging:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.lagging = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait(RESET)

    async def next(self) -> Any:
        item = await self.queue.get()
        if item is RESET:
            self.lagging = False
        return item


class LiveHub:
    def __init__(self, captured=None) -> None:
        self.subscribers: set[Subscriber] = set()
        self.captured = captured  # the CaptureRing, to flag rows whose capture can be opened

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def publish(self, rows: list[tuple[dict, Any]]) -> None:
        """The ledger committed ``rows`` (``(row, call)`` pairs): tell every subscriber."""
        if not self.subscribers:
            return
        try:
            for row, _ in rows:
                frame = event_frame({"type": "request", "row": self.row_json(row)})
                for sub in self.subscribers:
                    sub.offer(frame)
        except Exception:  # a listener must never break the ledger's writer
            log.exception("inspector: publishing committed rows failed")

    def reset(self) -> None:
        """Rows may have been missed (the feed across replicas was cut): every page reloads its list."""
        for sub in self.subscribers:
            sub.offer(RESET)

    def started(self, record) -> None:
        """A captured request began (``CaptureRing.on_start``): show it in flight until its row."""
        if not self.subscribers:
            return
        try:
            call = record.call
            frame = event_frame({"type": "started", "row": {
                "id": call.generation_id, "created_at": record.created_at, "org": call.org,
                "key_id": call.key_id, "model": stored_text(record.model),  # the client's, as its row keeps it
                "endpoint": call.endpoint, "captured": True}})
            for sub in self.subscribers:
                sub.offer(frame)
        except Exception:  # never into the request's path
            log.exception("inspector: announcing a request failed")

    def row_json(self, row: dict) -> dict:
        return {**row, "captured": self.captured is not None and row["id"] in self.captured}

    def close(self) -> None:
        """Shutdown: end every subscriber's stream so the server need not wait for it."""
        for sub in self.subscribers:
            sub.lagging = False
            try:
                sub.queue.put_nowait(CLOSED)
            except asyncio.QueueFull:
                sub.queue.get_nowait()
                sub.queue.put_nowait(CLOSED)


def event_frame(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
