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
import socket
import ssl
import threading
import time
from collections import deque
from itertools import repeat
from operator import call
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
    """``send(body)``: POST one ``ExportTraceServiceRequest``, retried within ``timeout`` seconds.

    HTTP/1.1 on a kept-alive socket of its own (TLS for ``https``), written as ``http.client`` writes the
    request (``Host``, ``Accept-Encoding: identity``, the headers, ``Content-Length``) in one ``sendmsg`` of
    the pre-built head and the body, the answer read by ``_Answer``: ``http.client``'s request and answer
    objects cost five times the system calls' CPU for each batch."""

    def __init__(self, endpoint: str, headers: dict[str, str], timeout: float, stopping: threading.Event):
        url = urlsplit(endpoint)
        self.tls = url.scheme == "https"
        self.host, self.port = url.hostname, url.port or (443 if self.tls else 80)
        self.path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self.headers = {"Content-Type": "application/x-protobuf", "User-Agent": "kilnproxy-otlp", **headers}
        self.timeout = timeout
        self.stopping = stopping
        self.sock: socket.socket | None = None
        self.context: ssl.SSLContext | None = None
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.port != (443 if self.tls else 80):
            host = f"{host}:{self.port}"
        try:
            self.head: bytes | Exception = b"".join(
                [f"POST {self.path} HTTP/1.1\r\nHost: {host}\r\nAccept-Encoding: identity\r\n".encode("ascii")]
                + [f"{name}: {value}\r\n".encode("latin-1") for name, value in self.headers.items()]
                + [b"Content-Length: "])
        except UnicodeEncodeError as exc:  # as http.client would fail each export
            self.head = exc

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
        head = self.head
        if isinstance(head, Exception):
            raise head
        sock = self.sock
        if sock is None:
            sock = self.sock = self._connect(timeout)
        else:
            sock.settimeout(timeout)
        head += b"%d\r\n\r\n" % len(body)
        if self.tls:
            sock.sendall(head + body)
        else:
            sent = sock.sendmsg((head, body))
            if sent < len(head) + len(body):
                sock.sendall((head + body)[sent:])
        answer = _Answer(sock)
        status, text, will_close = answer.read()
        if will_close:
            self.close()
        return status, "" if 200 <= status < 300 else text[:200].decode("utf-8", "replace").strip()

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:
                if self.context is None:  # made once: loading the system's certificates takes milliseconds
                    self.context = ssl.create_default_context()
                    self.context.set_alpn_protocols(["http/1.1"])
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


_MAX_HEAD = 65536  # bytes of an answer's status line and headers, at most (http.client's limit)


class _Answer:
    """An HTTP/1.x answer read from ``sock``: ``read()`` is its status, its body (which may be sent with a
    length, in chunks, or up to the end of the connection) and whether the connection ends with it. An
    answer that is not HTTP raises ``http.client.BadStatusLine``; a connection closed before its end,
    ``http.client.RemoteDisconnected`` or ``http.client.IncompleteRead``."""

    __slots__ = ("sock", "buffer")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > _MAX_HEAD:
                raise http.client.LineTooLong("answer line")
            if not self._more():
                raise http.client.IncompleteRead(self.buffer)
        line, self.buffer = self.buffer[:end], self.buffer[end + 2:]
        return line

    def _exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not self._more():
                raise http.client.IncompleteRead(self.buffer, n - len(self.buffer))
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def read(self) -> tuple[int, bytes, bool]:
        while True:
            while (end := self.buffer.find(b"\r\n\r\n")) < 0:
                if len(self.buffer) > _MAX_HEAD:
                    raise http.client.LineTooLong("answer head")
                if not self._more():
                    if self.buffer:
                        raise http.client.IncompleteRead(self.buffer)
                    raise http.client.RemoteDisconnected("the endpoint closed the connection without an answer")
            head, self.buffer = self.buffer[:end], self.buffer[end + 4:]
            status_line, *lines = head.split(b"\r\n")
            version, _, rest = status_line.partition(b" ")
            code = rest[:3]
            if not version.startswith(b"HTTP/") or len(code) != 3 or not code.isdigit():
                raise http.client.BadStatusLine(repr(status_line))
            status = int(code)
            if status >= 200 or status == 101:
                break  # else 1xx: an interim answer, the real one follows
        fields = {}
        for line in lines:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        connection = fields.get(b"connection", b"").lower()
        will_close = b"close" in connection or (version == b"HTTP/1.0" and b"keep-alive" not in connection)
        if status < 200 or status in (204, 304):
            return status, b"", will_close
        if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            chunks = []
            while size := int(self._line().split(b";", 1)[0].strip() or b"x", 16):
                chunks.append(self._exactly(size))
                self._exactly(2)
            while self._line():  # the trailer
                pass
            return status, b"".join(chunks), will_close
        length = fields.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise http.client.HTTPException(f"Content-Length {length!r}") from None
            return status, self._exactly(n), will_close
        while self._more():  # up to the end of the connection
            pass
        return status, self.buffer, True


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
                batch: list[bytes] = []
                try:  # in C: no bytecode a span
                    batch.extend(map(call, repeat(queue.popleft, min(len(queue), self.batch_size))))
                except IndexError:  # the loop dropped the oldest meanwhile (a full queue): the batch is shorter
                    if not batch:
                        continue
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
