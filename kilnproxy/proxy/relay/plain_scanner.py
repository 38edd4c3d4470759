"""Recognising, a whole run at a time, the events that no response rule changes (docs/reference.md).

``PlainDecider._event`` (``plain_decider``) decides per event, with substring tests on its payload,
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
* ``"model":`` occurs ``n`` times and each event holds the upstream's
  ``"model":"<name>"`` (the catalog id's, when the two are the same) once, at
  the event's top level as ``_event`` shows it (``TOP``). ``_event`` replaces
  that occurrence per event, so one per event makes a ``replace`` over the run
  the same bytes.

``TOP``: the first ``"model":`` of an event (one that starts with ``{``) is the
event's own, not a key of an object nested in it, when no backslash comes just
before it (its quote is then not in a string: it opens the key ``model``), and
no ``{`` opens between the event's ``{`` and the key, or no ``}`` closes between
the key and the event's last byte. vLLM, SGLang and Ollama name the model before
any object opens, llama.cpp after its choices close: both are shown in a few
bytes. A brace inside a string only hides what is shown (the event is then
parsed), never shows what is not.

"Each event holds M" is shown with one count, by a frame taken from the first
event: its bytes up to the end of M (every other event starts with them), or
from M to its end (every other event ends with them). A stream's events share
these bytes (vLLM's id, object, created and model before the text; llama.cpp's
after it); when they do not, the check falls back to counting every
``"finish_reason"`` (``"usage"``) against every ``"finish_reason":null``
(``"usage":null``), and to a split at the model's name. The frame checks also show the structure.

``PlainRun.take(run)`` (``take_split`` when the relay has split the chunk already, as it does
for a chunk of one-line events, its last marked events too) tries a cheaper proof first: the
stream's own frames, the bytes every event starts with (``{"id":...,"model":...,``)
and ends with (``,"logprobs":null,"finish_reason":null}]}``), taken once from two
events and checked once against the rules. One split at the blank lines and one
count of "suffix, blank line, prefix" over the run show that every event is framed
so; the rules are then checked over the events' middles (the tokens: a few bytes an
event), not over the whole run. When the frames do not fit, or their checks are not
conclusive, ``count`` decides as above.
"""

from __future__ import annotations

import functools
from typing import Callable
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
BACKSLASH = 92  # the byte before a quote that is in a string
MAX_MISSES = 3
# A bytes ``in`` first tries its operand as an int, at the cost of a raised error: ``find``, and an
# int for a single byte (``10 in data``, a memchr), where a stream pays it.
LF, CR = 10, 13
# What a chat chunk that names the role carries when it is more than the chunk before the answer.
TOOL_CALLS = b'"tool_calls"'
CONTENT, EMPTY_CONTENT = b'content":"', b'content":""'  # also reasoning_content


