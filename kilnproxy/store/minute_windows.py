"""Per-minute limits in one process: the admissions of the last 60 seconds of each org and key.

A request admitted under a ``requests_per_minute`` or ``tokens_per_minute``
bound leaves an ``Entry`` in the window of its org and of its key: it counts
as one request and as the tokens reserved for it (its prompt estimate plus
``max_tokens``, or the context window) until its row settles them to the real
count. An entry leaves the windows 60 seconds after its admission, so the
bounds hold over any 60 seconds, not per calendar minute. Each window keeps
running totals: a check costs no walk over its entries.
"""

from __future__ import annotations

import time
from collections import deque

WINDOW_SECONDS = 60.0


class Entry:
    __slots__ = ("at", "tokens", "windows")

    def __init__(self, at: float, tokens: int):
        self.at = at
        self.tokens = tokens
        self.windows: list[Window] = []


class Window:
    __slots__ = ("entries", "requests", "tokens")

    def __init__(self) -> None:
        self.entries: deque[Entry] = deque()
        self.requests = 0
        self.tokens = 0

    def trim(self, now: float) -> None:
        entries, start = self.entries, now - WINDOW_SECONDS
        while entries and entries[0].at <= start:
            entry = entries.popleft()
            self.requests -= 1
            self.tokens -= entry.tokens
            entry.windows.remove(self)

    def full(self, requests_per_minute: int | None, tokens_per_minute: int | None) -> bool:
        """The next admission would pass a bound: as many requests as allowed already, or the tokens
        used and reserved by the others at or above the bound (so a minute overruns by one request)."""
        return (requests_per_minute is not None and self.requests >= requests_per_minute
                or tokens_per_minute is not None and self.tokens >= tokens_per_minute)

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.requests += 1
        self.tokens += entry.tokens
        entry.windows.append(self)


class MinuteWindows:
    """The windows of every org and key with a per-minute bound, and the entries not yet settled."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._windows: dict[str, Window] = {}
        self._open: dict[str, Entry] = {}  # generation id -> its entry, until its row settles it

    def full(self, bounds: list[tuple[str, int | None, int | None]]) -> str | None:
        """The first of ``(window name, requests_per_minute, tokens_per_minute)`` that is full, or None."""
        now = self.clock()
        for name, rpm, tpm in bounds:
            window = self._windows.get(name)
            if window is not None:
                window.trim(now)
                if window.full(rpm, tpm):
                    return name
        return None

    def take(self, generation_id: str, tokens: int, names: list[str]) -> None:
        entry = Entry(self.clock(), tokens)
        for name in names:
            window = self._windows.get(name)
            if window is None:
                window = self._windows[name] = Window()
            window.add(entry)
        self._open[generation_id] = entry

    def settle(self, generation_id: str, tokens: int) -> None:
        """The request's row: its real token count replaces what was reserved (in the windows it
        is still in)."""
        entry = self._open.pop(generation_id, None)
        if entry is None:
            return
        delta = tokens - entry.tokens
        entry.tokens = tokens
        for window in entry.windows:
            window.tokens += delta

    def usage(self, name: str) -> tuple[int, int]:
        """``(requests, tokens)`` of the window ``name`` over the last 60 s (metrics, tests)."""
        window = self._windows.get(name)
        if window is None:
            return 0, 0
        window.trim(self.clock())
        return window.requests, window.tokens
