"""Sending spans without letting a tracing backend that is away cost the gateway anything.

* ``SpanQueue`` (``Tracing.processor``): the spans that ended, already encoded (``otlp_wire``),
  wait in a queue of at most ``[tracing] max_queue_size``; beyond it the oldest is dropped and
  counted. The event loop only appends (a deque: no lock); a thread of the queue's own sends them
  in batches of up to 512 (``ExportTraceServiceRequest`` bytes: the batch's spans joined behind
  the resource and scope encoded at start-up), when a batch is full or every ``DELAY`` seconds.
  Requests never wait for the backend.
* ``OtlpHttp``: one POST of a batch to ``endpoint`` (``application/x-protobuf``, the
  ``headers_env`` headers), on a kept-alive connection. A refused connection, a timeout, 408,
  429, 502, 503 or 504 is retried after 1 s, 2 s, 4 s... (±20 %) while ``[tracing] timeout``
  allows from the export's start, and no more once the gateway is stopping.
* ``QuietExporter`` (``Tracing.exporter``): an export that fails drops its spans; the gateway's
  log gets at most one line a minute saying how many spans were dropped and why, and one line
  when the endpoint takes spans again. ``exported``/``dropped`` feed ``/metrics``.
"""

from __future__ import annotations

import http.client
import logging
import random
import threading
import time
from collections import deque
from typing import Callable
from urllib.parse import urlsplit

log = logging.getLogger("kilnproxy")

REPORT_EVERY = 60.0  # seconds between two log lines about dropped spans
DELAY = 5.0          # seconds a span waits at most for a batch to fill
BATCH = 512          # spans in one export, at most
RETRY_STATUSES = frozenset((408, 429, 502, 503, 504))


class ExportFailed(Exception):
    """An export the endpoint did not take; the message says why."""


class QuietExporter:
    """Sends batches with ``send(body)`` (raising ``ExportFailed``), counts what is sent and dropped, and
    says so at most once a minute."""

    def __init__(self, send: Callable[[bytes], None], endpoint: str, *, clock: Callable[[], float] = time.monotonic,
                 every: float = REPORT_EVERY):
        self.send = send
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

    def export(self, body: bytes, spans: int) -> bool:
        """Send one batch of ``spans`` spans; ``False`` when it was dropped. Never raises."""
        try:
            self.send(body)
        except Exception as exc:  # ExportFailed, or a bug in a sender: the batch is dropped either way
            self.failed_exports += 1
            self.drop(spans, str(exc) if isinstance(exc, ExportFailed) else f"{type(exc).__name__}: {exc}")
            return False
        self.sent(spans)
        return True

    def sent(self, n: int) -> None:
        with self._lock:
            self.exported += n
            recovered = self._failing
            if recovered:  # the endpoint takes spans again: the next failure is said at once
                self._failing = False
                lost, self._unreported = self._unreported, 0
                self._next_line = None
        if recovered:
            log.warning("tracing: spans reach %s again (%d more dropped since the last report)", self.endpoint, lost)

    def drop(self, n: int, why: str, failed: bool = True) -> None:
        """``n`` spans are lost; write the line if the last one is a minute old. ``failed``: the endpoint
        did not take them (a full queue is not its failure: an export that then succeeds is no recovery)."""
        with self._lock:
            self.dropped += n
            self._unreported += n
            if failed:
                self._failing = True
            now = self.clock()
            if self._next_line is not None and now < self._next_line:
                return
            self._next_line = now + self.every
            lost, self._unreported = self._unreported, 0
        log.warning("tracing: %d span(s) dropped, %s does not take them (%s); %d dropped in all. "
                    "Requests are not affected; this is said at most once a minute", lost, self.endpoint, why,
                    self.dropped)


