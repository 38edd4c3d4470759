"""The OTLP trace protobuf (``opentelemetry/proto/trace/v1``), written by hand: no dependency.

Only what kilnproxy sends is here. A span is encoded once, when it ends, into the bytes of one
``ScopeSpans.spans`` field (``span``); a batch of them becomes an ``ExportTraceServiceRequest``
with ``Framing.request``, its resource and scope encoded once at start-up. Field numbers and wire
types are the proto's (tests decode what this writes with the official ``opentelemetry-proto``):

* ``ExportTraceServiceRequest``: 1 resource_spans;
* ``ResourceSpans``: 1 resource (``Resource``: 1 attributes), 2 scope_spans;
* ``ScopeSpans``: 1 scope (``InstrumentationScope``: 1 name, 2 version), 2 spans;
* ``Span``: 1 trace_id, 2 span_id, 3 trace_state, 4 parent_span_id, 5 name, 6 kind,
  7 start_time_unix_nano (fixed64), 8 end_time_unix_nano (fixed64), 9 attributes, 11 events,
  15 status, 16 flags (fixed32);
* ``Event``: 1 time_unix_nano (fixed64), 2 name, 3 attributes;
* ``Status``: 2 message, 3 code; ``KeyValue``: 1 key, 2 value;
  ``AnyValue``: 1 string, 2 bool, 3 int (int64), 4 double.
"""

from __future__ import annotations

import struct
from typing import Callable

SERVER, CLIENT, INTERNAL = 2, 3, 1  # Span.SpanKind
STATUS_ERROR = 2                    # Status.StatusCode
FLAGS_LOCAL = 0x100                 # SpanFlags: the parent's is_remote is known, and it is local
FLAGS_REMOTE = 0x300                # ... and it is remote (the client's traceparent)

_BYTE = BYTE = [bytes((n,)) for n in range(256)]
_U64 = (1 << 64) - 1
_DOUBLE = DOUBLE = struct.Struct("<d").pack
_TIMES = TIMES = struct.Struct("<BQBQ").pack   # the start and end times, with their tags (0x39, 0x41)
_FLAGS = struct.Struct("<BBI").pack     # field 16, fixed32: a two-byte tag
_EVENT_TIME = struct.Struct("<BQ").pack


