"""OpenTelemetry traces: spans sent over OTLP/HTTP to a real receiver, the client's traceparent
continued and passed on to the upstream."""

import asyncio
import logging
import re

import pytest
from aiohttp import web
from closed_ports import refused_port
from otlp_receiver import Receiver

from kilnproxy.answers import Answer
from kilnproxy.testing import MODEL

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT, INTERNAL = 2, 3, 1  # the protobuf's SpanKind numbers
ERROR = 2  # Status.STATUS_CODE_ERROR


@pytest.fixture
async def receiver():
    r = await Receiver().start()
    yield r
    await r.stop()


def traced(receiver, **tracing):
    return {"tracing": {"enabled": True, "endpoint": receiver.url, "service_name": "gw-test", **tracing}}


async def test_a_streamed_chat_request_is_one_span_tree_continuing_the_clients_trace(harness, receiver):
    async with harness(overrides=traced(receiver)) as h:
        resp = await h.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=1"})
        assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
        generation = resp.headers["X-Neocloud-Generation-Id"]
        sent = (await h.mock_requests())[-1]["headers"]
        row = (await h.rows())[0]
    # the gateway has stopped: its last spans are sent
    request = receiver.named(f"chat {MODEL}")
    assert len(request) == 1 and len(receiver.spans) == 5
    root = request[0]
    assert (root["trace_id"], root["parent_span_id"], root["kind"]) == (TRACE_ID, CLIENT_SPAN, SERVER)
    assert (root["service"], root["scope"]) == ("gw-test", "kilnproxy")
    assert root["attributes"] == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": MODEL, "gen_ai.response.model": MODEL,
        "gen_ai.usage.input_tokens": row["prompt_tokens"], "gen_ai.usage.output_tokens": 3,
        "kilnproxy.org": "acme", "kilnproxy.generation_id": generation, "kilnproxy.cost_usd": row["cost"],
        "http.response.status_code": 200, "kilnproxy.disconnected": False}
    assert root["events"] == [("gen_ai.first_token", {"kilnproxy.ttft_ms": row["ttft_ms"]})]
    children = {s["name"]: s for s in receiver.spans if s is not root}
    assert sorted(children) == ["kilnproxy.admission", "kilnproxy.stream", "kilnproxy.upstream",
                                "kilnproxy.usage_commit"]
    assert all((s["trace_id"], s["parent_span_id"]) == (TRACE_ID, root["span_id"]) for s in children.values())
    upstream = children["kilnproxy.upstream"]
    assert upstream["kind"] == CLIENT
    assert upstream["attributes"] == {"server.address": f"{h.mock_url}/v1", "http.response.status_code": 200}
    assert children["kilnproxy.stream"]["attributes"] == {"kilnproxy.disconnected": False}
    # the model server is asked as part of the same trace, under the upstream span
    assert sent["traceparent"] == f"00-{TRACE_ID}-{upstream['span_id']}-01"
    assert sent["tracestate"] == "vendor=1"


async def test_a_malformed_traceparent_is_ignored_and_a_new_trace_begins(harness, receiver):
    async with harness(overrides=traced(receiver)) as h:
        resp = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            headers={"traceparent": "00-not-a-trace-01"})
        assert resp.status == 200
        sent = (await h.mock_requests())[-1]["headers"]
    root = receiver.named(f"text_completion {MODEL}")[0]
    assert root["parent_span_id"] == "" and len(root["trace_id"]) == 32 and root["trace_id"] != "0" * 32
    assert sent["traceparent"].startswith(f"00-{root['trace_id']}-")
    assert [s["name"] for s in receiver.spans if s["name"] == "kilnproxy.stream"] == []


