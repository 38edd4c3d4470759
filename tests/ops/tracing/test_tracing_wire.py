"""A request's export, byte for byte, against the encoder before the one-pass encoding: the spans a
``RequestTrace`` queues are compared with those the generic ``otlp_wire`` calls (``span``, ``Child.encode``,
``attribute``) write for the same trace, as bytes and as the official ``opentelemetry-proto`` decodes them,
every field; and the OTLP/HTTP sender against answers in each of HTTP/1.x's shapes, and over TLS."""

import itertools
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from otlp_receiver import decode
from tls import certificates  # noqa: F401 (a fixture: the test CA and a certificate it signed)

from kilnproxy.config_types import TracingConfig
from kilnproxy.ops.tracing import otlp_wire as wire
from kilnproxy.ops.tracing import request_trace
from kilnproxy.ops.tracing import install as tracing_module
from kilnproxy.ops.tracing.export import ExportFailed, OtlpHttp
from kilnproxy.ops.tracing.install import Tracing
from kilnproxy.proxy.request_record import stored_text

IDS = int.from_bytes(bytes(range(1, 57)), "big")  # what getrandbits(448) gives: the trace id and the span ids
CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Clock:
    """``time_ns`` for the trace: a microsecond later at each call; ``last`` the latest it gave."""

    def __init__(self):
        self.ticks = itertools.count(1_764_633_600_000_000_000, 1000)
        self.last = 0

    def __call__(self) -> int:
        self.last = next(self.ticks)
        return self.last


def reference(t, now: int) -> list[bytes]:
    """What the encoder before the one-pass encoding queued at the commit for trace ``t`` (its code, on
    the generic calls ``otlp_wire`` still has), its request span ending at ``now``."""
    row, ids = t.row, t.ids
    state = wire.field(b"\x1a", t.state.encode()) if t.state else b""
    prefix = wire.span_prefix(t.trace, state, ids[16:24])
    no_status = wire.status(None)
    spans = [wire.Child("kilnproxy.usage_commit", wire.INTERNAL).encode(prefix, ids[32:40], t.ending, t.committed_at,
                                                                       no_status)]
    if t.admission_end is not None:
        spans.append(wire.Child("kilnproxy.admission", wire.INTERNAL).encode(prefix, ids[24:32], t.admitted,
                                                                            t.admission_end, no_status))
    if t.attempt_end is not None:
        spans.append(upstream(t, prefix))
    disconnected = wire.attribute(b"J", "kilnproxy.disconnected", bool(row["disconnected"]))
    if t.stream_start is not None:
        spans.append(wire.Child("kilnproxy.stream", wire.INTERNAL).encode(prefix, ids[48:56], t.stream_start,
                                                                         t.ending, disconnected + no_status))
    attrs = [t.head[1], wire.unique(b"J", "kilnproxy.generation_id", t.generation_id), t.requested,
             wire.attribute(b"J", "gen_ai.response.model", row["model"] or ""), disconnected]
    for key, field in (("gen_ai.usage.input_tokens", "prompt_tokens"),
                       ("gen_ai.usage.output_tokens", "completion_tokens"), ("kilnproxy.cost_usd", "cost"),
                       ("http.response.status_code", "status")):
        if row[field] is not None:
            attrs.append(wire.attribute(b"J", key, row[field]))
    outcome = no_status
    if row["error_code"] is not None:
        code = stored_text(row["error_code"])
        attrs.append(wire.attribute(b"J", "error.type", code))
        if row["status"] >= 500 or row["status"] == 200:
            outcome = wire.status(code)
    spans.append(wire.span(t.trace, ids[16:24], t.parent_id, state, t.name, wire.SERVER, t.start, now,
                           b"".join(attrs), t.events, outcome,
                           wire.FLAGS_LOCAL if t.parent_id is None else wire.FLAGS_REMOTE))
    return spans


def upstream(t, prefix: bytes) -> bytes:
    """The span of the attempt that ended, as the encoder before wrote it."""
    status, problem = t.attempt_status, t.attempt_problem
    attrs = wire.attribute(b"J", "server.address", t.attempt_url)
    if status is not None:
        attrs += wire.attribute(b"J", "http.response.status_code", status)
    if problem is None and (status is None or status < 500):
        tail = attrs + wire.status(None)
    else:
        tail = attrs + wire.attribute(b"J", "error.type", problem or str(status)) \
            + wire.status(problem or f"HTTP {status}")
    return wire.Child("kilnproxy.upstream", wire.CLIENT).encode(prefix, t.attempt_id, t.attempt_start, t.attempt_end,
                                                               tail)


def row(**extra) -> dict:
    return {"id": "gen-0", "model": "qwen3-32b", "prompt_tokens": 9, "completion_tokens": 64, "cost": 0.000146,
            "status": 200, "disconnected": 0, "error_code": None, **extra}


