"""OpenTelemetry traces of the completion requests (``[tracing]``; no dependency).

``install(app)`` does nothing unless ``[tracing] enabled = true``; then it
hands the request path a ``Tracing`` object (``Gateway.tracer``) that sends
spans in batches over OTLP/HTTP (``endpoint``, headers from ``headers_env``),
sampled at ``sample_ratio`` for traces that start here and as the client
said for the others (``trace_context``). With tracing off, the request path
checks ``gw.tracer is None`` once per request and pays nothing else.

The spans are not the OpenTelemetry SDK's: its span objects, their garbage
and its protobuf encoder cost more than the request itself. A span here is a
few fields of ``RequestTrace`` while it runs, and the bytes of its OTLP
protobuf (``otlp_wire``) once it ends; an unsampled request is an id to pass
upstream and nothing else.

One span per completion request, named ``"{gen_ai.operation.name}
{gen_ai.request.model}"`` (``chat qwen3-32b``, ``text_completion qwen3-32b``),
kind SERVER, a child of the client's W3C ``traceparent``/``tracestate``
(a malformed one is ignored: a new trace). Attributes follow the GenAI
semantic conventions (``gen_ai.operation.name``, ``gen_ai.request.model``,
``gen_ai.response.model``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``) plus ``http.response.status_code``,
``error.type`` (the error code), ``kilnproxy.org``,
``kilnproxy.generation_id`` and ``kilnproxy.cost_usd``. Its children:

* ``kilnproxy.admission``: the in-flight slot and the credit hold;
* ``kilnproxy.upstream`` (kind CLIENT), one per upstream tried, with
  ``server.address`` (the upstream's base URL) and its status or
  ``error.type``; the upstream request carries this span as its
  ``traceparent``, so a model server that traces continues the trace;
* ``kilnproxy.stream``: the relay of a streamed answer, from its first
  event to ``[DONE]`` (``kilnproxy.disconnected`` when the client left);
* ``kilnproxy.usage_commit``: from the row's submission to its commit.

Time to first token is the event ``gen_ai.first_token`` on the request span.
While a request runs its trace keeps times and values only; its spans are
encoded and handed to the exporter together when its row is committed.

Spans wait for their export in a queue of at most ``max_queue_size`` and are
sent from a thread of their own; an endpoint that is away costs requests
nothing, its spans are dropped and said so once a minute
(``kilnproxy.ops.trace_export``).

With ``trace_url`` set, the trace id of each sampled request is kept for the
last ``KEEP_LINKS`` requests (``Tracing.link``): the inspector's detail of a
request links to its trace. The usage table is not changed, so a request
another replica served has no link on this one.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import traceback
from collections import OrderedDict
from random import getrandbits
from time import time_ns
from urllib.parse import unquote

from aiohttp import web

from .. import __version__
from ..config_types import TracingConfig
from ..proxy.gateway import GATEWAY
from . import otlp_wire as wire
from .trace_context import Sampler, parent
from .trace_export import OtlpHttp, QuietExporter, SpanQueue

log = logging.getLogger("kilnproxy")

KEEP_LINKS = 10_000  # requests whose trace id is kept for the inspector's link (about 1 MB)

# gen_ai.operation.name of each endpoint (the GenAI semantic conventions' names)
OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings",
              "responses": "chat", "messages": "chat"}

_ATTRIBUTE, _NO_STATUS = wire.attribute, wire.status(None)
_ZERO_ID = bytes(8)


def install(app: web.Application) -> None:
    gw = app[GATEWAY]
    if not gw.config.tracing.enabled:
        return
    tracing = Tracing(gw.config.tracing)

    async def lifetime(app: web.Application):
        gw.tracer = tracing
        yield
        gw.tracer = None
        await asyncio.get_running_loop().run_in_executor(None, tracing.close)  # it blocks while it sends

    app.cleanup_ctx.append(lifetime)


def resource(service_name: str) -> dict[str, str]:
    """The resource of every span: as the SDK's (``OTEL_RESOURCE_ATTRIBUTES`` read), ``service_name``'s name."""
    found: dict[str, str] = {"telemetry.sdk.language": "python", "telemetry.sdk.name": "kilnproxy",
                             "telemetry.sdk.version": __version__}
    for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, eq, value = item.partition("=")
        if eq and key.strip():
            found[key.strip()] = unquote(value.strip())
    found["service.name"] = service_name
    return found


class Tracing:
    """Where each request's trace starts, and the queue its spans go to.

    ``send``: what posts one encoded batch (``OtlpHttp`` to ``endpoint`` unless a test gives its own)."""

    def __init__(self, config: TracingConfig, send=None):
        self.sampler = Sampler(config.sample_ratio)
        self.framing = wire.Framing(resource(config.service_name), "kilnproxy")
        self.timeout = config.timeout
        stopping = threading.Event()
        self.sender = send if send is not None else OtlpHttp(config.endpoint, dict(config.headers), config.timeout,
                                                              stopping)
        self.exporter = QuietExporter(self.sender, config.endpoint)
        self.processor = SpanQueue(self.exporter, self.framing.request, config.max_queue_size, stopping=stopping)
        self.add = self.processor.add
        self.add_all = self.processor.add_all
        self.trace_url = config.trace_url
        self.trace_ids: OrderedDict[str, str] | None = OrderedDict() if config.trace_url else None
        self.heads: dict[tuple[str, str], tuple[str, bytes]] = {}  # (endpoint, org) -> _head's

    def begin(self, headers, endpoint: str, call) -> "RequestTrace | Unsampled":
        """The request's trace, a child of the client's ``traceparent`` when it sent a valid one."""
        number = getrandbits(448)  # the trace id and the request's span ids, drawn at once
        ids = number.to_bytes(56, "big")
        while _ZERO_ID in ids:  # no id may be all zeros (about 2**-58 of the draws)
            number = getrandbits(448)
            ids = number.to_bytes(56, "big")
        client = parent(headers)
        if client is None:
            trace_id, parent_id, state = ids[:16], None, ""
            sampled = self.sampler.new_trace(number >> 320)
        else:
            trace_id, parent_id, sampled, state = client
        if not sampled:
            return Unsampled(trace_id, state)
        head = self.heads.get((endpoint, call.org))
        if head is None:
            head = self._head(endpoint, call.org)
        trace = RequestTrace(self, ids, trace_id, parent_id, state, head, call.generation_id)
        ids = self.trace_ids
        if ids is not None:
            ids[call.generation_id] = trace_id.hex()
            if len(ids) > KEEP_LINKS:
                ids.popitem(last=False)
        return trace

    def _head(self, endpoint: str, org: str) -> tuple[str, bytes]:
        """The operation of ``endpoint`` and the encoded attributes every request of it and ``org`` has."""
        if len(self.heads) >= wire.SEEN_AT_MOST:
            self.heads.clear()
        operation = OPERATIONS.get(endpoint, endpoint)
        head = self.heads[(endpoint, org)] = (operation, _ATTRIBUTE(b"J", "gen_ai.operation.name", operation)
                                              + _ATTRIBUTE(b"J", "kilnproxy.org", org))
        return head

    def link(self, generation_id: str) -> dict | None:
        """``{"trace_id", "url"}`` of a request this process traced (``trace_url`` set, sampled, among
        the last ``KEEP_LINKS``); the template's ``{trace_id}`` replaced as plain text."""
        trace_id = self.trace_ids.get(generation_id) if self.trace_ids is not None else None
        if trace_id is None:
            return None
        return {"trace_id": trace_id, "url": self.trace_url.replace("{trace_id}", trace_id)}

    def close(self) -> None:
        """Send what is still queued (``timeout`` at most: an endpoint that is away does not hold the shutdown
        up, its retries end at once), then stop the exporter's thread."""
        self.processor.shutdown(self.timeout)
        close = getattr(self.sender, "close", None)
        if close is not None:
            close()


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