def varint(n: int) -> bytes:
    if n < 0x80:
        return _BYTE[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    n = len(payload)
    if n < 0x80:
        return tag + _BYTE[n] + payload
    if n < 0x4000:
        return tag + bytes(((n & 0x7F) | 0x80, n >> 7)) + payload
    return tag + varint(n) + payload


# The encoded name field of each span name seen (at most ``SEEN_AT_MOST``), shared with request_trace.
NAME_FIELDS: dict[str, bytes] = {}


_KEYS: dict[str, bytes] = {}
# recent (tag, key, value) -> bytes, one table a type (True and 1 are equal keys), for the values that repeat
_SEEN: dict[type, dict[tuple, bytes]] = {str: {}, int: {}, bool: {}}
SEEN_AT_MOST = 4096  # entries a table; cleared when full (a new model name, org, token count...)


def attribute(tag: bytes, key: str, value) -> bytes:
    """A ``KeyValue`` as the field ``tag`` (``b"J"``: a span's attributes, ``b"\\x1a"``: an event's,
    ``b"\\n"``: a resource's). ``value``: str, bool, int or float; ``None`` is written as an empty value."""
    seen = _SEEN.get(type(value))
    if seen is None:
        return _attribute(tag, key, value)
    entry = (tag, key, value)
    encoded = seen.get(entry)
    if encoded is None:
        if len(seen) >= SEEN_AT_MOST:
            seen.clear()
        encoded = seen[entry] = _attribute(tag, key, value)
    return encoded


def unique(tag: bytes, key: str, value: str) -> bytes:
    """``attribute`` of a string seen once (an id): not kept among the values that repeat."""
    return _attribute(tag, key, value)


def _attribute(tag: bytes, key: str, value) -> bytes:
    head = _KEYS.get(key)
    if head is None:
        head = _KEYS[key] = field(b"\n", key.encode()) + b"\x12"
    kind = type(value)
    if kind is str:
        encoded = value.encode()
        n = len(encoded)
        if n + len(head) < 0x7C:  # every length one byte
            return tag + _BYTE[len(head) + n + 3] + head + _BYTE[n + 2] + b"\n" + _BYTE[n] + encoded
        any_value = field(b"\n", encoded)
    elif kind is bool:
        any_value = b"\x10\x01" if value else b"\x10\x00"
    elif kind is int:
        any_value = b"\x18" + (_BYTE[value] if 0 <= value < 0x80 else varint(value & _U64))
    elif kind is float:
        any_value = b"!" + _DOUBLE(value)
    elif value is None:
        any_value = b""
    else:
        return attribute(tag, key, str(value))
    n = len(any_value)
    if n + len(head) < 0x7F:
        return tag + _BYTE[len(head) + n + 1] + head + _BYTE[n] + any_value
    return field(tag, head + varint(n) + any_value)


def attributes(tag: bytes, items: dict) -> bytes:
    return b"".join([attribute(tag, k, v) for k, v in items.items()])


def event(name: str, time_ns: int, items: dict) -> bytes:
    """A span's event (field 11)."""
    return field(b"Z", _EVENT_TIME(0x09, time_ns) + field(b"\x12", name.encode()) + attributes(b"\x1a", items))


def status(message: str | None) -> bytes:
    """A span's status (field 15): unset, or an error with its description."""
    if message is None:
        return b"z\x00"
    return field(b"z", field(b"\x12", message.encode()) + b"\x18\x02")


def name_field(name: str) -> bytes:
    """A span's name (field 5), kept for the names seen (at most ``SEEN_AT_MOST``)."""
    found = NAME_FIELDS.get(name)
    if found is None:
        found = field(b"*", name.encode())
        if len(NAME_FIELDS) < SEEN_AT_MOST:
            NAME_FIELDS[name] = found
    return found


def flags(value: int) -> bytes:
    """A span's flags (field 16, fixed32)."""
    return _FLAGS(0x85, 0x01, value)


def span(trace_id: bytes, span_id: bytes, parent_id: bytes | None, trace_state: bytes, name: str, kind: int,
         start_ns: int, end_ns: int, attrs: bytes, events: bytes, status_bytes: bytes, flags: int) -> bytes:
    """One span as a ``ScopeSpans.spans`` field. ``attrs``, ``events``, ``status_bytes``: already encoded
    (``attribute``, ``event``, ``status``); ``trace_state``: the encoded field 3, or ``b""``."""
    name_field = NAME_FIELDS.get(name)
    if name_field is None:
        name_field = field(b"*", name.encode())
        if len(NAME_FIELDS) < SEEN_AT_MOST:
            NAME_FIELDS[name] = name_field
    body = b"".join((b"\n\x10", trace_id, b"\x12\x08", span_id, trace_state,
                     b'"\x08' + parent_id if parent_id else b"", name_field, b"0", _BYTE[kind],
                     _TIMES(0x39, start_ns, 0x41, end_ns), attrs, events, status_bytes,
                     _FLAGS(0x85, 0x01, flags)))
    return field(b"\x12", body)


def span_prefix(trace_id: bytes, trace_state: bytes, parent_id: bytes) -> bytes:
    """The fields a request's child spans share (trace id, trace state, parent): encoded once a request, for
    ``child_span``. Protobuf fields may come in any order; decoders take them all the same."""
    return b"".join((b"\n\x10", trace_id, trace_state, b'"\x08', parent_id))


_LOCAL = _FLAGS(0x85, 0x01, FLAGS_LOCAL)


def child_span(prefix: bytes, span_id: bytes, name: str, kind: int, start_ns: int, end_ns: int, attrs: bytes,
               events: bytes, status_bytes: bytes) -> bytes:
    """``span`` of a span whose parent is local, from its request's ``span_prefix``."""
    name_field = NAME_FIELDS.get(name)
    if name_field is None:
        name_field = field(b"*", name.encode())
        if len(NAME_FIELDS) < SEEN_AT_MOST:
            NAME_FIELDS[name] = name_field
    return field(b"\x12", b"".join((prefix, b"\x12\x08", span_id, name_field, b"0", _BYTE[kind],
                                    _TIMES(0x39, start_ns, 0x41, end_ns), attrs, events, status_bytes, _LOCAL)))


class Key:
    """One span attribute's key (tag ``b"J"``), with the encoded ``KeyValue`` of its recent values: ``encode(value)``
    is ``attribute(b"J", key, value)``, from a table of this key's own (no tuple, no type lookup a value)."""

    __slots__ = ("key", "head", "seen", "double_head")

    def __init__(self, key: str):
        self.key = key
        self.seen: dict = {}
        head = self.head = field(b"\n", key.encode()) + b"\x12"
        assert len(head) + 10 < 0x80, "a key of ours: short"
        self.double_head = b"J" + _BYTE[len(head) + 10] + head + b"\x09!"  # a float: 9 bytes of AnyValue

    def unique(self, value: str) -> bytes:
        """``encode`` of a string seen once (an id): not kept."""
        encoded = value.encode()
        n = len(encoded)
        head = self.head
        if n + len(head) < 0x7C:  # every length one byte
            return b"".join((b"J", _BYTE[len(head) + n + 3], head, _BYTE[n + 2], b"\n", _BYTE[n], encoded))
        return _attribute(b"J", self.key, value)

    def encode(self, value) -> bytes:
        kind = type(value)
        if kind is float:
            return self.double_head + _DOUBLE(value)
        if kind is not str and kind is not int:  # bool would share int's entries (True == 1)
            return _attribute(b"J", self.key, value)
        seen = self.seen
        encoded = seen.get(value)
        if encoded is None:
            if len(seen) >= SEEN_AT_MOST:
                seen.clear()
            encoded = seen[value] = _attribute(b"J", self.key, value)
        return encoded


_ID_LEN = b"\x12\x08"
_ID_TIMES = struct.Struct("<2s8sBQBQ").pack  # span id (field 2) and the start and end times


class Child:
    """The constant part of one kind of child span (its name and kind), for ``Child.encode``; ``packed``: the
    same span with no attributes and an unset status (``tail`` ``status(None)``) in one ``struct`` pack."""

    __slots__ = ("middle", "rest", "packs")

    def __init__(self, name: str, kind: int):
        self.middle = field(b"*", name.encode()) + b"0" + _BYTE[kind]
        self.rest = self.middle + status(None) + _LOCAL
        self.packs: dict[int, tuple[bytes, Callable]] = {}  # len(prefix) -> packed's head and Struct.pack

    def packed(self, prefix: bytes, span_id: bytes, start_ns: int, end_ns: int) -> bytes:
        """``encode(prefix[:-2], span_id, start_ns, end_ns, status(None))``, byte for byte; ``prefix``: the
        request's ``span_prefix`` and the span id's tag ``b"\\x12\\x08"`` (as ``RequestTrace`` joins it once a request)."""
        found = self.packs.get(len(prefix))
        if found is None:
            found = self.packs[len(prefix)] = child_packer(len(prefix), len(self.rest))
        head, pack = found
        return pack(head, prefix, span_id, 0x39, start_ns, 0x41, end_ns, self.rest)

    def encode(self, prefix: bytes, span_id: bytes, start_ns: int, end_ns: int, tail: bytes) -> bytes:
        """``child_span`` of this name and kind; ``tail``: its attributes, events and status, already encoded.
        One copy: the span's length is known before its bytes are joined."""
        middle = self.middle
        n = len(prefix) + 34 + len(middle) + len(tail)  # 28: the id and times, 6: the flags
        if n < 0x80:
            head = b"\x12" + _BYTE[n]
        elif n < 0x4000:
            head = bytes((0x12, (n & 0x7F) | 0x80, n >> 7))
        else:
            head = b"\x12" + varint(n)
        return b"".join((head, prefix, _ID_TIMES(_ID_LEN, span_id, 0x39, start_ns, 0x41, end_ns), middle, tail,
                         _LOCAL))


_PACKERS: dict[tuple[int, int], tuple[bytes, Callable]] = {}


def child_packer(prefix_len: int, rest_len: int) -> tuple[bytes, Callable]:
    """The head (tag and length) of a child span whose ``prefix`` (trace id, trace state, parent, the span id's
    tag) and ``rest`` (name, kind, attributes, events, status, flags) have these lengths, and the
    ``Struct.pack`` that writes it from ``(head, prefix, span_id, 0x39, start_ns, 0x41, end_ns, rest)``."""
    key = (prefix_len, rest_len)
    found = _PACKERS.get(key)
    if found is None:
        n = prefix_len + 26 + rest_len  # 8: the span id, 18: the two times and their tags
        head = b"\x12" + varint(n)
        found = (head, struct.Struct(f"<{len(head)}s{prefix_len}s8sBQBQ{rest_len}s").pack)
        if len(_PACKERS) < SEEN_AT_MOST:
            _PACKERS[key] = found
    return found


class FloatEvent:
    """One kind of span event with one float attribute: ``encode(time_ns, value)`` is ``event(name, time_ns,
    {key: value})``, packed at once for a float (its length is known)."""

    __slots__ = ("name", "key", "before", "after", "pack")

    def __init__(self, name: str, key: str):
        self.name, self.key = name, key
        name_field = field(b"\x12", name.encode())
        head = field(b"\n", key.encode()) + b"\x12"
        value = b"\x1a" + _BYTE[len(head) + 10] + head + b"\x09!"  # then the double
        n = 9 + len(name_field) + len(value) + 8
        assert n < 0x80, "a name and key of ours: short"
        self.before, self.after = b"Z" + _BYTE[n] + b"\x09", name_field + value  # the time, then the value
        self.pack = struct.Struct(f"<{len(self.before)}sQ{len(self.after)}sd").pack

    def encode(self, time_ns: int, value) -> bytes:
        if type(value) is float:
            return self.pack(self.before, time_ns, self.after, value)
        return event(self.name, time_ns, {self.key: value})


class Framing:
    """The envelope of a batch: one resource (its attributes, e.g. ``service.name``) and one scope."""

    def __init__(self, resource: dict, scope_name: str, scope_version: str = ""):
        self.resource = field(b"\n", attributes(b"\n", resource))
        scope = field(b"\n", scope_name.encode()) + (field(b"\x12", scope_version.encode()) if scope_version else b"")
        self.scope = field(b"\n", scope)

    def request(self, spans: list[bytes]) -> bytes:
        """An ``ExportTraceServiceRequest`` of these spans (each from ``span``)."""
        scope_spans = field(b"\x12", self.scope + b"".join(spans))
        return field(b"\n", self.resource + scope_spans)
