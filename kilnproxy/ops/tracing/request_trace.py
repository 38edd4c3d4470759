"""One request's spans (``RequestTrace``, or ``Unsampled`` when its trace is not recorded).

The request path calls its trace at each part (``kilnproxy.proxy``): ``model``,
``admission()``, ``attempt``/``attempt_done`` per upstream tried,
``first_token``, ``stream_started``, ``end`` when the row is submitted. While
the request runs, a ``RequestTrace`` keeps times and outcomes only; its spans
(the request's own and its children, ``kilnproxy.ops.tracing.install`` lists them) are
encoded to OTLP protobuf (``otlp_wire``) together and handed to the export
queue once the row is committed and the request has written what the commit
let it write (its answer, or ``[DONE]``), but for an admission that raised and
an upstream attempt followed by another, queued when they end. The requests
whose rows one commit wrote end their usage-commit spans in one callback of
that commit (``Tracing.commits``), are encoded in one loop callback
(``Tracing.encode_ended``) and queued with one ``add_all``.

Each traced request is on the gateway's hot path, so the encoding is written
for CPU: the children's shared fields joined once, a child with no attributes
(or an attempt's that repeat) one ``struct`` pack, the values that repeat
(models, token counts, statuses) encoded once and taken from tables; the bytes
are those ``otlp_wire``'s generic calls write (``tests/ops/tracing/test_tracing_wire.py``).
"""

from __future__ import annotations

import contextvars
import traceback
from random import getrandbits
from time import time_ns

from ...proxy.request_record import stored_text
from . import otlp_wire as wire

_ATTRIBUTE, _NO_STATUS = wire.attribute, wire.status(None)
_TIMES, _BYTE = wire.TIMES, wire.BYTE
_FLAGS_LOCAL, _FLAGS_REMOTE = wire.flags(wire.FLAGS_LOCAL), wire.flags(wire.FLAGS_REMOTE)


def _new_span_id() -> bytes:
    return (getrandbits(64) or 1).to_bytes(8, "big")


def _traceparent(trace_id: bytes, span_id: bytes, sampled: bool) -> str:
    return f"00-{trace_id.hex()}-{span_id.hex()}-{'01' if sampled else '00'}"


class Unsampled:
    """A request whose spans are not recorded: its trace still goes upstream (flags ``00``), as the SDK's
    non-recording spans pass it on."""

    __slots__ = ("_trace_id", "_state")

    trace_id = None  # nothing sent: no link

    def __init__(self, trace_id: bytes, state: str):
        self._trace_id = trace_id
        self._state = state

    def admission(self) -> "Unsampled":
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:
        return None

    def attempt(self, base_url: str, headers: dict) -> dict:
        carrier = dict(headers)
        carrier["traceparent"] = _traceparent(self._trace_id, _new_span_id(), False)
        if self._state:
            carrier["tracestate"] = self._state
        return carrier

    def model(self, requested: str) -> None:
        pass

    def attempt_done(self, status: int | None, problem: str | None = None) -> None:
        pass

    def first_token(self, ttft_ms: float) -> None:
        pass

    def stream_started(self) -> None:
        pass

    def end(self, row: dict, committed) -> None:
        pass


_ADMISSION = wire.Child("kilnproxy.admission", wire.INTERNAL)
_UPSTREAM = wire.Child("kilnproxy.upstream", wire.CLIENT)
_STREAM = wire.Child("kilnproxy.stream", wire.INTERNAL)
_COMMIT = wire.Child("kilnproxy.usage_commit", wire.INTERNAL)
_GENERATION_ID = wire.Key("kilnproxy.generation_id")
_SERVER_ADDRESS = wire.Key("server.address")
_STATUS_CODE = wire.Key("http.response.status_code")
_ERROR_TYPE = wire.Key("error.type")
_RESPONSE_MODEL = wire.Key("gen_ai.response.model")
_INPUT_TOKENS = wire.Key("gen_ai.usage.input_tokens")
_OUTPUT_TOKENS = wire.Key("gen_ai.usage.output_tokens")
_COST = wire.Key("kilnproxy.cost_usd")
_DISCONNECTED = {flag: _ATTRIBUTE(b"J", "kilnproxy.disconnected", flag) for flag in (False, True)}
_FIRST_TOKEN = wire.FloatEvent("gen_ai.first_token", "kilnproxy.ttft_ms")
_FIRST_TOKEN_PACK, _FIRST_TOKEN_BEFORE, _FIRST_TOKEN_AFTER = _FIRST_TOKEN.pack, _FIRST_TOKEN.before, _FIRST_TOKEN.after
# the generation id's KeyValue before its text, by the text's length (the gateway's ids: 28 characters)
_GENERATION_HEADS = {n: _GENERATION_ID.unique("x" * n)[:-n] for n in range(1, 64)}


