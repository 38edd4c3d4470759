"""The streamed response: upstream SSE -> the response rules (docs/reference.md) -> plugins -> client.

``EventRelay`` decides what the client gets, a chunk at a time. This module holds the chunk's
part: where a chunk's whole events are cut and which path takes them. The whole events of a
chunk are checked together by ``PlainRun`` (``plain_scanner``) with a handful of bytes
operations; when no rule changes any of them they go out as the upstream's own bytes, the
model's name replaced. The last events of a chunk, where a stream's finish reason, usage and
``[DONE]`` are, are set apart (from the chunk's one split at the blank lines, ``_split_run``)
and read one by one. The relay's other parts are its bases, one module each:

* ``plain_decider`` (``PlainDecider``): each event, sent as it came (renamed) or parsed, decided
  from its bytes; the model's name is the event's own ``model``, never one of an object nested
  in it;
* ``plain_transforms`` (``PluggedEvents``): the path when a ``transform_event`` plugin is loaded
  (each event parsed once, shown to the plugins and serialised once);
* ``plain_bookkeeping`` (``Bookkeeping``): the usage and finish reasons read as events pass, the
  error events that end a stream, and its ``tail`` (the usage chunk, ``[DONE]``).

What orjson refuses but is JSON (a lone surrogate escape) is read and written by the json module
(``event_json``); what is not JSON goes out as it came. An event the gateway cannot write back
(nested deeper than 254 levels) ends the stream with an ``upstream_bad_response`` error event,
whoever saw it; a plugin that leaves the event no longer JSON is a plugin error.

The parts share one instance's state (``EventRelay.__slots__``) and call each other through
``self``: a method found on a base costs what one found on the class does (the type's lookup
cache), so the per-event path has no call it did not have as one class.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Protocol

import orjson

from ...call import Call
from ...plugins.manager import Impl
from ...sse import DATA, SSEParser, is_done
from ...usage import Usage
from .errors import StreamPluginError
from .event_json import read_stdlib
from .event_plugins import event_only
from .plain_bookkeeping import Bookkeeping
from .plain_decider import PlainDecider
from .plain_scanner import CR, ERROR, EVENT_SEP, FINISH, FINISH_NULL, LF, ROLE, USAGE, USAGE_NULL, PlainRun, role_only
from .plain_transforms import PluggedEvents
from ..request_record import RequestRecord


class ModelNames(Protocol):
    """What the relay reads of the model it streams: ``b'"model":"<name>"'`` as the catalog lists it and as the
    upstream names it (both the same when the catalog does not rename it). The request's upstream route
    (``upstream.routes.Route``) is one."""

    @property
    def model_bytes(self) -> bytes: ...

    @property
    def upstream_model_bytes(self) -> bytes: ...


class EventRelay(PlainDecider, PluggedEvents, Bookkeeping):
    """One stream's relay: ``feed_chunk()`` for each chunk the upstream sends, ``close()`` at its
    end of body, ``tail()`` for what follows the last event."""

    __slots__ = ("call", "names", "record", "impls", "transforms", "parse_all", "rename", "catalog_key",
                 "upstream_key", "own_start", "own_end", "own_end_key", "ended", "error",
                 "usage_raw", "raw_counts", "usage_event", "last_event", "clean_end", "parser", "rest", "plain", "by_parser", "crlf",
                 "choice_usage", "request_usage", "chat", "several",
                 "finished_choices")

    def __init__(self, call: Call, names: ModelNames, record: RequestRecord, impls: tuple[Impl, ...]):
        self.call = call
        self.names = names
        self.record = record
        self.impls = impls
        self.parse_all = bool(impls)
        self.transforms = tuple([event_only(impl, call) for impl in impls]) if impls else ()
        self.catalog_key, self.upstream_key = names.model_bytes, names.upstream_model_bytes  # b'"model":"<name>"'
        self.rename = self.catalog_key != self.upstream_key
        # the bytes of an event that showed its own model to be the upstream's name (``_own_model``), from its
        # start or from the byte before the key to its end: a stream's events share them (none, at first)
        self.own_start = self.own_end = b"\0"
        self.own_end_key = 0
        self.chat = call.endpoint == "chat/completions"  # a text completion's chunk names no role: not looked for
        self.ended = False  # [DONE], an error event, or a plugin's STOP: read no further
        self.error: bytes | None = None
        self.usage_raw: dict | None = None
        self.raw_counts: Usage | None = None  # usage_raw's counts
        self.usage_event: dict | None = None
        self.last_event: dict | None = None
        self.clean_end = False  # the upstream finished its answer ([DONE], an error event): read it to its end
        self.parser = SSEParser()
        self.rest: list[bytes] = []  # the start of an event whose blank line has not come yet
        self.plain = PlainRun(names.upstream_model_bytes, names.model_bytes)
        self.by_parser = False  # the parser is inside an event, or a CR was seen: it takes every chunk
        self.crlf = False  # a CR was seen: the parser for good
        self.choice_usage: dict[Any, Usage] = {}  # the latest report on each choice's chunks, by index
        self.request_usage: list[Usage] = []  # the reports of choices: [] chunks
        n = record.body.get("n") if isinstance(record.body, dict) else None
        self.several = type(n) is int and n > 1  # several choices: their reports are added up
        self.finished_choices: set = set()  # the indexes of the choices that had their finish reason

    # -- per chunk ----------------------------------------------------------

    def feed_chunk(self, chunk: bytes) -> bytes:
        """The bytes to send for this chunk of the upstream's body (possibly none).

        The same bytes, and the same record, as ``feed(parser.feed(chunk))`` chunk after
        chunk (tests/proxy/relay/test_relay_chunks.py compares both on random cuts), sooner: the
        whole events of a chunk are taken together. When ``PlainRun`` finds that none
        of them needs a change they go out as they came, renamed by one ``replace``;
        else the last few events, where a stream's finish reason, usage and
        ``[DONE]`` are, are set apart and only they are read one by one. The
        unfinished event at the end of a chunk waits in ``rest`` for its blank line,
        so the parser is always between events and can take over at any chunk.
        """
        if self.by_parser:
            out = self.feed(self.parser.feed(chunk))
            self.by_parser = self.crlf or not self.parser.idle()
            return out
        rest = self.rest
        if rest:
            rest.append(chunk)
            if LF not in chunk and CR not in chunk:
                return b""
            chunk = b"".join(rest)
            rest.clear()
        if CR in chunk:  # CR or CRLF line ends: the parser's business
            self.by_parser = self.crlf = True
            return self.feed(self.parser.feed(chunk))
        end = chunk.rfind(b"\n\n") + 2
        if end < 2:
            end = 0
        if end < len(chunk):
            tail = chunk[end:]
            if tail[:1] == b":" or tail.find(b"\n:") >= 0:  # a comment goes out when its line ends: the parser's way
                out = self._events(chunk[:end]) if end else b""
                if self.ended:
                    return out
                self.by_parser = True
                return _then(out, self.feed_chunk, tail)
            if not end:
                rest.append(chunk)
                return b""
            rest.append(tail)
            chunk = chunk[:end]
        if chunk.find(b"\n") == len(chunk) - 2 and chunk[:6] == b"data: ":
            return self.feed_data([chunk[6:-2]])  # one data line: a model server's token, as the parser reads it
        if self.parse_all:
            return self._plugged_events(chunk)
        if chunk[:7] == b"data: {":
            return self._split_run(chunk)
        return self._cut_run(chunk)

    def close(self) -> bytes:
        """The upstream's body has ended: what is left, and a last event with no blank line when it is
        whole (``[DONE]`` or JSON); one cut off by the end of the body is not sent."""
        items = self.parser.feed(b"".join(self.rest)) if self.rest else []
        self.rest.clear()
        last = self.parser.close()
        if last and last[-1][0] == DATA and not _whole(last[-1][1]):
            last.pop()
        return self.feed(items + last)

    def _split_run(self, chunk: bytes) -> bytes:
        """``feed_chunk``'s whole events (``chunk``, opening with ``data: {``) split once at the blank
        lines: the last few that carry a marker (``_marked``, as ``_tail_start`` sets them apart) read one
        by one, those before checked together by ``PlainRun``. Else as ``_tail_start`` cuts the chunk
        (an event of several lines among the last ones)."""
        events = chunk[6:-2].split(EVENT_SEP)
        k = len(events)
        last = max(k - TAIL_EVENTS, 1)  # the first event is never set apart (``_tail_start``)
        while k > last and _marked(events[k - 1]):
            k -= 1
        if k == len(events):
            tail = None
            end = len(chunk)
        else:
            tail = events[k:]
            for payload in tail:
                if LF in payload:  # not a one-line event: the blank lines cut the chunk elsewhere
                    return self._cut_run(chunk)
            del events[k:]
            end = len(chunk) - sum(map(len, tail)) - 8 * len(tail)
        n, out, roles = self.plain.take_split(chunk, end, events, tail and partial(self._feed_marked, tail))
        if not n:
            return self._events(chunk)
        self.record.streamed_chunks += n - _role_only_count(events) if roles and self.chat else n
        return out

    def _cut_run(self, chunk: bytes) -> bytes:
        """``feed_chunk``'s whole events, cut by ``_tail_start``."""
        cut = self._tail_start(chunk)
        if cut:
            head = chunk if cut == len(chunk) else chunk[:cut]
            n, out, roles = self.plain.take(head)
            if n:  # n events unchanged (renamed), counted as ``_event`` counts them
                self.record.streamed_chunks += n - _role_only_events(head) if roles and self.chat else n
                return out if head is chunk else _then(out, self._events, chunk[cut:])
        return self._events(chunk)

    def _tail_start(self, events: bytes) -> int:
        """Where the last events begin that carry a marker (at most ``TAIL_EVENTS`` of them; the
        whole length when the last one carries none). Only a guess of where to cut: what comes
        before is then checked by ``PlainRun`` like any run."""
        cut = len(events)
        for _ in range(TAIL_EVENTS):
            start = events.rfind(b"\n\n", 0, cut - 2) + 2
            if start < 2:
                return cut
            event = events[start:cut]  # marked: [DONE], an error, usage or a finish reason (what ends or is read)
            find = event.find  # find, not ``in``: a bytes ``in`` first tries its operand as an int, an exception
            if not (event[:12] == DONE_LINE or find(ERROR) >= 0 or find(USAGE) >= 0 and find(USAGE_NULL) < 0
                    or find(FINISH) >= 0 and find(FINISH_NULL) < 0):
                return cut
            cut = start
        return cut

    def _events(self, events: bytes) -> bytes:
        """Whole events one by one: split at C speed when each is one ``data:`` line, else parsed."""
        if events[:6] == b"data: ":
            payloads = events[6:-2].split(b"\n\ndata: ")
            if events.count(b"\n") == 2 * len(payloads):  # no other line: each is one data line
                return self._plugged_data(payloads) if self.parse_all else self.feed_data(payloads)
        return self.feed(self.parser.feed(events))


