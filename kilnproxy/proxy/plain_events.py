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
"""

from __future__ import annotations

from itertools import repeat

# A chat stream's opening chunk names the role and carries no token: not counted
# when the completion tokens must be counted from what was streamed.
ROLE = b'"role":'

EVENT = b"\n\ndata: {"
ERROR = b'"error"'
USAGE, USAGE_NULL = b'"usage"', b'"usage":null'
FINISH, FINISH_NULL = b'"finish_reason"', b'"finish_reason":null'
MODEL_KEY = b'"model":'


class PlainRun:
    """The check for one stream; ``upstream``/``catalog`` are ``b'"model":"<name>"'``."""

    __slots__ = ("upstream", "catalog", "rename", "from_end", "frames")

    def __init__(self, upstream: bytes, catalog: bytes):
        self.upstream = upstream
        self.catalog = catalog
        self.rename = upstream != catalog
        self.from_end = [False, False, False]  # per marker: the frame from the end matched last time
        self.frames = [(b"", b"")] * 6  # per marker and side: the last frame and the needle counted

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