class RequestTrace:
    """One sampled request's spans; the request path calls it at each part (``kilnproxy.proxy``). While the
    request runs, its parts' times and outcomes are kept, not encoded: its spans are encoded together and
    queued at once when its row is committed and its answer written, but for an admission that raised and
    an upstream attempt followed by another, queued when they end.

    ``ids``: the trace id (16 bytes) then the span ids of the request, its admission, its usage commit, its
    first upstream attempt and its stream (8 bytes each), drawn at once by ``Tracing.begin``; ``tracing``: the
    ``Tracing`` whose ``add``/``add_all`` queue the encoded spans."""

    __slots__ = ("tracing", "trace", "ids", "parent_id", "state", "start", "head", "generation_id", "name",
                 "requested", "events", "admitted", "admission_end", "attempt_id", "attempt_start",
                 "attempt_url", "attempt_end", "attempt_status", "attempt_problem", "stream_start", "row", "ending",
                 "committed_at", "commit")

    def __init__(self, tracing, ids: bytes, trace_id: bytes, parent_id: bytes | None, state: str,
                 head: tuple[str, bytes], generation_id: str):
        self.start = time_ns()
        self.tracing = tracing
        self.trace = trace_id
        self.ids = ids
        self.parent_id = parent_id
        self.state = state
        self.head = head
        self.generation_id = generation_id
        self.name = head[0]
        self.requested = self.events = b""
        self.admission_end = self.attempt_url = self.attempt_end = self.stream_start = None

    @property
    def trace_id(self) -> str:
        """The trace's id in hex (this request's spans are sampled: sent)."""
        return self.trace.hex()

    def _state_field(self) -> bytes:
        return wire.field(b"\x1a", self.state.encode()) if self.state else b""

    def _prefix(self) -> bytes:
        """The fields the request's children share (``wire.span_prefix``)."""
        return wire.span_prefix(self.trace, self._state_field(), self.ids[16:24])

    def admission(self) -> "RequestTrace":
        """A context manager around the slot and hold: the admission span, ended on the way out (an exception
        recorded on it as an ``exception`` event with an error status, as the SDK's ``use_span`` does)."""
        return self

    def __enter__(self) -> None:
        self.admitted = time_ns()

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            self.admission_end = time_ns()
            return
        module, name = kind.__module__, kind.__qualname__
        tail = wire.event("exception", time_ns(), {
            "exception.type": f"{module}.{name}" if module and module != "builtins" else name,
            "exception.message": str(exc),
            "exception.stacktrace": "".join(traceback.format_exception(exc)), "exception.escaped": "False"})
        tail += wire.status(f"{kind.__name__}: {exc}")
        self.tracing.add(_ADMISSION.encode(self._prefix(), self.ids[24:32], self.admitted, time_ns(), tail))

    def model(self, requested: str) -> None:
        found = _MODELS.get((self.head[0], requested))
        self.name, self.requested = found if found is not None else _model(self.head[0], requested)

    def attempt(self, base_url: str, headers: dict) -> dict:
        """An upstream attempt begins: its span, and the headers that carry it upstream (W3C trace context,
        written as the SDK's propagator writes it)."""
        if self.attempt_end is not None:  # the attempt before, failed over
            self.tracing.add(self._upstream(self._prefix() + b"\x12\x08"))
            self.attempt_end = None
        span_id = self.attempt_id = self.ids[40:48] if self.attempt_url is None else _new_span_id()
        self.attempt_start = time_ns()
        self.attempt_url = base_url
        carrier = dict(headers) if headers else {}
        carrier["traceparent"] = f"00-{self.trace.hex()}-{span_id.hex()}-01"
        if self.state:
            carrier["tracestate"] = self.state
        return carrier

    def attempt_done(self, status: int | None, problem: str | None = None) -> None:
        """The attempt begun last ended (once: a second call changes nothing)."""
        if self.attempt_url is not None and self.attempt_end is None:
            self.attempt_end = time_ns()
            self.attempt_status, self.attempt_problem = status, problem

    def _upstream(self, prefix: bytes) -> bytes:
        """The span of the attempt that ended (``attempt_done``); ``prefix``: the request's ``span_prefix`` and
        the span id's tag. An attempt that did not fail is one pack of the attributes its upstream and status
        had before."""
        base_url, status, problem = self.attempt_url, self.attempt_status, self.attempt_problem
        if problem is None and (status is None or status < 500):
            key = (base_url, status, len(prefix))
            found = _UPSTREAM_DONE.get(key)
            if found is None:
                rest = _UPSTREAM.middle + _SERVER_ADDRESS.encode(base_url) \
                    + (b"" if status is None else _STATUS_CODE.encode(status)) + _NO_STATUS + _FLAGS_LOCAL
                if len(_UPSTREAM_DONE) >= wire.SEEN_AT_MOST:
                    _UPSTREAM_DONE.clear()
                found = _UPSTREAM_DONE[key] = (*wire.child_packer(len(prefix), len(rest)), rest)
            head, pack, rest = found
            return pack(head, prefix, self.attempt_id, 0x39, self.attempt_start, 0x41, self.attempt_end, rest)
        attrs = _SERVER_ADDRESS.encode(base_url)
        if status is not None:
            attrs += _STATUS_CODE.encode(status)
        attrs += _ERROR_TYPE.encode(problem or str(status))
        tail = attrs + wire.status(problem or f"HTTP {status}")
        return _UPSTREAM.encode(prefix[:-2], self.attempt_id, self.attempt_start, self.attempt_end, tail)

    def first_token(self, ttft_ms: float) -> None:
        if type(ttft_ms) is float:  # as FloatEvent.encode packs it
            self.events += _FIRST_TOKEN_PACK(_FIRST_TOKEN_BEFORE, time_ns(), _FIRST_TOKEN_AFTER, ttft_ms)
        else:
            self.events += _FIRST_TOKEN.encode(time_ns(), ttft_ms)

    def stream_started(self) -> None:
        self.stream_start = time_ns()

    def end(self, row: dict, committed) -> None:
        """The row is submitted: the parts still running end (an upstream attempt as ``cancelled``); the
        usage commit's span ends with the row's commit, the request's own once its answer is written."""
        self.ending = now = time_ns()
        if self.attempt_url is not None and self.attempt_end is None:
            self.attempt_end = now
            self.attempt_status, self.attempt_problem = None, "cancelled"
        self.row = row
        if committed is None:
            self.committed_at = now
            spans: list[bytes] = []
            self.encode(time_ns(), spans)
            self.tracing.add_all(spans)
        else:  # Tracing.commits ends its usage-commit span: one loop callback for the rows one commit wrote
            # (a future done already, a row in the row journal, too: the answer is written first)
            tracing = self.tracing
            self.commit = committed
            tracing.waiting.append(self)
            if tracing.watched is None:
                tracing.watched = committed
                committed.add_done_callback(tracing.commits, context=CALLBACK_CONTEXT)

    def encode(self, now: int, spans: list[bytes]) -> None:
        """The request's spans, appended to ``spans``; the request's own ends at ``now`` (its answer written).
        One pass: the children's shared fields joined once, each child one ``struct`` pack, the request's own
        span one join of its pieces (byte for byte what ``wire.span`` and ``Child.encode`` write), the values
        seen before taken from their keys' tables in line."""
        row, ids, trace = self.row, self.ids, self.trace
        own_id = ids[16:24]
        if self.state:
            state = self._state_field()
            prefix = b"".join((b"\n\x10", trace, state, b'"\x08', own_id, b"\x12\x08"))
        else:
            state = b""
            prefix = b"".join((b"\n\x10", trace, b'"\x08', own_id, b"\x12\x08"))
        packs = _ENDED.get(len(prefix))
        if packs is None:
            packs = _ended(len(prefix))
        head, pack, admission_head, admission_pack = packs
        spans.append(pack(head, prefix, ids[32:40], 0x39, self.ending, 0x41, self.committed_at, _COMMIT_REST))
        if self.admission_end is not None:
            spans.append(admission_pack(admission_head, prefix, ids[24:32], 0x39, self.admitted, 0x41,
                                        self.admission_end, _ADMISSION_REST))
        if self.attempt_end is not None:
            found = None
            if self.attempt_problem is None:
                found = _UPSTREAM_DONE.get((self.attempt_url, self.attempt_status, len(prefix)))
            if found is None:
                spans.append(self._upstream(prefix))
            else:
                head, pack, rest = found
                spans.append(pack(head, prefix, self.attempt_id, 0x39, self.attempt_start, 0x41, self.attempt_end,
                                  rest))
        disconnected = _DISCONNECTED[bool(row["disconnected"])]
        if self.stream_start is not None:
            spans.append(_STREAM.encode(prefix[:-2], ids[48:56], self.stream_start, self.ending, disconnected
                                        + _NO_STATUS))
        # the SDK drops an attribute without a value; ints and strings seen before are in their key's table
        value = row["prompt_tokens"]
        input_tokens = b"" if value is None else (
            type(value) is int and _INPUT_TOKENS.seen.get(value) or _INPUT_TOKENS.encode(value))
        value = row["completion_tokens"]
        output_tokens = b"" if value is None else (
            type(value) is int and _OUTPUT_TOKENS.seen.get(value) or _OUTPUT_TOKENS.encode(value))
        value = row["cost"]
        if value is None:
            cost, cost_value = b"", b""
        elif type(value) is float:
            cost, cost_value = _COST.double_head, _DOUBLE(value)
        else:
            cost, cost_value = _COST.encode(value), b""
        status = row["status"]
        status_code = b"" if status is None else (
            type(status) is int and _STATUS_CODE.seen.get(status) or _STATUS_CODE.encode(status))
        value = row["model"] or ""
        response_model = type(value) is str and _RESPONSE_MODEL.seen.get(value) or _RESPONSE_MODEL.encode(value)
        error = b""
        outcome = _NO_STATUS
        if (code := row["error_code"]) is not None:
            code = stored_text(code)  # an upstream's, perhaps made of the client's text
            error = _ERROR_TYPE.encode(code)
            if status >= 500 or status == 200:  # a server fault, or a stream that ended in one
                outcome = wire.status(code)
        generation_id = self.generation_id.encode()
        generation = _GENERATION_HEADS.get(len(generation_id))
        if generation is None:  # not one of ours
            generation, generation_id = _GENERATION_ID.unique(self.generation_id), b""
        parent_id = self.parent_id
        body = b"".join((
            b"\n\x10", trace, b"\x12\x08", own_id, state, b"" if parent_id is None else b'"\x08' + parent_id,
            _NAMES.get(self.name) or wire.name_field(self.name), b"0\x02", _TIMES(0x39, self.start, 0x41, now),
            self.head[1], generation, generation_id, self.requested, response_model, disconnected, input_tokens,
            output_tokens, cost, cost_value, status_code, error, self.events, outcome,
            _FLAGS_LOCAL if parent_id is None else _FLAGS_REMOTE))
        n = len(body)
        spans.append((_SPAN_HEADS[n] if n < _SHORT_SPAN else b"\x12" + wire.varint(n)) + body)


