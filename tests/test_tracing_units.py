"""The tracing parts on their own, with the OpenTelemetry SDK's in-memory exporter: sampling, the
inspector's links, the bounded queue and the once-a-minute report of dropped spans."""

import logging
import threading
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kilnproxy.config_types import TracingConfig
from kilnproxy.ops import tracing as tracing_module
from kilnproxy.ops.trace_export import QuietExporter
from kilnproxy.ops.tracing import Tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def call(n: int = 0):
    return SimpleNamespace(org="acme", generation_id=f"gen-{n}")


def row(n: int = 0, **extra):
    return {"id": f"gen-{n}", "model": "m", "prompt_tokens": 3, "completion_tokens": 2, "cost": 0.5, "status": 200,
            "disconnected": 0, "error_code": None, **extra}


@pytest.fixture
def memory():
    return InMemorySpanExporter()


def tracing_with(memory, **config) -> Tracing:
    return Tracing(TracingConfig(enabled=True, **config), exporter=memory)


def finished(t: Tracing, memory) -> list:
    t.processor.force_flush()
    return memory.get_finished_spans()


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
    trace.end(row(), None)
    spans = {s.name: s for s in finished(t, memory)}
    assert sorted(spans) == ["chat m", "kilnproxy.admission", "kilnproxy.upstream", "kilnproxy.usage_commit"]
    assert spans["kilnproxy.upstream"].attributes["error.type"] == "503"
    root = spans["chat m"]
    assert root.attributes["gen_ai.usage.input_tokens"] == 3 and root.attributes["kilnproxy.cost_usd"] == 0.5
    assert all(s.parent.span_id == root.context.span_id for s in spans.values() if s is not root)
    t.close()


def test_sampling_follows_the_ratio_and_the_clients_flag(memory):
    t = tracing_with(memory, sample_ratio=0.0, trace_url="https://traces.example/{trace_id}")
    unsampled = t.begin({}, "completions", call(1))
    assert unsampled.trace_id is None
    unsampled.end(row(1), None)
    sampled = t.begin({"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}, "completions", call(2))
    assert sampled.trace_id == TRACE_ID
    sampled.end(row(2), None)
    assert {s.context.trace_id for s in finished(t, memory)} == {int(TRACE_ID, 16)}
    assert t.link("gen-1") is None
    assert t.link("gen-2") == {"trace_id": TRACE_ID, "url": f"https://traces.example/{TRACE_ID}"}
    t.close()


def test_the_links_kept_are_bounded(memory, monkeypatch):
    monkeypatch.setattr(tracing_module, "KEEP_LINKS", 3)
    t = tracing_with(memory, trace_url="https://traces.example/{trace_id}")
    for n in range(5):
        t.begin({}, "completions", call(n)).end(row(n), None)
    assert list(t.trace_ids) == ["gen-2", "gen-3", "gen-4"]
    assert t.link("gen-0") is None and t.link("gen-4")["url"].startswith("https://traces.example/")
    t.close()


def test_the_queue_holds_at_most_max_queue_size_spans_and_counts_the_rest(caplog):
    entered, release = threading.Event(), threading.Event()

    class Stuck(InMemorySpanExporter):
        def export(self, spans):
            entered.set()
            release.wait(10)
            return super().export(spans)

    memory = Stuck()
    t = tracing_with(memory, max_queue_size=4)
    for n in range(4):  # a full batch: the processor's thread takes it and is stuck exporting it
        t.tracer.start_span(f"s{n}").end()
    assert entered.wait(5)
    for n in range(10):
        t.tracer.start_span(f"late{n}").end()
    assert t.processor.queued() == 4 and t.exporter.dropped == 6
    assert [r.getMessage() for r in caplog.records if "span(s) dropped" in r.getMessage()] == [
        "tracing: 1 span(s) dropped, http://127.0.0.1:4318/v1/traces does not take them (the queue of spans to "
        "send is full (4)); 1 dropped in all. Requests are not affected; this is said at most once a minute"]
    release.set()
    t.close()
    assert len(memory.get_finished_spans()) == 8  # the first batch and the last four queued


class Failing:
    def __init__(self):
        self.ok = False

    def export(self, spans):
        return SpanExportResult.SUCCESS if self.ok else SpanExportResult.FAILURE

    def shutdown(self):
        pass


def test_failed_exports_are_reported_once_a_minute_and_the_recovery_once(caplog):
    caplog.set_level(logging.WARNING, "kilnproxy")
    now = [1000.0]
    inner = Failing()
    quiet = QuietExporter(inner, "http://collector:4318/v1/traces", clock=lambda: now[0])

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "kilnproxy"]

    for _ in range(3):  # three batches in half a minute: one line
        assert quiet.export([object()] * 5) is SpanExportResult.FAILURE
        now[0] += 10
    assert len(lines()) == 1 and lines()[0].startswith("tracing: 5 span(s) dropped, http://collector:4318")
    now[0] += 35  # a minute after the first line: the next one counts what was dropped since
    quiet.export([object()] * 2)
    assert len(lines()) == 2 and lines()[1].startswith("tracing: 12 span(s) dropped") and "17 dropped in all" \
        in lines()[1]
    quiet.export([object()])
    inner.ok = True
    assert quiet.export([object()] * 4) is SpanExportResult.SUCCESS
    assert lines()[2] == "tracing: spans reach http://collector:4318/v1/traces again (1 more dropped since the " \
                         "last report)"
    quiet.export([object()])
    assert len(lines()) == 3 and (quiet.exported, quiet.dropped, quiet.failed_exports) == (5, 18, 5)
    inner.ok = False
    quiet.export([object()])  # failing again: said at once
    assert len(lines()) == 4


def test_an_exporter_that_raises_drops_its_batch():
    class Raising(Failing):
        def export(self, spans):
            raise RuntimeError("boom")

    quiet = QuietExporter(Raising(), "http://collector/v1/traces")
    assert quiet.export([object()]) is SpanExportResult.FAILURE and quiet.dropped == 1
