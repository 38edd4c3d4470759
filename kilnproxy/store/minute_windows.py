"""Per-minute limits in one process: the admissions of the last 60 seconds of each org and key.

A request admitted under a ``requests_per_minute`` or ``tokens_per_minute``
bound takes a place in the window of its org and of its key: it counts as one
request and as the tokens reserved for it (its prompt estimate plus
``max_tokens``, or the context window) until its row settles them to the real
count. A place leaves the window 60 seconds after its admission, so the bounds
hold over any 60 seconds, not per calendar minute. Each window keeps running
totals: a check costs no walk over its places.

A busy org has a minute of admissions in its window (tens of thousands): they
are kept as plain numbers in two lists, not as objects, so that they cost the
garbage collector nothing to walk. A window is trimmed when its org or key
asks for admission; once a minute every window is, and those left empty are
let go, so that the keys and orgs gone quiet hold no memory.
"""

from __future__ import annotations

import time

WINDOW_SECONDS = 60.0


class Window:
    __slots__ = ("times", "tokens", "head", "dropped", "requests", "total")

    def __init__(self) -> None:
        self.times: list[float] = []  # admission times, oldest first, from ``head`` on
        self.tokens: list[int] = []
        self.head = 0  # the first place still in the window
        self.dropped = 0  # places compacted away before ``times[0]``: a place's number is dropped + index
        self.requests = 0
        self.total = 0  # tokens

    def trim(self, now: float) -> None:
        times, start, head = self.times, now - WINDOW_SECONDS, self.head
        while head < len(times) and times[head] <= start:
            self.total -= self.tokens[head]
            head += 1
        self.requests -= head - self.head
        self.head = head
        if head > 1024 and head * 2 > len(times):  # compact: drop what has left the window
            del times[:head], self.tokens[:head]
            self.dropped += head
            self.head = 0

    def full(self, requests_per_minute: int | None, tokens_per_minute: int | None) -> bool:
        """The next admission would pass a bound: as many requests as allowed already, or the tokens
        used and reserved by the others at or above the bound (so a minute overruns by one request)."""
        return (requests_per_minute is not None and self.requests >= requests_per_minute
                or tokens_per_minute is not None and self.total >= tokens_per_minute)

    def add(self, at: float, tokens: int) -> int:
        """A new place; returns its number."""
        self.times.append(at)
        self.tokens.append(tokens)
        self.requests += 1
        self.total += tokens
        return self.dropped + len(self.times) - 1

    def settle(self, place: int, tokens: int) -> None:
        index = place - self.dropped
        if index >= self.head:  # still in the window
            self.total += tokens - self.tokens[index]
            self.tokens[index] = tokens


class MinuteWindows:
    """The windows of every org and key with a per-minute bound, and the places not yet settled."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._windows: dict[str, Window] = {}
        self._open: dict[str, tuple] = {}  # generation id -> ((window, place), ...), until its row settles
        self._sweep_at = clock() + WINDOW_SECONDS

    def full(self, bounds: list[tuple[str, int | None, int | None]]) -> str | None:
        """The first of ``(window name, requests_per_minute, tokens_per_minute)`` that is full, or None."""
        now = self.clock()
        if now >= self._sweep_at:
            self._sweep(now)
        for name, rpm, tpm in bounds:
            window = self._windows.get(name)
            if window is not None:
                window.trim(now)
                if window.full(rpm, tpm):
                    return name
        return None

    def take(self, generation_id: str, tokens: int, names: list[str]) -> None:
        now = self.clock()
        places = []
        for name in names:
            window = self._windows.get(name)
            if window is None:
                window = self._windows[name] = Window()
            places.append((window, window.add(now, tokens)))
        self._open[generation_id] = tuple(places)

    def settle(self, generation_id: str, tokens: int) -> None:
        """The request's row: its real token count replaces what was reserved (in the windows it
        is still in)."""
        for window, place in self._open.pop(generation_id, ()):
            window.settle(place, tokens)

    def _sweep(self, now: float) -> None:
        """Let go of the windows with nothing left in the last 60 s. A place of one still open (its
        request outlived its minute) settles into the old window, where it changes nothing."""
        self._sweep_at = now + WINDOW_SECONDS
        for name, window in list(self._windows.items()):
            window.trim(now)
            if window.requests == 0:
                del self._windows[name]

    def usage(self, name: str) -> tuple[int, int]:
        """``(requests, tokens)`` of the window ``name`` over the last 60 s (metrics, tests)."""
        window = self._windows.get(name)
        if window is None:
            return 0, 0
        window.trim(self.clock())
        return window.requests, window.total