async def test_failover_shows_each_upstream_attempt(harness, receiver):
    dead = f"http://127.0.0.1:{refused_port()}/v1"

    def two_upstreams(config):
        model = config["models"][0]
        model["upstreams"] = [dead, model["upstreams"][0]]

    async with harness(overrides=traced(receiver), configure=two_upstreams) as h:
        h.gw.routes[MODEL]._turn = len(h.gw.routes[MODEL].upstreams) - 1  # the dead one is tried first
        resp = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert resp.status == 200
    root = receiver.named(f"text_completion {MODEL}")[0]
    attempts = receiver.named("kilnproxy.upstream")
    assert [a["attributes"]["server.address"] for a in attempts] == [dead, f"{h.mock_url}/v1"]
    assert attempts[0]["attributes"]["error.type"] == "ClientConnectorError" and attempts[0]["status"] == ERROR
    assert attempts[1]["attributes"]["http.response.status_code"] == 200
    assert all(a["parent_span_id"] == root["span_id"] for a in attempts)


async def test_an_error_is_the_spans_status_and_error_type(harness, receiver):
    async with harness(overrides=traced(receiver)) as h:
        resp = await h.post("/v1/completions", json={
            "model": MODEL, "prompt": "hi", "max_tokens": 2, "mock": {"fail": "503"}})
        assert resp.status == 502
    root = receiver.named(f"text_completion {MODEL}")[0]
    assert root["attributes"]["error.type"] == "upstream_error" and root["status"] == ERROR
    assert root["attributes"]["http.response.status_code"] == 502


async def test_tracing_off_gives_the_gateway_no_tracer(gw):
    assert gw.gw.tracer is None


async def test_a_stream_the_client_leaves_ends_its_spans_with_the_disconnect(harness, receiver, eventually):
    async with harness(overrides=traced(receiver)) as h:
        resp = await h.post("/v1/completions", json={
            "model": MODEL, "prompt": "hi", "max_tokens": 200, "stream": True, "mock": {"delay": 0.05}})
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()  # the client leaves mid-stream
        await eventually(lambda: h.rows())
    root = receiver.named(f"text_completion {MODEL}")[0]
    assert root["attributes"]["kilnproxy.disconnected"] is True
    assert receiver.named("kilnproxy.stream")[0]["attributes"] == {"kilnproxy.disconnected": True}


async def test_an_unreachable_endpoint_costs_requests_nothing_and_is_said_once_a_minute(harness, caplog):
    dead = f"http://127.0.0.1:{refused_port()}/v1/traces"  # nothing listens: every export is refused
    tracing = {"enabled": True, "endpoint": dead, "timeout": 2, "max_queue_size": 40}
    caplog.set_level(logging.INFO)
    async with harness(overrides={"tracing": tracing}) as h:
        tracer = h.gw.tracer
        assert tracer.processor.max_queue_size == 40  # the queue of encoded spans: memory bounded
        sent, loop = 0, asyncio.get_running_loop()
        give_up = loop.time() + 20
        # at least 15 x 8 requests of 4 spans each (far more than the queue holds), and on until two batches
        # were refused (a refused export takes a second: one retry): a batch is taken only when the queue
        # fills, so spans must keep coming
        while sent < 120 or tracer.exporter.failed_exports < 2:
            assert loop.time() < give_up, "fewer than two exports failed in 20 s"
            answers = await asyncio.gather(*(h.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2}) for _ in range(8)))
            assert [r.status for r in answers] == [200] * 8
            assert tracer.processor.queued() <= 40
            sent += 8
        async with h.session.get(f"{h.url}/metrics") as r:
            exposed = await r.text()
        assert "kilnproxy_trace_spans_exported_total 0.0" in exposed
        dropped = float(re.search(r"^kilnproxy_trace_spans_dropped_total (\S+)$", exposed, re.M)[1])
        assert 0 < dropped <= tracer.exporter.dropped
        rows = await h.rows()
    assert len(rows) == sent and all(r["status"] == 200 for r in rows)
    assert max(r["duration_ms"] for r in rows) < 2000  # no request waited for an export (timeout: 2 s)
    assert tracer.exporter.exported == 0 and tracer.exporter.dropped >= 40
    lines = [r.getMessage() for r in caplog.records if "span(s) dropped" in r.getMessage()]
    assert len(lines) == 1, lines
    assert dead in lines[0] and "at most once a minute" in lines[0]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == []


