"""Recognising, a whole run at a time, the events that no response rule changes (docs/reference.md).

``EventRelay._event`` decides per event, with substring tests on its payload,
whether the event goes out as the upstream's own bytes (with the upstream's
model name replaced by the catalog id). ``PlainRun.count(run)`` answers the same
question for a run of whole events in one go, with a fixed handful of bytes
operations (``count``, ``find``, ``in``) over the run however many events it
holds: it returns the number of events when every one of them would be
forwarded unchanged, else 0. It may say 0 where each event would pass (the
relay then checks them one by one); it never says n where one would not.

The tests behind each check, for a run ``head`` that ends with a blank line
and holds no CR (the relay sends CR streams through the parser):

* structure: every event is one ``data: {...}`` line then a blank line. The
  ``\\n`` count is ``2n`` and ``n - 1`` of the pairs are followed by ``data: {``
  (or by the run's own first-event prefix, which starts with ``data: {``);
* ``"error"`` nowhere; each event holds ``"usage":null`` or no ``"usage"``, and
  ``"finish_reason":null`` or no ``"finish_reason"`` (``_event``'s rules);
* when the catalog id differs from the upstream's model name: ``"model":``
  occurs ``n`` times and each event holds the upstream's ``"model":"<name>"``
  once. ``_event`` replaces the first occurrence per event, so one per event
  makes a ``replace`` over the run the same bytes.

"Each event holds M" is shown with one count, by a frame taken from the first
event: its bytes up to the end of M (every other event starts with them), or
from M to its end (every other event ends with them). A stream's events share
these bytes (vLLM's id, object, created and model before the text; llama.cpp's
after it); when they do not, the check falls back to counting every
``"finish_reason"`` (``"usage"``) against every ``"finish_reason":null``
(``"usage":null``), and to a split at the model's name. The frame checks also show the structure.

``PlainRun.take(run)``, which the relay calls, tries a cheaper proof first: the
stream's own frames, the bytes every event starts with (``{"id":...,"model":...,``)
and ends with (``,"logprobs":null,"finish_reason":null}]}``), taken once from two
events. The line count, one split at the blank lines and one count of
"suffix, newline, prefix" over the events joined again show that every event is
framed so; the rules are then checked once over the two frames and over the events'
middles (the tokens: a few bytes an event), not over the whole run. When the frames
do not fit, or their checks are not conclusive, ``count`` decides as above.
"""

from __future__ import annotations

from itertools import repeat
from operator import getitem

# A chat stream's opening chunk names the role and carries no token: not counted
# when the completion tokens must be counted from what was streamed.
ROLE = b'"role":'

EVENT = b"\n\ndata: {"
EVENT_SEP = b"\n\ndata: "
ERROR = b'"error"'
USAGE, USAGE_NULL = b'"usage"', b'"usage":null'
FINISH, FINISH_NULL = b'"finish_reason"', b'"finish_reason":null'
MODEL_KEY = b'"model":'
MAX_MISSES = 3


