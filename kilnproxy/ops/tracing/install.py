"""OpenTelemetry traces of the completion requests (``[tracing]``; no dependency).

``install(app)`` does nothing unless ``[tracing] enabled = true``; then it
hands the request path a ``Tracing`` object (``Gateway.tracer``) that sends
spans in batches over OTLP/HTTP (``endpoint``, headers from ``headers_env``),
sampled at ``sample_ratio`` for traces that start here and as the client
said for the others (``trace_context``). With tracing off, the request path
checks ``gw.tracer is None`` once per request and pays nothing else.

The spans are not the OpenTelemetry SDK's: its span objects, their garbage
and its protobuf encoder cost more than the request itself. A span here is a
few fields of ``RequestTrace`` (``request_trace``) while the request runs,
and the bytes of its OTLP protobuf (``otlp_wire``) once the request's row is
committed; an unsampled request is an id to pass upstream and nothing else.

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
(``kilnproxy.ops.tracing.export``).

With ``trace_url`` set, the trace id of each sampled request is kept for the
last ``KEEP_LINKS`` requests (``Tracing.link``): the inspector's detail of a
request links to its trace. The usage table is not changed, so a request
another replica served has no link on this one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from random import getrandbits
from time import time_ns
from urllib.parse import unquote

from aiohttp import web

from ... import __version__
from ...config_types import TracingConfig
from ...proxy.gateway import GATEWAY
from . import otlp_wire as wire
from .request_trace import CALLBACK_CONTEXT, RequestTrace, Unsampled
from .context import Sampler, parent
from .export import OtlpHttp, QuietExporter, SpanQueue

log = logging.getLogger("kilnproxy")

KEEP_LINKS = 10_000  # requests whose trace id is kept for the inspector's link (about 1 MB)

# gen_ai.operation.name of each endpoint (the GenAI semantic conventions' names)
OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings",
              "responses": "chat", "messages": "chat"}

_ZERO_ID = bytes(8)
_LOW_64 = (1 << 64) - 1


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
        self.bound = self.sampler.bound
        self.sample_all = self.bound > _LOW_64
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
        self.ended: list[RequestTrace] = []  # committed, their answers being written: encode_ended's
        self.waiting: list[RequestTrace] = []  # ended, their rows not yet committed, in the order submitted
        self.watched = None  # the commit future of the first of them, with ``commits`` as its callback

    def begin(self, headers, endpoint: str, call) -> "RequestTrace | Unsampled":
        """The request's trace, a child of the client's ``traceparent`` when it sent a valid one."""
        number = getrandbits(448)  # the trace id and the request's span ids, drawn at once
        ids = number.to_bytes(56, "big")
        # no id may be all zeros (about 2**-58 of the draws); a zero byte is in one draw of five: memchr first
        while 0 in ids and _ZERO_ID in ids:
            number = getrandbits(448)
            ids = number.to_bytes(56, "big")
        client = parent(headers) if headers.get("traceparent") else None
        if client is None:
            trace_id, parent_id, state = ids[:16], None, ""
            # self.sampler.new_trace(the trace id), in line
            sampled = self.sample_all or number >> 320 & _LOW_64 < self.bound
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

    def commits(self, future) -> None:
        """The commit watched is done (rows commit in the order they are submitted): each request waiting
        whose row is now committed ends its usage-commit span; their tasks, woken by the same commits, run
        next and write their answers, and their spans are encoded after them (``encode_ended``, one loop
        callback). The first request still waiting is watched next. One callback for the rows of a commit,
        not one a row."""
        now = time_ns()
        ended = self.ended
        scheduled = bool(ended)
        still = []
        for trace in self.waiting:
            if trace.commit.done():
                trace.committed_at = now
                trace.commit = None
                ended.append(trace)
            else:
                still.append(trace)
        self.waiting = still
        if still:
            watched = self.watched = still[0].commit
            watched.add_done_callback(self.commits, context=CALLBACK_CONTEXT)
        else:
            self.watched = None
        if ended and not scheduled:
            # the future's loop: asyncio.get_running_loop() makes a getpid system call each time
            future.get_loop().call_soon(self.encode_ended, context=CALLBACK_CONTEXT)

    def encode_ended(self) -> None:
        """The spans of the requests committed since the last call, queued at once (their answers are
        written: the loop ran their tasks first); each request's own span ends now."""
        ended, self.ended = self.ended, []
        now = time_ns()
        spans: list[bytes] = []
        for trace in ended:
            trace.encode(now, spans)
        self.add_all(spans)

    def _head(self, endpoint: str, org: str) -> tuple[str, bytes]:
        """The operation of ``endpoint`` and the encoded attributes every request of it and ``org`` has."""
        if len(self.heads) >= wire.SEEN_AT_MOST:
            self.heads.clear()
        operation = OPERATIONS.get(endpoint, endpoint)
        head = self.heads[(endpoint, org)] = (operation, wire.attribute(b"J", "gen_ai.operation.name", operation)
                                              + wire.attribute(b"J", "kilnproxy.org", org))
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