_UPSTREAM_DONE: dict[tuple, tuple] = {}  # (base_url, status, prefix length) -> child_packer's and the span's rest
_ENDED: dict[int, tuple] = {}  # prefix length -> the commit's and the admission's child_packer
_COMMIT_REST, _ADMISSION_REST = _COMMIT.rest, _ADMISSION.rest
_NAMES, _DOUBLE = wire.NAME_FIELDS, wire.DOUBLE
_SHORT_SPAN = 2048  # spans shorter than this have their tag and length from a table (a request's: about 400 bytes)
_SPAN_HEADS = [b"\x12" + wire.varint(n) for n in range(_SHORT_SPAN)]


def _ended(prefix_len: int) -> tuple:
    found = (*wire.child_packer(prefix_len, len(_COMMIT.rest)), *wire.child_packer(prefix_len, len(_ADMISSION.rest)))
    if len(_ENDED) < wire.SEEN_AT_MOST:
        _ENDED[prefix_len] = found
    return found


# the context the commit callbacks run in: they read no context variable, and one context a request would be copied
CALLBACK_CONTEXT = contextvars.Context()
_MODELS: dict[tuple[str, str], tuple[str, bytes]] = {}  # (operation, requested model) -> span name, attribute


def _model(operation: str, requested: str) -> tuple[str, bytes]:
    """The request span's name and its ``gen_ai.request.model``, kept for the (operation, model) pairs seen.

    The model a client names is any JSON string up to the body's limit: a span holds it as the usage row
    does (``stored_text``: its first 255 characters and "…", a NUL as U+FFFD), as ``gen_ai.response.model``
    (the row's) does too; a lone surrogate a JSON body escaped as U+FFFD, so it is valid UTF-8."""
    key = (operation, requested)
    found = _MODELS.get(key)
    if found is None:
        shown = stored_text(requested)
        if shown is not requested:  # cut or changed: not kept, nor the long text as a key
            return f"{operation} {shown}", wire.unique(b"J", "gen_ai.request.model", shown)
        if len(_MODELS) >= wire.SEEN_AT_MOST:
            _MODELS.clear()
        found = _MODELS[key] = (f"{operation} {shown}", _ATTRIBUTE(b"J", "gen_ai.request.model", shown))
    return found