async def test_the_inspector_links_a_request_to_its_trace(harness, receiver):
    url = "https://grafana.example/explore?left={\"queries\":[{\"query\":\"{trace_id}\"}]}"
    async with harness(overrides=traced(receiver, trace_url=url)) as h:
        resp = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        generation = resp.headers["X-Neocloud-Generation-Id"]
        async with h.session.get(f"{h.url}/ui/api/requests/{generation}") as r:
            detail = await r.json()
        # not sampled by the client: no trace to link to
        resp = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"})
        async with h.session.get(f"{h.url}/ui/api/requests/{resp.headers['X-Neocloud-Generation-Id']}") as r:
            unsampled = await r.json()
        row_columns = set((await h.rows())[0])
    assert detail["trace"] == {"trace_id": TRACE_ID,
                               "url": url.replace("{trace_id}", TRACE_ID)}
    assert detail["row"]["id"] == generation and unsampled["trace"] is None
    assert "trace_id" not in row_columns  # the usage table is unchanged
    assert receiver.named(f"text_completion {MODEL}")[0]["trace_id"] == TRACE_ID


async def test_without_a_trace_url_there_is_no_link(harness, receiver):
    async with harness(overrides=traced(receiver)) as h:
        resp = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        async with h.session.get(f"{h.url}/ui/api/requests/{resp.headers['X-Neocloud-Generation-Id']}") as r:
            assert (await r.json())["trace"] is None
        assert h.gw.tracer.trace_ids is None  # nothing is kept per request


async def test_a_requests_spans_are_encoded_after_its_answer_is_written(harness, receiver, monkeypatch):
    """The commit wakes the request (to write its answer, or ``[DONE]``) and ends its spans: the answer
    goes first, so that tracing adds nothing to the answer's latency."""
    order = []
    for cls in (Answer, web.StreamResponse):
        def patched(original):
            async def write_eof(self, data=b""):
                await original(self, data)
                if "X-Neocloud-Generation-Id" in self.headers and ("answer", id(self)) not in order:  # the gateway's
                    order.append(("answer", id(self)))
            return write_eof
        monkeypatch.setattr(cls, "write_eof", patched(cls.write_eof))
    async with harness(overrides=traced(receiver)) as h:
        add_all = h.gw.tracer.add_all
        h.gw.tracer.add_all = lambda spans: (order.append(("spans", len(spans))), add_all(spans))
        for stream in (False, True):
            resp = await h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                         "stream": stream})
            assert resp.status == 200
            await resp.read()
    assert [kind for kind, _ in order] == ["answer", "spans", "answer", "spans"]
    assert [n for kind, n in order if kind == "spans"] == [4, 5]  # the request's and its children


