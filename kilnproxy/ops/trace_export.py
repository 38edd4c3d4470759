"""Sending spans without letting a tracing backend that is away cost the gateway anything.

Imported by ``kilnproxy.ops.tracing`` only when ``[tracing] enabled = true``
(it needs the OpenTelemetry SDK, the ``tracing`` extra).

* ``QuietExporter`` wraps the OTLP/HTTP exporter. An export that fails (a
  refused connection, a timeout, a 4xx/5xx, after the SDK's own retries within
  ``[tracing] timeout``) drops its spans; the gateway's log gets at most one
  line a minute saying how many spans were dropped and why, and one line when
  the endpoint takes spans again. The SDK's own lines about failed exports
  (one or more per batch and per retry) are kept out of the log
  (``silence_sdk``): our line quotes the first and last of them.
* ``BoundedProcessor``: the SDK's batch processor, whose queue holds at most
  ``[tracing] max_queue_size`` spans (the SDK drops the oldest beyond that);
  such drops are counted and reported the same way. Exports run on the
  processor's own thread: requests never wait for the backend.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Callable, Sequence

from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = logging.getLogger("kilnproxy")

REPORT_EVERY = 60.0  # seconds between two log lines about dropped spans
SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.exporter.otlp.common.http",
               "opentelemetry.sdk._shared_internal")


class _SdkLines(logging.Filter):
    """Drops the SDK's log records about exporting; ``take()`` gives the first and last since the last call
    (the first names the cause, e.g. a refused connection; the last the outcome)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None
        self.last: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: keep its template
            message = str(record.msg)
        if self.first is None:
            self.first = message
        self.last = message
        return False

    def take(self) -> str | None:
        first, last, self.first, self.last = self.first, self.last, None, None
        return last if first == last else f"{last} First: {first}"


SDK_LINES = _SdkLines()


def silence_sdk() -> None:
    """Keep the SDK's export-path log lines out of the log (idempotent; process-wide)."""
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if SDK_LINES not in logger.filters:
            logger.addFilter(SDK_LINES)


class QuietExporter(SpanExporter):
    """An exporter that drops what it cannot send, counts it, and says so at most once a minute."""

    def __init__(self, inner: SpanExporter, endpoint: str, *, clock: Callable[[], float] = time.monotonic,
                 every: float = REPORT_EVERY):
        self.inner = inner
        self.endpoint = endpoint
        self.clock = clock
        self.every = every
        self.exported = 0        # spans sent, in all
        self.dropped = 0         # spans dropped, in all (failed exports and a full queue)
        self.failed_exports = 0
        self._unreported = 0     # dropped since the last line
        self._next_line = None   # clock time before which no line is written
        self._failing = False
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> SpanExportResult:
        SDK_LINES.take()
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter must not raise; one that does drops the batch
            SDK_LINES.take()
            result, why = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        else:
            why = SDK_LINES.take() or "the export failed"
        if result is SpanExportResult.SUCCESS:
            self.sent(len(spans))
        else:
            self.failed_exports += 1
            self.drop(len(spans), why)
        return result

    def sent(self, n: int) -> None:
        with self._lock:
            self.exported += n
            recovered, self._failing = self._failing, False
            lost, self._unreported = self._unreported, 0
            self._next_line = None
        if recovered:
            log.warning("tracing: spans reach %s again (%d more dropped since the last report)", self.endpoint, lost)

    def drop(self, n: int, why: str) -> None:
        """``n`` spans are lost; write the line if the last one is a minute old."""
        with self._lock:
            self.dropped += n
            self._unreported += n
            self._failing = True
            now = self.clock()
            if self._next_line is not None and now < self._next_line:
                return
            self._next_line = now + self.every
            lost, self._unreported = self._unreported, 0
        log.warning("tracing: %d span(s) dropped, %s does not take them (%s); %d dropped in all. "
                    "Requests are not affected; this is said at most once a minute", lost, self.endpoint, why,
                    self.dropped)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class BoundedProcessor(BatchSpanProcessor):
    """The SDK's batch processor, its queue bounded by ``max_queue_size``; overflows are reported."""

    def __init__(self, exporter: QuietExporter, max_queue_size: int):
        super().__init__(exporter, max_queue_size=max_queue_size,
                         max_export_batch_size=min(512, max_queue_size))
        self.quiet = exporter
        self.max_queue_size = max_queue_size
        batch = self._batch_processor
        self._queue = getattr(batch, "_queue", None)  # the SDK's deque(maxlen=max_queue_size)
        self._batch_size = getattr(batch, "_max_export_batch_size", 0)
        if not hasattr(batch, "_shutdown") or not hasattr(batch, "emit"):
            self._queue = None  # an SDK built otherwise: its own on_end, with no count of overflows

    def shutdown(self, timeout_millis: float = 30000) -> None:
        """Export what is queued for ``timeout_millis`` at most, then stop the exporter (which ends its
        retries at once): an endpoint that is away does not hold a gateway's shutdown up."""
        batch = self._batch_processor
        if "timeout_millis" in inspect.signature(batch.shutdown).parameters:
            batch.shutdown(timeout_millis=timeout_millis)
        else:
            super().shutdown()

    def queued(self) -> int:
        return len(self._queue) if self._queue is not None else 0

    def on_end(self, span) -> None:
        """Queue an ended span: on the event loop, once per span, so the common case (sampled, the queue
        neither full nor a batch long) is one append; the rest goes the SDK's way (``emit``: dropping the
        oldest of a full queue, waking the exporter's thread for a full batch, refusing after shutdown)."""
        queue = self._queue
        if queue is None:
            return super().on_end(span)
        if not span.context.trace_flags.sampled:
            return
        queued = len(queue)
        if queued >= self.max_queue_size:
            self.quiet.drop(1, f"the queue of spans to send is full ({self.max_queue_size})")
        elif queued + 1 < self._batch_size and not self._batch_processor._shutdown:
            queue.appendleft(span)
            return
        self._batch_processor.emit(span)