class PlainRun:
    """The check for one stream; ``upstream``/``catalog`` are ``b'"model":"<name>"'``."""

    __slots__ = ("upstream", "catalog", "rename", "from_end", "frames", "framable", "misses", "prefix", "suffix",
                 "needle", "out_start", "out_end", "out_needle", "frames_plain", "banned", "frame_roles")

    def __init__(self, upstream: bytes, catalog: bytes):
        self.upstream = upstream
        self.catalog = catalog
        self.rename = upstream != catalog
        self.from_end = [False, False, False]  # per marker: the frame from the end matched last time
        self.frames = [(b"", b"")] * 6  # per marker and side: the last frame and the needle counted
        self.prefix = self.suffix = b""  # the stream's event frames, without "data: " and "\n\n" (``_frames_from``)
        self.framable = _framable(upstream, catalog)
        self.misses = 0  # runs the frames did not show plain: after MAX_MISSES, a stream they do not suit

    def take(self, head: bytes) -> tuple[int, bytes, int]:
        """``(n, out, roles)``: ``head``'s ``n`` events when ``_event`` forwards each one as it is
        (renamed), ``out`` the bytes to send, ``roles`` how many name a role (``ROLE``); n = 0 when
        that is not shown. ``head`` is whole events, no CR.

        First by the stream's frames (``_by_frames``: one split of ``head``), else by ``count``
        (a pass per check)."""
        if head[:7] != b"data: {":
            return 0, b"", 0
        if self.framable and head.find(b"\n\n") != len(head) - 2:  # more than one event
            return self.take_split(head, len(head), head[6:-2].split(EVENT_SEP))
        return self._counted(head)

    def take_split(self, data: bytes, end: int, events: list[bytes],
                   more: Callable[[], bytes] | None = None) -> tuple[int, bytes, int]:
        """``take(data[:end])`` for a run already split: ``data`` starts with ``data: {``, holds no CR,
        and ``events`` is ``data[6:end - 2].split(EVENT_SEP)``, ``data[end - 2:end]`` a blank line
        (the relay splits a whole chunk once, for its last events too). ``more``, called once the run
        is shown plain (n > 0), gives what follows it, joined to ``out`` with no other copy of the run."""
        if self.framable and len(events) > 1:
            framed = self._by_frames(data, end, events, more)
            if framed is not None:
                return framed
            self.misses += 1
            self.framable = self.misses < MAX_MISSES
        n, out, roles = self._counted(data if end == len(data) else data[:end])
        return (n, out + more(), roles) if n and more is not None else (n, out, roles)

    def _counted(self, head: bytes) -> tuple[int, bytes, int]:
        n = self.count(head)
        if not n:
            return 0, b"", 0
        return n, self.renamed(head), head.count(ROLE) if head.find(ROLE) >= 0 else 0

    def _by_frames(self, head: bytes, end: int | None = None, events: list[bytes] | None = None,
                   more: Callable[[], bytes] | None = None) -> tuple[int, bytes, int] | None:
        """``take`` for a run whose events all start with the stream's ``prefix`` and end with its
        ``suffix``, shown by one split at the blank lines: each event's middle (what differs from
        event to event, a token's text) is taken as what its frames would leave, and ``head`` is
        compared with ``data: ``, the prefix, the middles joined by ``needle`` (``suffix``, the blank
        line and ``prefix``), the suffix and the blank line (one join and one compare of memory,
        cheaper than a count of the needles over ``head``). When they are the same bytes and no
        middle holds a newline, every event is one ``data:`` line framed so. The middles are
        checked for the rules' markers, joined (a
        few bytes an event); the frames were checked once (``_frames_from``), not per run. The
        frames end and begin at one of ``,{}``, no marker holds one of those, and the middles are
        joined with ``,``: so no marker is cut by an edge, and each is in the frames (then in
        every event) or in one event's middle. The frames are taken from the first two events of
        a run where the stream's do not fit, and kept for the next runs. None when not shown.
        The run is ``head[:end]`` when ``end`` is given, split into ``events`` (``take_split``)."""
        if end is None:
            end, events = len(head), head[6:-2].split(EVENT_SEP)
        n = len(events)
        if n < 2:  # a comment or a line of another field between the events
            return None
        for fresh in (False, True):
            if fresh and not self._frames_from(events[0], events[1]):
                return None
            prefix, suffix = self.prefix, self.suffix
            edge = len(prefix) + len(suffix)
            if not prefix or len(events[0]) < edge or len(events[-1]) < edge:
                continue
            middles = list(map(getitem, events, repeat(slice(len(prefix), -len(suffix)))))
            joined = b",".join(middles)
            if LF not in joined and head.startswith(prefix, 6) and head.startswith(suffix, end - 2 - len(suffix)) \
                    and end == n * (edge + 8) + len(joined) - (n - 1) \
                    and head.startswith(self.needle.join(middles), 6 + len(prefix)):
                return self._checked(head, end, middles, joined, more)
        return None

    def _checked(self, head: bytes, end: int, middles: list[bytes], joined: bytes,
                 more: Callable[[], bytes] | None) -> tuple[int, bytes, int] | None:
        if not self.frames_plain:
            return None
        find = joined.find
        for marker in self.banned:
            if find(marker) >= 0:
                return None
        n = len(middles)
        roles = n if self.frame_roles else joined.count(ROLE)
        after = more() if more is not None else b""
        if not self.rename:
            return n, head if end == len(head) and not after else b"".join((memoryview(head)[:end], after)), roles
        middles[0] = self.out_start + middles[0]  # the run's ends on its first and last middle: one join, one copy
        middles[-1] = b"".join((middles[-1], self.out_end, after))
        return n, self.out_needle.join(middles), roles

    def _frames_from(self, first: bytes, second: bytes) -> bool:
        """The frames of two events: their common start up to its last ``,`` or ``{``, their common
        end from its first ``,`` or ``}``; with what they show once for all the runs they frame
        (``frames_plain``), and the markers to look for in the middles (``banned``)."""
        if LF in first or LF in second:
            return False
        same, end = _common_ends(first, second)
        cut = max(first.rfind(b",", 0, same), first.rfind(b"{", 0, same)) + 1
        start = len(first) - end
        comma, brace = first.find(b",", start), first.find(b"}", start)
        end = comma if brace < 0 or 0 <= comma < brace else brace  # the first of the two (-1: neither)
        if not cut or end < cut:
            return False
        prefix, suffix = first[:cut], first[end:]
        self.prefix, self.suffix = prefix, suffix
        self.needle = suffix + EVENT_SEP + prefix
        frames = prefix + b"\n" + suffix  # the newline: no marker seen across the two
        # a usage or a finish reason: each event holds the null, or none holds the key
        find = frames.find
        plain = (find(ERROR) < 0 and (find(USAGE_NULL) >= 0 or find(USAGE) < 0)
                 and (find(FINISH_NULL) >= 0 or find(FINISH) < 0))
        banned = BANNED  # in a middle: an error, a usage or finish reason of its own (another choice's)
        at = prefix.find(MODEL_KEY)  # each event's first "model": at its top level, the upstream's name (TOP)
        if at >= 0:
            plain = plain and prefix.startswith(self.upstream, at) and opens_top(prefix, at)
        else:  # after the middles, which may then hold none
            at = suffix.find(MODEL_KEY)
            plain = plain and at > 0 and suffix.startswith(self.upstream, at) and closes_top(suffix, at)
            banned += (MODEL_KEY,)
        if not self.rename:  # the name once in every event (a server may name its model otherwise)
            plain = plain and frames.count(self.upstream) == 1
        else:  # the upstream's name once in every event: once in the frames, nowhere else
            upstream, catalog = self.upstream, self.catalog
            plain = plain and find(catalog) < 0 and frames.count(upstream) == 1
            if MODEL_KEY not in banned:  # both names start with the key: one search shows neither is there
                banned += (MODEL_KEY,)
            prefix, suffix = prefix.replace(upstream, catalog), suffix.replace(upstream, catalog)
            self.out_start, self.out_end = b"data: " + prefix, suffix + b"\n\n"
            self.out_needle = suffix + EVENT_SEP + prefix
        self.frames_plain, self.banned, self.frame_roles = plain, banned, find(ROLE) >= 0
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
        at = head.find(self.upstream, 0, eol)  # the name to rename, or the catalog id itself: in every event
        if at < 0 or head.count(MODEL_KEY) != n:
            return 0
        framed = self._framed(head, n, eol, at - 1, at + len(self.upstream), 0)  # with the byte before the key
        if not (self._framed_top() if framed else self._one_each(head, n)):
            return 0
        at = head.find(FINISH_NULL, 0, eol)
        if at >= 0 and self._framed(head, n, eol, at, at + len(FINISH_NULL), 1):
            framed = True
            if head.count(FINISH) != n:  # another choice's finish reason beside the null
                return 0
        else:
            finish = head.count(FINISH)
            if finish and finish != head.count(FINISH_NULL):
                return 0
        if not framed and head.count(EVENT) != n - 1:
            return 0
        if head.find(ERROR) >= 0:
            return 0
        if head.find(USAGE) >= 0:  # OpenAI's and SGLang's "usage":null on every chunk, or usage to read
            at = head.find(USAGE_NULL, 0, eol)
            if at >= 0 and self._framed(head, n, eol, at, at + len(USAGE_NULL), 2):
                if head.count(USAGE) != n:
                    return 0
            elif head.count(USAGE) != head.count(USAGE_NULL):
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

    def _framed_top(self) -> bool:
        """The model's frame (``_framed``'s, marker 0) shows each event's one ``"model":`` at its top level
        (``TOP``): from the event's start, or from the byte before the key to the event's end."""
        from_end = self.from_end[0]
        frame = self.frames[from_end][0]
        if from_end:  # b',"model":"<name>",...}\n\n'
            return closes_top(frame[:-2], 1)
        return opens_top(frame[6:], len(frame) - 6 - len(self.upstream))  # b'data: {...,"model":"<name>"'

    def _one_each(self, head: bytes, n: int) -> bool:
        """The upstream's model name between every two event ends, at each event's top level (``TOP``),
        when no frame holds it."""
        parts = head.split(self.upstream)
        if len(parts) != n + 1 or not all(map(bytes.__contains__, parts[1:-1], repeat(b"\n\n"))):
            return False
        closes = b"}" not in self.upstream
        for i, (before, after) in enumerate(zip(parts, parts[1:])):  # the bytes before and after event i's name
            start = before.rfind(EVENT_SEP) + len(EVENT_SEP) if i else 6  # the event's "{"
            if before[start:start + 1] != b"{" or before[-1] == BACKSLASH:
                return False
            if before.find(b"{", start + 1) >= 0:  # an object opens before the key: none may close after it
                end = after.find(b"\n\n")
                if not closes or after.find(b"}", 0, end) != end - 1:
                    return False
        return True

    def renamed(self, head: bytes) -> bytes:
        return head.replace(self.upstream, self.catalog) if self.rename else head


