"""The tracing parts on their own, each export decoded with the official ``opentelemetry-proto``
messages (``otlp_receiver.decode``): the span tree, sampling, W3C trace context, the inspector's
links, the bounded queue, the once-a-minute report of dropped spans and the OTLP/HTTP sender."""

import asyncio
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from multidict import CIMultiDict
from otlp_receiver import decode

from kilnproxy.config_types import TracingConfig
from kilnproxy.ops.tracing import otlp_wire as wire
from kilnproxy.ops.tracing import install as tracing_module
from kilnproxy.ops.tracing.context import Sampler, parent, trace_state
from kilnproxy.ops.tracing.export import ExportFailed, OtlpHttp, QuietExporter
from kilnproxy.ops.tracing.install import Tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def call(n: int = 0):
    return SimpleNamespace(org="acme", generation_id=f"gen-{n}")


def row(n: int = 0, **extra):
    return {"id": f"gen-{n}", "model": "m", "prompt_tokens": 3, "completion_tokens": 2, "cost": 0.5, "status": 200,
            "disconnected": 0, "error_code": None, **extra}


class Memory:
    """A sender that keeps what it is given, decoded."""

    def __init__(self):
        self.spans: list[dict] = []
        self.bodies = 0

    def __call__(self, body: bytes) -> None:
        self.bodies += 1
        self.spans.extend(decode(body))


@pytest.fixture
def memory():
    return Memory()


def tracing_with(memory, **config) -> Tracing:
    return Tracing(TracingConfig(enabled=True, **config), send=memory)


def finished(t: Tracing, memory) -> list:
    assert t.processor.flush(5)
    return memory.spans


def one_span(name: str) -> bytes:
    return wire.span(os.urandom(16), os.urandom(8), None, b"", name, wire.INTERNAL, 1, 2, b"", b"", wire.status(None),
                     wire.FLAGS_LOCAL)


def test_a_request_is_a_server_span_with_its_children_ending_at_the_commit(memory):
    t = tracing_with(memory)
    trace = t.begin({}, "chat/completions", call())
    trace.model("m")
    with trace.admission():
        pass
    trace.attempt_done(None)  # no attempt yet: nothing to end
    headers = trace.attempt("http://up/v1", {"Authorization": "x"})
    assert headers["traceparent"].startswith(f"00-{trace.trace_id}-") and headers["Authorization"] == "x"
    trace.attempt_done(503)
    trace.attempt_done(200)  # ended already: no change
    trace.end(row(), None)
    spans = {s["name"]: s for s in finished(t, memory)}
    assert sorted(spans) == ["chat m", "kilnproxy.admission", "kilnproxy.upstream", "kilnproxy.usage_commit"]
    assert spans["kilnproxy.upstream"]["attributes"]["error.type"] == "503"
    root = spans["chat m"]
    assert root["attributes"]["gen_ai.usage.input_tokens"] == 3 and root["attributes"]["kilnproxy.cost_usd"] == 0.5
    assert all(s["parent_span_id"] == root["span_id"] for s in spans.values() if s is not root)
    # what the SDK wrote too: flags saying the parent is local, unset status, the resource and scope
    assert root["parent_span_id"] == "" and {s["flags"] for s in spans.values()} == {0x100}
    assert spans["kilnproxy.upstream"]["status_message"] == "HTTP 503" and root["status"] == 0
    assert all(s["start"] <= s["end"] for s in spans.values()) and root["start"] <= spans["kilnproxy.admission"]["start"]
    assert root["resource"]["service.name"] == "kilnproxy" and root["resource"]["telemetry.sdk.language"] == "python"
    assert root["scope"] == "kilnproxy"
    t.close()