class PlainRun:
    """The check for one stream; ``upstream``/``catalog`` are ``b'"model":"<name>"'``."""

    __slots__ = ("upstream", "catalog", "rename", "from_end", "frames", "prefix", "suffix", "needle", "framable",
                 "misses")

    def __init__(self, upstream: bytes, catalog: bytes):
        self.upstream = upstream
        self.catalog = catalog
        self.rename = upstream != catalog
        self.from_end = [False, False, False]  # per marker: the frame from the end matched last time
        self.frames = [(b"", b"")] * 6  # per marker and side: the last frame and the needle counted
        self.prefix = self.suffix = self.needle = b""  # the stream's event frames, without "data: " and "\n\n"
        # a frame ends or begins at one of ",{}": no name with those could be seen across its edge
        self.framable = not (self.rename and any(c in name for c in b",{}" for name in (upstream, catalog)))
        self.misses = 0  # runs the frames did not show plain: after MAX_MISSES, a stream they do not suit

    def take(self, head: bytes) -> tuple[int, bytes, int]:
        """``(n, out, roles)``: ``head``'s ``n`` events when ``_event`` forwards each one as it is
        (renamed), ``out`` the bytes to send, ``roles`` how many name a role (``ROLE``); n = 0 when
        that is not shown. ``head`` is whole events, no CR.

        First by the stream's frames (``_by_frames``: the line count, one split and one count over
        ``head``), else by ``count`` (a pass per check)."""
        if head[:7] != b"data: {":
            return 0, b"", 0
        lines = head.count(b"\n")
        if lines & 1:
            return 0, b"", 0
        n = lines >> 1
        if n > 1 and self.framable:
            framed = self._by_frames(head, n)
            if framed is not None:
                return n, framed[0], framed[1]
            self.misses += 1
            self.framable = self.misses < MAX_MISSES
        n = self.count(head)
        if not n:
            return 0, b"", 0
        return n, self.renamed(head), head.count(ROLE) if ROLE in head else 0

    def _by_frames(self, head: bytes, n: int) -> tuple[bytes, int] | None:
        """Every one of ``head``'s ``n`` events (``data: `` lines by the line count) starts with the
        stream's ``prefix`` and ends with its ``suffix``: shown by one split at the blank lines, and
        one count of ``suffix`` + the next event's ``prefix`` across the events joined again. What
        differs from event to event (a token's text) is then between those frames, and the rules
        are checked over the frames once and over the events' middles joined (a few bytes an
        event) rather than over the whole run. The frames end and begin at one of ``,{}``, no
        marker holds one of those, and the middles are joined with ``,``: so no marker is cut by
        an edge, and each is in the prefix (then in every event), the suffix (likewise) or one
        event's middle. The frames are taken from the first two events of a run where the
        stream's do not fit, and kept for the next runs. None when not shown."""
        events = head[6:-2].split(EVENT_SEP)
        if len(events) != n:
            return None
        lines = b"\n".join(events)
        for fresh in (False, True):
            if fresh and not self._frames_from(events[0], events[1]):
                return None
            prefix, suffix = self.prefix, self.suffix
            edge = len(prefix) + len(suffix)  # the first and last events hold both, not overlapping (the others:
            if prefix and events[0].startswith(prefix) and events[-1].endswith(suffix) \
                    and len(events[0]) >= edge and len(events[-1]) >= edge \
                    and lines.count(self.needle) == n - 1:  # as the needles counted do not overlap)
                return self._checked(head, events, prefix, suffix)
        return None

    def _checked(self, head: bytes, events: list[bytes], prefix: bytes, suffix: bytes) -> tuple[bytes, int] | None:
        middles = list(map(getitem, events, repeat(slice(len(prefix), -len(suffix)))))
        joined = b",".join(middles)
        if ERROR in joined or ERROR in prefix or ERROR in suffix:
            return None
        for null, key in ((USAGE_NULL, USAGE), (FINISH_NULL, FINISH)):
            if not (null in prefix or null in suffix) and (key in joined or key in prefix or key in suffix):
                return None  # else every event holds the null, or none the key
        roles = len(events) if ROLE in prefix or ROLE in suffix else joined.count(ROLE)
        if not self.rename:
            return head, roles
        upstream, catalog = self.upstream, self.catalog
        if catalog in joined or catalog in prefix or catalog in suffix or upstream in joined \
                or prefix.count(upstream) + suffix.count(upstream) != 1:  # once in every event: in a frame
            return None
        prefix, suffix = prefix.replace(upstream, catalog), suffix.replace(upstream, catalog)
        return b"".join((b"data: ", prefix, (suffix + EVENT_SEP + prefix).join(middles), suffix, b"\n\n")), roles

    def _frames_from(self, first: bytes, second: bytes) -> bool:
        """The frames of two events: their common start up to its last ``,`` or ``{``, their common
        end from its first ``,`` or ``}``."""
        same = _common_start(first, second)
        cut = max(first.rfind(b",", 0, same), first.rfind(b"{", 0, same)) + 1
        start = len(first) - _common_start(first[::-1], second[::-1])
        ends = [i for i in (first.find(b",", start), first.find(b"}", start)) if i >= 0]
        if not cut or not ends or min(ends) < cut:
            return False
        self.prefix, self.suffix = first[:cut], first[min(ends):]
        self.needle = self.suffix + b"\n" + self.prefix
        return True

    def count(self, head: bytes) -> int:
        """The number of events in ``head`` if ``_event`` forwards each one as it is (renamed), else 0."""
        if head[:7] != b"data: {":
            return 0
        lines = head.count(b"\n")
        if lines & 1:
            return 0
        n = lines >> 1
        eol = head.find(b"\n")
        framed = False  # each event is one data: line, shown by a frame check
        if self.rename:
            at = head.find(self.upstream, 0, eol)
            if at < 0 or head.count(MODEL_KEY) != n:
                return 0
            framed = self._framed(head, n, eol, at, at + len(self.upstream), 0)
            if not framed and not self._one_each(head, n):
                return 0
        at = head.find(FINISH_NULL, 0, eol)
        if at >= 0 and self._framed(head, n, eol, at, at + len(FINISH_NULL), 1):
            framed = True
        else:
            finish = head.count(FINISH)
            if finish and finish != head.count(FINISH_NULL):
                return 0
        if not framed and head.count(EVENT) != n - 1:
            return 0
        if ERROR in head:
            return 0
        if USAGE in head:  # OpenAI's and SGLang's "usage":null on every chunk, or usage to read
            at = head.find(USAGE_NULL, 0, eol)
            if not (at >= 0 and self._framed(head, n, eol, at, at + len(USAGE_NULL), 2)) \
                    and head.count(USAGE) != head.count(USAGE_NULL):
                return 0
        return n

    def _framed(self, head: bytes, n: int, eol: int, start: int, end: int, marker: int) -> bool:
        """Every event holds ``head[start:end]`` (in the first event) in the same frame: all start
        as the first one does up to ``end``, or all end as it does from ``start`` on. Either shows
        that each event is one ``data: {`` line (the ``\\n`` count being ``2n``). The frames
        are kept from chunk to chunk (a stream's events share them), so that a chunk allocates
        none."""
        from_end = self.from_end[marker]
        for _ in range(2):
            frame, needle = self.frames[2 * marker + from_end]
            if from_end:
                if eol + 2 - start != len(frame) or not head.startswith(frame, start):
                    frame = head[start:eol + 2]
                    needle = frame + b"data: {"
                    self.frames[2 * marker + from_end] = frame, needle
                ok = head.endswith(frame) and head.count(needle) == n - 1
            else:
                if end != len(frame) or not head.startswith(frame):
                    frame = head[:end]
                    needle = b"\n\n" + frame
                    self.frames[2 * marker + from_end] = frame, needle
                ok = head.count(needle) == n - 1
            if ok:
                self.from_end[marker] = from_end
                return True
            from_end = not from_end
        return False

    def _one_each(self, head: bytes, n: int) -> bool:
        """The upstream's model name between every two event ends (when no frame holds it)."""
        parts = head.split(self.upstream)
        return len(parts) == n + 1 and all(map(bytes.__contains__, parts[1:-1], repeat(b"\n\n")))

    def renamed(self, head: bytes) -> bytes:
        return head.replace(self.upstream, self.catalog) if self.rename else head


def _common_start(a: bytes, b: bytes) -> int:
    """The length of the longest common start of ``a`` and ``b`` (a binary search: C-speed compares)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) >> 1
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