BANNED = (ERROR, USAGE, FINISH)


@functools.lru_cache(maxsize=256)
def _framable(upstream: bytes, catalog: bytes) -> bool:
    """A frame ends or begins at one of ``,{}``: no model name with those could be seen across its edge."""
    return not (upstream != catalog and any(c in name for c in b",{}" for name in (upstream, catalog)))


def _common_ends(a: bytes, b: bytes) -> tuple[int, int]:
    """The lengths of the longest common start and of the longest common end of ``a`` and ``b``, from
    the two read once as big-endian numbers. Xor-ed as they are (aligned at their ends), the lowest
    bit set is in the last byte that differs; xor-ed once the longer one's extra last bytes are shifted
    out (aligned at their starts), the highest bit set is in the first byte that differs. Two
    conversions, not one per question and operand."""
    x, y = int.from_bytes(a), int.from_bytes(b)
    extra = len(a) - len(b)
    size = len(b) if extra > 0 else len(a)
    differ = x ^ y
    first = (x >> 8 * extra) ^ y if extra > 0 else x ^ (y >> -8 * extra) if extra else differ
    start = size - 1 - (first.bit_length() - 1) // 8 if first else size
    if not differ:
        return start, size
    end = ((differ & -differ).bit_length() - 1) // 8
    return start, end if end < size else size


def opens_top(start: bytes, at: int) -> bool:
    """``"model":`` at ``at`` of an event's first bytes ``start`` is the event's own (``TOP``): a key,
    and no ``{`` opens between the event's and it."""
    return at > 0 and start[0] == 123 and start[at - 1] != BACKSLASH and start.find(b"{", 1, at) < 0


def closes_top(end: bytes, at: int) -> bool:
    """``"model":`` at ``at`` of an event's last bytes ``end`` is the event's own (``TOP``, when the
    event starts with ``{``): a key, and no ``}`` closes between it and the event's last byte."""
    return at > 0 and end[at - 1] != BACKSLASH and end.find(b"}", at) == len(end) - 1


def role_only(payload: bytes) -> bool:
    """A chat chunk that names the role (callers look for ``ROLE`` first) and carries no text and no tool
    call: the chunk before the answer, not counted as a streamed token."""
    return TOOL_CALLS not in payload and CONTENT not in payload.replace(EMPTY_CONTENT, b"")