def test_a_clients_trace_is_continued_with_its_tracestate(memory):
    t = tracing_with(memory)
    trace = t.begin({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=1, other=x "},
                    "completions", call())
    sent = trace.attempt("http://up/v1", {})
    assert sent["tracestate"] == "vendor=1,other=x" and sent["traceparent"].endswith("-01")
    trace.attempt_done(200)
    trace.end(row(), None)
    spans = {s["name"]: s for s in finished(t, memory)}
    root = spans["text_completion"]
    assert (root["trace_id"], root["parent_span_id"], root["flags"]) == (TRACE_ID, CLIENT_SPAN, 0x300)
    assert {s["trace_state"] for s in spans.values()} == {"vendor=1,other=x"}
    assert sent["traceparent"] == f"00-{TRACE_ID}-{spans['kilnproxy.upstream']['span_id']}-01"
    t.close()


def test_an_exception_in_admission_is_an_event_and_an_error_status(memory):
    t = tracing_with(memory)
    trace = t.begin({}, "completions", call())
    with pytest.raises(TimeoutError):
        with trace.admission():
            raise TimeoutError("no slot")
    trace.end(row(), None)
    admission = {s["name"]: s for s in finished(t, memory)}["kilnproxy.admission"]
    assert (admission["status"], admission["status_message"]) == (2, "TimeoutError: no slot")
    [(name, attributes)] = admission["events"]
    assert name == "exception" and attributes["exception.type"] == "TimeoutError"
    assert attributes["exception.message"] == "no slot" and "TimeoutError: no slot" in attributes["exception.stacktrace"]
    t.close()


def test_sampling_follows_the_ratio_and_the_clients_flag(memory):
    t = tracing_with(memory, sample_ratio=0.0, trace_url="https://traces.example/{trace_id}")
    unsampled = t.begin({}, "completions", call(1))
    assert unsampled.trace_id is None
    unsampled.end(row(1), None)
    sampled = t.begin({"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}, "completions", call(2))
    assert sampled.trace_id == TRACE_ID
    sampled.end(row(2), None)
    assert {s["trace_id"] for s in finished(t, memory)} == {TRACE_ID}
    assert t.link("gen-1") is None
    assert t.link("gen-2") == {"trace_id": TRACE_ID, "url": f"https://traces.example/{TRACE_ID}"}
    t.close()


def test_an_unsampled_request_still_passes_its_trace_upstream(memory):
    t = tracing_with(memory, sample_ratio=1.0)
    trace = t.begin({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00", "tracestate": "vendor=1"}, "completions",
                    call())
    sent = trace.attempt("http://up/v1", {"a": "b"})
    assert sent["traceparent"].startswith(f"00-{TRACE_ID}-") and sent["traceparent"].endswith("-00")
    assert sent["traceparent"][36:52] != CLIENT_SPAN and sent["tracestate"] == "vendor=1" and sent["a"] == "b"
    with trace.admission():
        trace.attempt_done(200)
    trace.end(row(), None)
    assert finished(t, memory) == [] and memory.bodies == 0
    t.close()


def test_the_ratio_is_on_the_low_64_bits_of_the_trace_id():
    half = Sampler(0.5)
    assert half.new_trace(0) and half.new_trace((1 << 100) + (1 << 63) - 1) and not half.new_trace(1 << 63)
    assert not Sampler(0.0).new_trace(0) and Sampler(1.0).new_trace((1 << 64) - 1)


@pytest.mark.parametrize("header", [
    "00-not-a-trace-01", f"00-{TRACE_ID}-{CLIENT_SPAN}-01-extra", f"ff-{TRACE_ID}-{CLIENT_SPAN}-01",
    f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{TRACE_ID}-{'0' * 16}-01", f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01", "",
    f"00-{TRACE_ID}-{CLIENT_SPAN.upper()}-01", f"0A-{TRACE_ID}-{CLIENT_SPAN}-01", f"00-{TRACE_ID}-{CLIENT_SPAN}-0A",
    f"cc-{TRACE_ID}-{CLIENT_SPAN}-01.more", f"00-{TRACE_ID}-{CLIENT_SPAN}-01\n", f"01-{TRACE_ID}-{CLIENT_SPAN}"])
def test_a_malformed_traceparent_is_no_parent(header):
    assert parent({"traceparent": header}) is None
    assert parent({"traceparent": header, "tracestate": "vendor=1"}) is None  # its tracestate is not read


def test_two_traceparent_fields_are_no_parent():
    headers = CIMultiDict([("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01"),
                           ("Traceparent", f"00-{TRACE_ID[::-1]}-{CLIENT_SPAN}-01")])
    assert parent(headers) is None


def test_tracestate_fields_are_one_list_in_their_order():
    headers = CIMultiDict([("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01"), ("tracestate", "foo=1,bar=2"),
                           ("TraceState", ""), ("tracestate", " rojo=1 , congo=2"), ("tracestate", "baz=3")])
    assert parent(headers).trace_state == "foo=1,bar=2,rojo=1,congo=2,baz=3"
    assert parent(CIMultiDict([("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01"), ("tracestate", ""),
                               ("tracestate", "foo=1")])).trace_state == "foo=1"
    members = [f"bar{n:02d}={n:02d}" for n in range(1, 34)]
    fields = [("tracestate", ",".join(members[i:i + 10])) for i in range(0, 30, 10)]
    tp = ("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")
    assert parent(CIMultiDict([tp, *fields, ("tracestate", "bar31=31,bar32=32")])).trace_state == ",".join(members[:32])
    assert parent(CIMultiDict([tp, *fields, ("tracestate", "bar31=31,bar32=32,bar33=33")])).trace_state == ""


def test_a_tracestate_over_512_characters_loses_whole_members_the_long_ones_first():
    long_a, long_b = "a=" + "x" * 200, "b=" + "y" * 200  # 202 characters each: over 128
    shorts = [f"k{n:02d}=" + "v" * 20 for n in range(20)]  # 24 characters each
    state = ",".join([shorts[0], long_a, *shorts[1:10], long_b, *shorts[10:]])
    assert len(state) > 512
    # without the two long members: 20 x 24 + 19 = 499 characters
    assert trace_state(state) == ",".join(shorts)
    many = ",".join(f"k{n:02d}=" + "v" * 40 for n in range(16))  # 44 characters each: 16 x 45 - 1 = 719
    assert trace_state(many) == ",".join(f"k{n:02d}=" + "v" * 40 for n in range(11))  # 11 x 45 - 1 = 494
    exactly = ",".join(f"k{n:02d}=" + "v" * 26 for n in range(17))  # 30 each: 17 x 31 - 1 = 526
    assert len(trace_state(exactly)) == 16 * 31 - 1
    assert trace_state(",".join(f"k{n:02d}=" + "v" * 27 for n in range(16))) == ",".join(
        f"k{n:02d}=" + "v" * 27 for n in range(16))  # 16 x 32 - 1 = 511: kept whole


def test_a_repeated_tracestate_key_keeps_its_first_member():
    assert trace_state("foo=1,foo=2,bar=3") == "foo=1,bar=3"
    assert trace_state("foo=1,foo=1") == "foo=1"


def test_a_later_version_may_carry_more_fields_and_a_bad_tracestate_is_dropped():
    found = parent({"traceparent": f"01-{TRACE_ID}-{CLIENT_SPAN}-03-more", "tracestate": "a=1,A=2"})
    assert (found.trace_id.hex(), found.span_id.hex(), found.sampled, found.trace_state) == (
        TRACE_ID, CLIENT_SPAN, True, "")
    found = parent({"traceparent": f"cc-{TRACE_ID}-{CLIENT_SPAN}-00-what-the-future-will-be-like"})
    assert (found.trace_id.hex(), found.span_id.hex(), found.sampled) == (TRACE_ID, CLIENT_SPAN, False)
    assert trace_state("a=1,,b@v=x y") == "a=1,b@v=x y" and trace_state("A=1") == ""
    assert trace_state(",".join(f"k{n}=v" for n in range(33))) == ""


def test_the_links_kept_are_bounded(memory, monkeypatch):
    monkeypatch.setattr(tracing_module, "KEEP_LINKS", 3)
    t = tracing_with(memory, trace_url="https://traces.example/{trace_id}")
    for n in range(5):
        t.begin({}, "completions", call(n)).end(row(n), None)
    assert list(t.trace_ids) == ["gen-2", "gen-3", "gen-4"]
    assert t.link("gen-0") is None and t.link("gen-4")["url"].startswith("https://traces.example/")
    t.close()


class Stuck(Memory):
    """A sender that, given a batch, says so (``entered``) and waits for ``release`` before taking it."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, body):
        self.entered.set()
        self.release.wait(10)
        return super().__call__(body)


def test_the_queue_holds_at_most_max_queue_size_spans_and_counts_the_rest(caplog):
    memory = Stuck()
    entered, release = memory.entered, memory.release
    t = tracing_with(memory, max_queue_size=4)
    for n in range(4):  # a full batch: the queue's thread takes it and is stuck exporting it
        t.processor.add(one_span(f"s{n}"))
    assert entered.wait(5)
    for n in range(10):
        t.processor.add(one_span(f"late{n}"))
    assert t.processor.queued() == 4 and t.exporter.dropped == 6
    assert [r.getMessage() for r in caplog.records if "span(s) dropped" in r.getMessage()] == [
        "tracing: 1 span(s) dropped, http://127.0.0.1:4318/v1/traces does not take them (the queue of spans to "
        "send is full (4)); 1 dropped in all. Requests are not affected; this is said at most once a minute"]
    release.set()
    t.close()
    assert len(memory.spans) == 8  # the first batch and the last four queued
    assert [s["name"] for s in memory.spans[4:]] == [f"late{n}" for n in range(6, 10)]  # the oldest went


def test_a_requests_spans_queued_at_once_keep_the_bound_and_fill_batches():
    memory = Stuck()
    entered, release = memory.entered, memory.release
    t = tracing_with(memory, max_queue_size=4)
    t.processor.add_all([one_span(f"s{n}") for n in range(4)])  # a full batch wakes the thread, stuck with it
    assert entered.wait(5)
    t.processor.add_all([one_span(f"late{n}") for n in range(3)])  # room for them all: queued in one step
    t.processor.add_all([one_span(f"later{n}") for n in range(3)])  # room for one: the oldest two go
    assert t.processor.queued() == 4 and t.exporter.dropped == 2
    release.set()
    t.close()
    assert [s["name"] for s in memory.spans[4:]] == ["late2", "later0", "later1", "later2"]


def test_a_float_event_is_packed_as_event_encodes_it():
    first_token = wire.FloatEvent("gen_ai.first_token", "kilnproxy.ttft_ms")
    for value in (0.0, 12.345, -1e300, 7):  # an int: as event() writes it
        assert first_token.encode(1234567890, value) == wire.event("gen_ai.first_token", 1234567890,
                                                                   {"kilnproxy.ttft_ms": value})


def test_a_queue_that_stays_full_while_exports_succeed_is_said_once_a_minute(caplog):
    caplog.set_level(logging.WARNING, "kilnproxy")
    now = [1000.0]
    quiet = QuietExporter(Memory(), "http://collector:4318/v1/traces", clock=lambda: now[0])
    for _ in range(50):  # spans made faster than sent: each export succeeds, the queue overflows again
        quiet.drop(1, "the queue of spans to send is full (4)", failed=False)
        assert quiet.export(b"", 4) is True
        now[0] += 1
    lines = [r.getMessage() for r in caplog.records if r.name == "kilnproxy"]
    assert len(lines) == 1 and lines[0].startswith("tracing: 1 span(s) dropped")
    now[0] += 11  # a minute after the first line
    quiet.drop(1, "the queue of spans to send is full (4)", failed=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "kilnproxy"]
    assert len(lines) == 2 and lines[1].startswith("tracing: 50 span(s) dropped") and "51 dropped in all" in lines[1]
    assert (quiet.exported, quiet.dropped) == (200, 51)


class Failing:
    def __init__(self):
        self.ok = False

    def __call__(self, body):
        if not self.ok:
            raise ExportFailed("ConnectionRefusedError: [Errno 111] Connection refused")


def test_failed_exports_are_reported_once_a_minute_and_the_recovery_once(caplog):
    caplog.set_level(logging.WARNING, "kilnproxy")
    now = [1000.0]
    inner = Failing()
    quiet = QuietExporter(inner, "http://collector:4318/v1/traces", clock=lambda: now[0])

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "kilnproxy"]

    for _ in range(3):  # three batches in half a minute: one line
        assert quiet.export(b"", 5) is False
        now[0] += 10
    assert len(lines()) == 1 and lines()[0].startswith("tracing: 5 span(s) dropped, http://collector:4318")
    assert "(ConnectionRefusedError: [Errno 111] Connection refused)" in lines()[0]
    now[0] += 35  # a minute after the first line: the next one counts what was dropped since
    quiet.export(b"", 2)
    assert len(lines()) == 2 and lines()[1].startswith("tracing: 12 span(s) dropped") and "17 dropped in all" \
        in lines()[1]
    quiet.export(b"", 1)
    inner.ok = True
    assert quiet.export(b"", 4) is True
    assert lines()[2] == "tracing: spans reach http://collector:4318/v1/traces again (1 more dropped since the " \
                         "last report)"
    quiet.export(b"", 1)
    assert len(lines()) == 3 and (quiet.exported, quiet.dropped, quiet.failed_exports) == (5, 18, 5)
    inner.ok = False
    quiet.export(b"", 1)  # failing again: said at once
    assert len(lines()) == 4


def test_an_exporter_that_raises_drops_its_batch():
    def raising(body):
        raise RuntimeError("boom")

    quiet = QuietExporter(raising, "http://collector/v1/traces")
    assert quiet.export(b"", 1) is False and quiet.dropped == 1


@pytest.fixture
def collector():
    """A plain HTTP server answering each POST with the next of ``answers`` (200 when none is left)."""
    got, answers = [], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append((self.path, dict(self.headers), self.rfile.read(int(self.headers["Content-Length"]))))
            status = answers.pop(0) if answers else 200
            self.send_response(status)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"nope")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_port}/v1/traces", got=got, answers=answers)
    server.shutdown()
    server.server_close()


def test_the_sender_posts_protobuf_with_the_headers_and_retries_a_503(collector):
    send = OtlpHttp(collector.url, {"x-api-key": "s3cret"}, 5.0, threading.Event())
    collector.answers.extend([503])
    started = time.monotonic()
    send(b"batch")
    assert 0.7 < time.monotonic() - started < 3  # one retry, after about a second
    assert [(path, body) for path, _, body in collector.got] == [("/v1/traces", b"batch")] * 2
    headers = collector.got[0][1]
    assert headers["Content-Type"] == "application/x-protobuf" and headers["x-api-key"] == "s3cret"
    collector.answers.extend([400])
    with pytest.raises(ExportFailed, match="HTTP 400: nope"):  # not retried
        send(b"bad")
    assert len(collector.got) == 3
    send.close()


def test_the_sender_gives_up_within_its_timeout_and_at_once_when_stopping(collector):
    stopping = threading.Event()
    send = OtlpHttp(collector.url, {}, 1.5, stopping)
    collector.answers.extend([503] * 10)
    started = time.monotonic()
    with pytest.raises(ExportFailed, match="HTTP 503"):
        send(b"x")
    assert time.monotonic() - started < 2.5 and len(collector.got) == 2  # a retry after ~1 s; not after 2 more
    stopping.set()
    with pytest.raises(ExportFailed):
        send(b"x")
    assert len(collector.got) == 3


def test_the_resource_is_the_services_with_otel_resource_attributes(monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod, team=ml%20ops,service.name=not-this")
    found = tracing_module.resource("gw")
    assert found["service.name"] == "gw" and found["deployment.environment"] == "prod" and found["team"] == "ml ops"
    assert found["telemetry.sdk.language"] == "python"


def test_an_upstreams_error_code_is_held_as_the_usage_row_holds_text(memory):
    """An upstream's error code is the row's ``error_code``, and an upstream may make it of what the client
    sent: the span's ``error.type`` and status hold its first 255 characters and "…", a NUL as U+FFFD."""
    from kilnproxy.ops.tracing import request_trace
    from kilnproxy.proxy.request_record import MAX_ROW_TEXT
    t = tracing_with(memory)
    for n, code in enumerate(("c" * 100_000, "a\x00b")):
        trace = t.begin({}, "completions", call(n))
        trace.end(row(n, status=502, error_code=code), None)
    spans = [s for s in finished(t, memory) if s["name"] == "text_completion"]
    shown = ["c" * (MAX_ROW_TEXT - 1) + "…", "a\ufffdb"]
    assert [s["attributes"]["error.type"] for s in spans] == shown
    assert [s["status_message"] for s in spans] == shown
    assert max(len(v) for v in request_trace._ERROR_TYPE.seen) <= MAX_ROW_TEXT
    t.close()


def test_the_rows_of_each_commit_end_their_spans_once_committed_in_any_order(memory):
    """A request's usage-commit span ends at its row's commit, and its spans are queued once its task has run:
    commits of one row or several, in the order submitted or not."""
    t = tracing_with(memory)
    loop = asyncio.new_event_loop()
    try:
        async def traced(n: int) -> tuple:
            trace = t.begin({}, "completions", call(n))
            trace.model("m")
            trace.end(row(n), committed := loop.create_future())
            return trace, committed

        async def run() -> None:
            pending = [await traced(n) for n in range(6)]
            order = [[0], [2, 1], [3, 4, 5]]  # the second commit writes a later row before an earlier one
            for group in order:
                for n in group:
                    pending[n][1].set_result(None)
                for _ in range(3):  # the commit's callback, then the encoding after the woken tasks
                    await asyncio.sleep(0)
                done = {m for g in order[:order.index(group) + 1] for m in g}
                assert t.processor.queued() == 2 * len(done)  # the request's span and its usage commit's
                assert all(pending[m][0].committed_at >= pending[m][0].ending for m in done)
            assert t.waiting == [] and t.watched is None

        loop.run_until_complete(run())
    finally:
        loop.close()
    spans = finished(t, memory)
    assert sorted(s["name"] for s in spans) == ["kilnproxy.usage_commit"] * 6 + ["text_completion m"] * 6
    t.close()