# (client headers, upstream attempts as (status, problem), streamed, row)
CASES = {
    "M2's request": ({}, [(200, None)], False, row()),
    "a client's trace and tracestate, a stream": ({"traceparent": CLIENT, "tracestate": "vendor=1,other=x"},
                                                  [(200, None)], True, row(disconnected=1)),
    "failed over twice": ({}, [(429, None), (None, "ClientConnectorError"), (200, None)], False, row()),
    "an upstream's error": ({}, [(502, None)], False, row(status=502, error_code="upstream_error",
                                                          completion_tokens=None, cost=None)),
    "a stream cut by a 500 and no usage": ({}, [(200, None)], True,
                                           row(error_code="x" * 300, prompt_tokens=None, completion_tokens=None,
                                               cost=None, model=None)),
    "an id and model of any length": ({}, [(200, None)], False, row(model="m" * 200)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_requests_export_is_what_the_encoder_before_wrote(case, monkeypatch):
    headers, attempts, streamed, answer = CASES[case]
    clock = Clock()
    monkeypatch.setattr(request_trace, "time_ns", clock)
    monkeypatch.setattr(tracing_module, "getrandbits", lambda bits: IDS)
    tracing = Tracing(TracingConfig(enabled=True), send=lambda body: None)
    try:
        queued, expected = [], []
        tracing.add = queued.append
        tracing.add_all = queued.extend
        generation = "gen-019ad8c4f3a0" + "7c1e2b9d4a6f" if case != "an id and model of any length" else "g" * 90
        trace = tracing.begin(headers, "chat/completions", type("Call", (), {"org": "acme",
                                                                              "generation_id": generation}))
        trace.model("m" * 300 if case == "an id and model of any length" else "qwen3-32b")
        with trace.admission():
            pass
        for n, (status, problem) in enumerate(attempts):
            if n:  # the attempt before is queued as this one begins
                expected.append(upstream(trace, wire.span_prefix(trace.trace, trace._state_field(), trace.ids[16:24])))
            trace.attempt(f"http://upstream-{n}:8000/v1", {})
            trace.attempt_done(status, problem)
        trace.first_token(12.5)
        if streamed:
            trace.stream_started()
        trace.end(answer, None)
        expected += reference(trace, clock.last)
        assert queued == expected
        frame = tracing.framing.request
        assert decode(frame(queued)) == decode(frame(expected))
        assert len(decode(frame(queued))) == 3 + len(attempts) + streamed
    finally:
        tracing.close()


class OneConnection:
    """A server taking one connection, answering each request on it with the next of ``answers`` (raw bytes);
    ``requests``: what it read (head and body)."""

    def __init__(self, answers: list[bytes]):
        self.answers = answers
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1/traces"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            data = b""
            for answer in self.answers:
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, data = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                while len(data) < length:
                    data += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + data[:length])
                data = data[length:]
                conn.sendall(answer)

    def close(self) -> None:
        self.thread.join(5)
        self.listener.close()


def test_the_sender_reads_answers_of_each_shape_on_one_kept_alive_connection():
    server = OneConnection([
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nTrailer: 1\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nno such thing",
    ])
    send = OtlpHttp(server.url, {"x-api-key": "s3cret"}, 5.0, threading.Event())
    for body in (b"one", b"two" * 40_000, b""):
        send(body)
        assert send.sock is not None  # kept alive
    with pytest.raises(ExportFailed, match="HTTP 400: no such thing"):
        send(b"four")
    assert send.sock is None
    server.close()
    first = server.requests[0]
    port = server.url.split(":")[2].split("/")[0]
    assert first == (f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept-Encoding: identity\r\n"
                     "Content-Type: application/x-protobuf\r\nUser-Agent: kilnproxy-otlp\r\nx-api-key: s3cret\r\n"
                     "Content-Length: 3\r\n\r\none").encode()
    assert [r.partition(b"\r\n\r\n")[2] for r in server.requests] == [b"one", b"two" * 40_000, b"", b"four"]


def test_the_sender_retries_an_answer_cut_short():
    server = OneConnection([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"])  # then the connection ends
    send = OtlpHttp(server.url, {}, 0.5, threading.Event())
    with pytest.raises(ExportFailed, match="IncompleteRead"):
        send(b"x")
    server.close()


@pytest.fixture
def tls_collector(certificates):
    """A collector over TLS (the certificate for 127.0.0.1, signed by the test CA), HTTP/1.1 kept alive:
    its URL and the bodies it took."""
    _, cert, key = certificates
    got = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            got.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SimpleNamespace(url=f"https://127.0.0.1:{server.server_port}/v1/traces", got=got)
    server.shutdown()
    server.server_close()


def test_the_sender_verifies_an_https_endpoint_and_keeps_its_connection(tls_collector, certificates, monkeypatch):
    ca, _, _ = certificates
    with pytest.raises(ExportFailed, match="CERTIFICATE_VERIFY_FAILED"):  # the system's CAs do not know ours
        OtlpHttp(tls_collector.url, {}, 0.5, threading.Event())(b"x")
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    send = OtlpHttp(tls_collector.url, {}, 5.0, threading.Event())
    for body in (b"one", b"two" * 100_000):
        send(body)
    assert tls_collector.got == [b"one", b"two" * 100_000] and send.sock is not None
    send.close()