async def test_a_span_holds_the_model_a_client_names_as_the_usage_row_does(harness, receiver):
    """A client can name any model, of any length (up to the body's limit), with control characters: the
    span's name and its model attributes hold what the usage row holds (its first 255 characters and "…",
    a NUL as U+FFFD), and the tracer's tables of recent values do not keep the long text."""
    from kilnproxy.ops.tracing import otlp_wire
    from kilnproxy.ops.tracing import request_trace
    from kilnproxy.proxy.request_record import MAX_ROW_TEXT
    sent = {"long": "m" * 1_000_000, "not ascii": "a" + "é" * MAX_ROW_TEXT,
            "controls": "\x00\x1b[2J\u2028" + "\U0001f600" * MAX_ROW_TEXT}
    shown = {"long": "m" * (MAX_ROW_TEXT - 1) + "…", "not ascii": "a" + "é" * (MAX_ROW_TEXT - 2) + "…",
             "controls": "\ufffd\x1b[2J\u2028" + "\U0001f600" * (MAX_ROW_TEXT - 7) + "…"}
    async with harness(overrides=traced(receiver)) as h:
        for name, model in sent.items():
            async with h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}) as resp:
                assert resp.status == 404, name
        assert [r["model"] for r in await h.rows()] == list(shown.values())
        kept = [k[1] for k in request_trace._MODELS] + list(otlp_wire.NAME_FIELDS)
        assert max(len(v) for v in kept) <= MAX_ROW_TEXT + len("text_completion ")
    roots = [s for s in receiver.spans if s["name"].startswith("text_completion ")]
    assert [r["attributes"]["gen_ai.request.model"] for r in roots] == list(shown.values())
    assert [r["attributes"]["gen_ai.response.model"] for r in roots] == list(shown.values())
    assert [r["name"] for r in roots] == [f"text_completion {v}" for v in shown.values()]
    assert all(r["attributes"]["error.type"] == "model_not_found" for r in roots)


async def test_the_upstream_gets_one_valid_traceparent_whatever_the_client_sent(harness, receiver):
    """The W3C Trace Context rules at the edges, through the gateway: what continues the client's trace, what
    starts a new one, what tracestate goes on."""
    from multidict import CIMultiDict
    good = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    long_member = "big=" + "x" * 200
    cases = [  # the client's trace context; whether its trace goes on; the tracestate sent upstream
        ([("traceparent", f"ff-{TRACE_ID}-{CLIENT_SPAN}-01")], False, None),
        ([("traceparent", f"01-{TRACE_ID}-{CLIENT_SPAN}-01-what-the-future-will-be")], True, None),
        ([("traceparent", f"cc-{TRACE_ID}-{CLIENT_SPAN}-01.what")], False, None),
        ([("traceparent", f"00-{'0' * 32}-{CLIENT_SPAN}-01")], False, None),
        ([("traceparent", f"00-{TRACE_ID}-{'0' * 16}-01")], False, None),
        ([("traceparent", f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01")], False, None),
        ([("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01-extra"), ("tracestate", "vendor=1")], False, None),
        ([("traceparent", good), ("traceparent", good)], False, None),
        ([("traceparent", good), ("tracestate", ",".join(f"k{n}=v" for n in range(33)))], True, None),
        ([("traceparent", good), ("tracestate", "a=1,B=2")], True, None),
        ([("traceparent", good), ("tracestate", "a=1"), ("tracestate", "b=2")], True, "a=1,b=2"),
        # over 512 characters: whole members left out, the right-most long one first
        ([("traceparent", good), ("tracestate", f"a=1,{long_member},bog={'x' * 200},c={'y' * 250}")], True,
         f"a=1,{long_member},bog={'x' * 200}"),
        ([("traceparent", good), ("tracestate", f"a=1,{long_member},bog={'x' * 200},bug={'x' * 200},b=2,c=3")], True,
         f"a=1,{long_member},bog={'x' * 200},b=2,c=3"),
        ([("traceparent", good), ("tracestate", ",".join(f"k{n:02d}={'v' * 60}" for n in range(10)))], True,
         ",".join(f"k{n:02d}={'v' * 60}" for n in range(7))),
    ]
    async with harness(overrides=traced(receiver)) as h:
        for fields, continued, state in cases:
            async with h.session.post(f"{h.url}/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                                       "max_tokens": 1},
                                      headers=CIMultiDict([*h.headers().items(), *fields])) as resp:
                assert resp.status == 200, fields
            sent = (await h.mock_requests())[-1]["headers"]
            found = re.fullmatch(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01", sent["traceparent"])
            assert found and found[1] != "0" * 32 and found[2] != "0" * 16, fields
            assert (found[1] == TRACE_ID) is continued, fields
            assert sent.get("tracestate") == state, fields