# The finish chunk, the usage chunk and [DONE] end a stream: a chunk's last events are looked
# at one by one before the rest is checked as a whole.
TAIL_EVENTS = 4
DONE_LINE = b"data: [DONE]"


def _role_only_events(events: bytes) -> int:
    """How many of ``events`` (whole one-line ``data:`` events, some naming the role) are ``role_only``."""
    return sum(1 for payload in events[6:-2].split(b"\n\ndata: ") if ROLE in payload and role_only(payload))


def _role_only_count(payloads: list[bytes]) -> int:
    """How many of ``payloads`` (one-line events, some naming the role) are ``role_only``."""
    return sum(1 for payload in payloads if payload.find(ROLE) >= 0 and role_only(payload))


def _marked(payload: bytes) -> bool:
    """A one-line event ``_tail_start`` sets apart: ``[DONE]``, an error, usage or a finish reason (what
    ends the stream or is read). ``find``, not ``in``: a bytes ``in`` tries its operand as an int first."""
    find = payload.find
    return (payload[:6] == b"[DONE]" or find(ERROR) >= 0 or find(USAGE) >= 0 and find(USAGE_NULL) < 0
            or find(FINISH) >= 0 and find(FINISH_NULL) < 0)


def _whole(payload: bytes) -> bool:
    """A last event the body's end closed, not cut: ``[DONE]`` or JSON."""
    if is_done(payload):
        return True
    try:
        orjson.loads(payload)
    except orjson.JSONDecodeError:
        try:
            read_stdlib(payload)
        except ValueError:
            return False
    return True


def _then(out: bytes, more: Callable[[Any], bytes], events: Any) -> bytes:
    """``out`` + ``more(events)``; ``out`` also goes ahead of a plugin's error raised by ``more``."""
    try:
        return out + more(events)
    except StreamPluginError as exc:
        exc.before = out + exc.before
        raise