class OtlpHttp:
    """``send(body)``: POST one ``ExportTraceServiceRequest``, retried within ``timeout`` seconds."""

    def __init__(self, endpoint: str, headers: dict[str, str], timeout: float, stopping: threading.Event):
        url = urlsplit(endpoint)
        self.connection_class = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self.host, self.port = url.hostname, url.port
        self.path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self.headers = {"Content-Type": "application/x-protobuf", "User-Agent": "kilnproxy-otlp", **headers}
        self.timeout = timeout
        self.stopping = stopping
        self.connection: http.client.HTTPConnection | None = None

    def __call__(self, body: bytes) -> None:
        deadline = time.monotonic() + self.timeout
        backoff = 1.0
        while True:
            left = deadline - time.monotonic()
            try:
                status, answer = self._post(body, max(left, 0.001))
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
                self.close()
                why, retry = f"{type(exc).__name__}: {exc}", True
            else:
                if 200 <= status < 300:
                    return
                why, retry = f"HTTP {status}" + (f": {answer}" if answer else ""), status in RETRY_STATUSES
            wait = backoff * random.uniform(0.8, 1.2)
            if not retry or time.monotonic() + wait >= deadline or self.stopping.wait(wait):
                raise ExportFailed(why)
            backoff *= 2

    def _post(self, body: bytes, timeout: float) -> tuple[int, str]:
        connection = self.connection
        if connection is None:
            connection = self.connection = self.connection_class(self.host, self.port, timeout=timeout)
        else:
            connection.timeout = timeout
            if connection.sock is not None:
                connection.sock.settimeout(timeout)
        connection.request("POST", self.path, body, self.headers)
        response = connection.getresponse()
        answer = response.read()
        if response.will_close:
            self.close()
        text = "" if 200 <= response.status < 300 else answer[:200].decode("utf-8", "replace").strip()
        return response.status, text

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            connection.close()


class SpanQueue:
    """The encoded spans waiting for their export, and the thread that sends them (``Tracing.processor``)."""

    def __init__(self, exporter: QuietExporter, frame: Callable[[list[bytes]], bytes], max_queue_size: int, *,
                 delay: float = DELAY, stopping: threading.Event | None = None):
        self.exporter = exporter
        self.frame = frame
        self.max_queue_size = max_queue_size
        self.batch_size = min(BATCH, max_queue_size)
        self.delay = delay
        self.queue: deque[bytes] = deque()
        self.stopping = stopping or threading.Event()
        self._wake = threading.Event()
        self._flushed: list[threading.Event] = []
        self._full = f"the queue of spans to send is full ({max_queue_size})"
        self._thread = threading.Thread(target=self._run, name="kilnproxy-trace-export", daemon=True)
        self._thread.start()

    def add(self, span: bytes) -> None:
        """Queue one ended span (on the event loop: an append, most of the time)."""
        queue = self.queue
        queued = len(queue)
        if queued >= self.max_queue_size:
            try:
                queue.popleft()  # the oldest goes
            except IndexError:  # the thread took them all meanwhile
                pass
            self.exporter.drop(1, self._full, failed=False)
        queue.append(span)
        if queued + 1 == self.batch_size:
            self._wake.set()

    def add_all(self, spans: list[bytes]) -> None:
        """``add`` each of ``spans``, in one step while the queue has room for them all."""
        queue = self.queue
        queued = len(queue)
        if queued + len(spans) > self.max_queue_size:
            for span in spans:
                self.add(span)
            return
        queue.extend(spans)
        if queued < self.batch_size <= queued + len(spans):
            self._wake.set()

    def queued(self) -> int:
        return len(self.queue)

    def flush(self, timeout: float = 30.0) -> bool:
        """Send what is queued now; ``True`` when done within ``timeout``."""
        done = threading.Event()
        self._flushed.append(done)
        self._wake.set()
        return done.wait(timeout)

    def shutdown(self, timeout: float) -> None:
        """Send what is queued for ``timeout`` seconds at most, then stop (an export's retries end at once)."""
        self.stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        queue, wake = self.queue, self._wake
        while True:
            timed_out = False
            if len(queue) < self.batch_size and not self.stopping.is_set():
                timed_out = not wake.wait(self.delay)
            wake.clear()
            flushed, self._flushed = self._flushed, []
            everything = timed_out or flushed or self.stopping.is_set()  # else full batches only
            while len(queue) >= self.batch_size or (everything and queue):
                batch = []
                for _ in range(min(len(queue), self.batch_size)):
                    batch.append(queue.popleft())
                try:
                    body = self.frame(batch)
                except Exception as exc:  # a bug: the batch goes, the thread stays
                    self.exporter.drop(len(batch), f"{type(exc).__name__}: {exc}")
                    continue
                self.exporter.export(body, len(batch))
            for done in flushed:
                done.set()
            if self.stopping.is_set():
                return