class RequestTrace:
    """One sampled request's spans; the request path calls it at each part (``kilnproxy.proxy``). While the
    request runs, its parts' times and outcomes are kept, not encoded: its spans are encoded together and
    queued at once when its row is committed, but for an admission that raised and an upstream attempt
    followed by another, queued when they end.

    ``ids``: the trace id (16 bytes) then the span ids of the request, its admission, its usage commit, its
    first upstream attempt and its stream (8 bytes each), drawn at once by ``Tracing.begin``."""

    __slots__ = ("tracing", "trace", "ids", "parent_id", "state", "start", "head", "generation_id", "name",
                 "requested", "events", "admitted", "admission_end", "attempts", "attempt_id", "attempt_start",
                 "attempt_url", "attempt_end", "attempt_status", "attempt_problem", "stream_start", "row", "ending")

    def __init__(self, tracing: Tracing, ids: bytes, trace_id: bytes, parent_id: bytes | None, state: str,
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
        self.attempts = 0
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
        self.name, self.requested = _model(self.head[0], requested)

    def attempt(self, base_url: str, headers: dict) -> dict:
        """An upstream attempt begins: its span, and the headers that carry it upstream (W3C trace context,
        written as the SDK's propagator writes it)."""
        if self.attempt_end is not None:  # the attempt before, failed over
            self.tracing.add(self._upstream(self._prefix()))
            self.attempt_end = None
        self.attempts += 1
        span_id = self.attempt_id = self.ids[40:48] if self.attempts == 1 else _new_span_id()
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
        """The span of the attempt that ended (``attempt_done``)."""
        base_url, status, problem = self.attempt_url, self.attempt_status, self.attempt_problem
        if problem is None and (status is None or status < 500):
            tail = _SERVER_ADDRESS.encode(base_url) + (b"" if status is None else _STATUS_CODE.encode(status)) \
                + _NO_STATUS
        else:
            attrs = _SERVER_ADDRESS.encode(base_url)
            if status is not None:
                attrs += _STATUS_CODE.encode(status)
            attrs += _ERROR_TYPE.encode(problem or str(status))
            tail = attrs + wire.status(problem or f"HTTP {status}")
        return _UPSTREAM.encode(prefix, self.attempt_id, self.attempt_start, self.attempt_end, tail)

    def first_token(self, ttft_ms: float) -> None:
        self.events += _FIRST_TOKEN.encode(time_ns(), ttft_ms)

    def stream_started(self) -> None:
        self.stream_start = time_ns()

    def end(self, row: dict, committed) -> None:
        """The row is submitted: the parts still running end (an upstream attempt as ``cancelled``), and the
        request's span ends with the row's commit."""
        self.ending = now = time_ns()
        if self.attempt_url is not None and self.attempt_end is None:
            self.attempt_end = now
            self.attempt_status, self.attempt_problem = None, "cancelled"
        self.row = row
        if committed is None or committed.done():
            self(None)
        else:
            committed.add_done_callback(self, context=_CALLBACKS)

    def __call__(self, _future) -> None:
        """The row is committed: the request's spans, queued at once (the commit future's callback: the trace
        itself, no bound method a request)."""
        now = time_ns()
        row, ids, prefix = self.row, self.ids, self._prefix()
        spans = [_COMMIT.encode(prefix, ids[32:40], self.ending, now, _NO_STATUS)]
        if self.admission_end is not None:
            spans.append(_ADMISSION.encode(prefix, ids[24:32], self.admitted, self.admission_end, _NO_STATUS))
        if self.attempt_end is not None:
            spans.append(self._upstream(prefix))
        disconnected = _DISCONNECTED[bool(row["disconnected"])]
        if self.stream_start is not None:
            spans.append(_STREAM.encode(prefix, ids[48:56], self.stream_start, self.ending, disconnected
                                        + _NO_STATUS))
        attrs = [self.head[1], _GENERATION_ID.unique(self.generation_id), self.requested,
                 _RESPONSE_MODEL.encode(row["model"] or ""), disconnected]
        # the SDK drops an attribute without a value
        if (value := row["prompt_tokens"]) is not None:
            attrs.append(_INPUT_TOKENS.encode(value))
        if (value := row["completion_tokens"]) is not None:
            attrs.append(_OUTPUT_TOKENS.encode(value))
        if (value := row["cost"]) is not None:
            attrs.append(_COST.encode(value))
        status = row["status"]
        if status is not None:
            attrs.append(_STATUS_CODE.encode(status))
        outcome = _NO_STATUS
        if row["error_code"] is not None:
            attrs.append(_ERROR_TYPE.encode(row["error_code"]))
            if status >= 500 or status == 200:  # a server fault, or a stream that ended in one
                outcome = wire.status(row["error_code"])
        spans.append(wire.span(self.trace, ids[16:24], self.parent_id, self._state_field(), self.name, wire.SERVER,
                               self.start, now, b"".join(attrs), self.events, outcome,
                               wire.FLAGS_LOCAL if self.parent_id is None else wire.FLAGS_REMOTE))
        self.tracing.add_all(spans)


# the context the commit callbacks run in: they read no context variable, and one context a request would be copied
_CALLBACKS = contextvars.Context()
_MODELS: dict[tuple[str, str], tuple[str, bytes]] = {}  # (operation, requested model) -> span name, attribute


def _model(operation: str, requested: str) -> tuple[str, bytes]:
    """The request span's name and its ``gen_ai.request.model``, kept for the (operation, model) pairs seen."""
    key = (operation, requested)
    found = _MODELS.get(key)
    if found is None:
        if len(_MODELS) >= wire.SEEN_AT_MOST:
            _MODELS.clear()
        found = _MODELS[key] = (f"{operation} {requested}", _ATTRIBUTE(b"J", "gen_ai.request.model", requested))
    return found
