"""The inspector's JSON API, page files, access rule and live feed, through a real gateway."""

import asyncio
import base64
import json

import aiohttp
import orjson
import pytest

from kilnproxy.access import loopback_host as _loopback_host
from kilnproxy.access import loopback_peer as _loopback_peer
from kilnproxy.inspector.hub import QUEUE_SIZE, RESET, LiveHub
from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import OTHER_KEY, UPSTREAM_MODEL
from kilnproxy.usage import COLUMNS

CAPTURE = {"inspector": {"capture": True}}

PLUGIN = '''
from kilnproxy import hookimpl

@hookimpl
def rewrite_request(body):
    body["temperature"] = 0.5

@hookimpl
def transform_event(event):
    for choice in event.get("choices") or []:
        choice["text"] = choice["text"].upper()
'''


async def get(h, path, **kwargs):
    async with h.session.get(f"{h.url}{path}", allow_redirects=False, **kwargs) as resp:
        body = await resp.read()
        return resp.status, resp.headers, body


async def get_json(h, path, status=200, **kwargs):
    got, _, body = await get(h, path, **kwargs)
    assert got == status, body
    return orjson.loads(body)


async def complete(h, key=None, **body):
    async with h.post("/v1/completions", {"model": h.model, "prompt": "The capital of France is",
                                          "max_tokens": 4, **body}, key=key) as resp:
        await resp.read()
        return resp.headers["X-Neocloud-Generation-Id"]


# -- the page and the access rule ----------------------------------------------------


async def test_page_and_its_files_are_served(gw):
    status, headers, _ = await get(gw, "/ui")
    assert (status, headers["Location"]) == (302, "/ui/")
    status, headers, body = await get(gw, "/ui/")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert b'<script src="/ui/static/app.js" defer></script>' in body
    status, headers, body = await get(gw, "/ui/static/vendor/chart.umd.min.js")
    assert status == 200 and body.startswith(b"/*!\n * Chart.js v4.6.1")
    status, _, body = await get(gw, "/ui/static/vendor/chart.umd.min.js", headers={"If-None-Match": headers["ETag"]})
    assert (status, body) == (304, b"")
    status, _, body = await get(gw, "/ui/static/../../config.py")
    assert status == 404 and orjson.loads(body)["error"]["code"] == "not_found"


async def test_loopback_only_refuses_a_foreign_host_header(gw):
    """Without a token, a page elsewhere that rebinds its name to 127.0.0.1 is still refused."""
    body = await get_json(gw, "/ui/api/meta", 403, headers={"Host": "evil.example"})
    assert body["error"]["code"] == "forbidden"
    assert (await get(gw, "/ui/", headers={"Host": "evil.example"}))[0] == 403
    meta = await get_json(gw, "/ui/api/meta", headers={"Host": "localhost:8080"})
    assert meta == {"orgs": ["acme", "globex"], "models": ["test-model"], "capture": False,
                    "capture_requests": 100, "capture_bytes": 1048576}


@pytest.mark.parametrize("remote, loopback", [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
                                              ("10.0.0.5", False), ("192.168.1.20", False), (None, False)])
def test_only_loopback_peers_count_as_local(remote, loopback):
    assert _loopback_peer(remote) is loopback


@pytest.mark.parametrize("host, loopback", [("localhost", True), ("localhost:8080", True), ("[::1]:8080", True),
                                            ("127.0.0.1:8080", True), ("ui.localhost:1", True),
                                            ("evil.example", False), ("127.0.0.1.nip.io:80", False)])
def test_only_loopback_host_headers_count_as_local(host, loopback):
    assert _loopback_host(host) is loopback


async def test_a_token_guards_the_api_from_every_address(harness):
    async with harness(overrides={"inspector": {"token": "s3cret"}}) as h:
        body = await get_json(h, "/ui/api/requests", 401)
        assert body["error"]["code"] == "invalid_token"
        await get_json(h, "/ui/api/requests", 401, headers={"Authorization": "Bearer nope"})
        await get_json(h, "/ui/api/requests", headers={"Authorization": "Bearer s3cret", "Host": "gw.example"})
        await get_json(h, "/ui/api/requests?token=s3cret")
        assert (await get(h, "/ui/", headers={"Host": "gw.example"}))[0] == 200  # the page holds no data


async def test_disabled_inspector_serves_nothing(harness):
    async with harness(overrides={"inspector": {"enabled": False, "capture": True}}) as h:
        assert (await get(h, "/ui/"))[0] == 404
        assert (await get(h, "/ui/api/requests"))[0] == 404
        assert h.app[GATEWAY].capture is None


# -- the requests list ----------------------------------------------------------------


async def test_requests_newest_first_with_filters(any_gw):
    ids = [await complete(any_gw, stream=True), await complete(any_gw, stream=True),
           await complete(any_gw, key=OTHER_KEY), await complete(any_gw, model="no-such-model")]
    page = await get_json(any_gw, "/ui/api/requests")
    assert [r["id"] for r in page["data"]] == ids[::-1] and page["next"] is None
    assert all(list(r) == [*COLUMNS, "captured"] for r in page["data"])  # no store's own columns
    first = page["data"][-1]
    assert first["org"] == "acme" and first["stream"] == 1 and first["status"] == 200
    assert first["completion_tokens"] == 4 and first["captured"] is False

    async def ids_for(query):
        return [r["id"] for r in (await get_json(any_gw, f"/ui/api/requests?{query}"))["data"]]

    assert await ids_for("org=globex") == [ids[2]]
    assert await ids_for("model=test-model&org=acme") == [ids[1], ids[0]]
    assert await ids_for("model=no-such-model") == [ids[3]]
    assert await ids_for("status=404") == [ids[3]]
    assert await ids_for("status=error") == [ids[3]]
    assert await ids_for("status=ok") == ids[2::-1]
    assert await ids_for("status=429") == []


async def test_requests_pages_follow_the_cursor(any_gw):
    ids = [await complete(any_gw) for _ in range(5)]
    seen, cursor, pages = [], "", 0
    while True:
        page = await get_json(any_gw, f"/ui/api/requests?limit=2&before={cursor}")
        seen += [r["id"] for r in page["data"]]
        pages += 1
        if page["next"] is None:
            break
        cursor = page["next"]
    assert seen == ids[::-1] and pages == 3


def cursor_for(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=abc", "limit"), ("limit=501", "limit"),
                                          ("status=abc", "status"), ("status=999", "status"),
                                          ("before=garbage", "before"),
                                          ("before=" + cursor_for("x~9223372036854775808"), "before"),
                                          ("before=" + cursor_for(f"2026-12-01T06:02:28.730+00:00~{'9' * 20}"),
                                           "before")])
async def test_bad_list_parameters_get_400(gw, query, param):
    body = await get_json(gw, f"/ui/api/requests?{query}", 400)
    assert body["error"]["code"] == "invalid_request" and body["error"]["param"] == param


# -- one request ------------------------------------------------------------------------


async def test_detail_shows_both_bodies_and_both_streams(harness, store, tmp_path):
    plugin = tmp_path / "shout.py"
    plugin.write_text(PLUGIN)
    async with harness(overrides={**CAPTURE, **store}, plugins=[str(plugin)]) as h:
        sent = {"model": h.model, "prompt": "The capital of France is", "max_tokens": 4, "stream": True,
                "mock": {"delay": 0.01}}
        async with h.post("/v1/completions", sent) as resp:
            assert resp.status == 200
            await resp.read()
            gen = resp.headers["X-Neocloud-Generation-Id"]
        detail = await get_json(h, f"/ui/api/requests/{gen}")
    row, cap = detail["row"], detail["capture"]
    assert detail["in_flight"] is False and row["id"] == gen and row["completion_tokens"] == 4
    assert json.loads(cap["client_body"]) == sent
    assert json.loads(cap["upstream_body"]) == {**sent, "model": UPSTREAM_MODEL, "temperature": 0.5,
                                                "stream_options": {"include_usage": True}}
    upstream = [e["data"] for e in cap["upstream_events"]]
    client = [e["data"] for e in cap["client_events"]]
    texts_up = [c["text"] for d in upstream[:-1] for c in json.loads(d)["choices"]]
    texts_down = [c["text"] for d in client[:-1] for c in json.loads(d)["choices"]]
    assert texts_up == [" Paris", " is", " the", " capital", ""]
    assert texts_down == [" PARIS", " IS", " THE", " CAPITAL", ""]
    assert all(json.loads(d)["model"] == UPSTREAM_MODEL for d in upstream[:-1])
    assert all(json.loads(d)["model"] == h.model for d in client[:-1])
    assert json.loads(upstream[-2])["usage"]["completion_tokens"] == 4  # the usage chunk, kept from the client
    assert upstream[-1] == client[-1] == "[DONE]"
    times = [e["ms"] for e in cap["upstream_events"]]
    assert times == sorted(times) and times[0] > 0
    assert cap["timing"]["ttft_ms"] == row["ttft_ms"] and cap["timing"]["tokens_per_second"] > 0
    assert cap["truncated"] is False and cap["upstream_answer"] is None


async def test_detail_of_a_non_streamed_request(harness):
    async with harness(overrides=CAPTURE) as h:
        gen = await complete(h)
        cap = (await get_json(h, f"/ui/api/requests/{gen}"))["capture"]
    assert json.loads(cap["upstream_answer"])["model"] == UPSTREAM_MODEL
    answer = json.loads(cap["client_answer"])
    assert answer["model"] == "test-model" and answer["usage"]["cost"] > 0
    assert cap["upstream_events"] == cap["client_events"] == []


async def test_detail_of_a_streamed_chat(harness):
    async with harness(overrides=CAPTURE) as h:
        client = h.openai()
        stream = await client.chat.completions.create(model=h.model, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=3, stream=True)
        chunks = [c async for c in stream]
        gen = (await h.rows())[0]["id"]
        detail = await get_json(h, f"/ui/api/requests/{gen}")
    cap = detail["capture"]
    assert detail["row"]["endpoint"] == "chat/completions"
    assert json.loads(cap["client_body"])["messages"] == [{"role": "user", "content": "hi"}]
    client_events = [json.loads(e["data"]) for e in cap["client_events"][:-1]]
    assert [e["id"] for e in client_events] == [c.id for c in chunks]
    assert cap["client_events"][-1]["data"] == "[DONE]"
    # the client did not ask for usage: the upstream's usage chunk is in one stream only
    assert any(json.loads(e["data"]).get("usage") for e in cap["upstream_events"][:-1])
    assert not any(e.get("usage") for e in client_events)


async def test_detail_without_capture_has_the_row_only(any_gw):
    assert any_gw.app[GATEWAY].capture is None
    gen = await complete(any_gw, stream=True)
    detail = await get_json(any_gw, f"/ui/api/requests/{gen}")
    assert detail["row"]["id"] == gen and detail["capture"] is None
    assert detail["row"] == (await any_gw.rows(id=gen))[0] and list(detail["row"]) == list(COLUMNS)
    body = await get_json(any_gw, "/ui/api/requests/gen-000000000000000000000000", 404)
    assert body["error"]["code"] == "not_found"


async def test_capture_ring_keeps_the_last_n(harness, store):
    async with harness(overrides={"inspector": {"capture": True, "capture_requests": 2}, **store}) as h:
        ids = [await complete(h, stream=True) for _ in range(3)]
        page = await get_json(h, "/ui/api/requests")
        assert [(r["id"], r["captured"]) for r in page["data"]] == [(ids[2], True), (ids[1], True),
                                                                    (ids[0], False)]
        assert (await get_json(h, f"/ui/api/requests/{ids[0]}"))["capture"] is None


async def test_capture_stops_at_its_byte_limit(harness):
    async with harness(overrides={"inspector": {"capture": True, "capture_bytes": 300}}) as h:
        gen = await complete(h, stream=True)
        cap = (await get_json(h, f"/ui/api/requests/{gen}"))["capture"]
    assert cap["truncated"] is True and cap["bytes"] == 300
    assert json.loads(cap["client_body"])["model"] == "test-model"  # the first bytes are kept whole
    assert cap["client_events"] == []


# -- live feed --------------------------------------------------------------------------


async def read_event(resp) -> dict:
    while True:
        line = await resp.content.readline()
        assert line, "the live feed ended"
        if line.startswith(b"data: "):
            return json.loads(line[6:])


async def test_live_feed_sends_each_committed_row(harness, store):
    async with harness(overrides={**CAPTURE, **store}) as h:
        async with h.session.get(f"{h.url}/ui/api/events") as feed:
            assert feed.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            assert await read_event(feed) == {"type": "hello", "capture": True}
            gen = await complete(h, stream=True)
            started, event = await read_event(feed), await read_event(feed)
        assert started == {"type": "started", "row": {
            "id": gen, "created_at": event["row"]["created_at"], "org": "acme", "key_id": "acme-key",
            "model": "test-model", "endpoint": "completions", "captured": True}}
        assert event["type"] == "request" and event["row"]["id"] == gen
        assert event["row"]["status"] == 200 and event["row"]["captured"] is True


async def test_live_feed_without_capture_sends_rows_only(any_gw):
    async with any_gw.session.get(f"{any_gw.url}/ui/api/events") as feed:
        assert await read_event(feed) == {"type": "hello", "capture": False}
        gen = await complete(any_gw, model="no-such-model")
        event = await read_event(feed)
    assert event["type"] == "request" and event["row"]["id"] == gen
    assert (event["row"]["status"], event["row"]["captured"]) == (404, False)


async def test_live_feed_ends_when_the_gateway_stops(harness):
    """The feed ends first, so the grace period (600 s here) does not wait for an open page."""
    h = harness(overrides={"server": {"shutdown_grace_seconds": 600}})
    await h.__aenter__()
    try:
        async with aiohttp.ClientSession() as session, session.get(f"{h.url}/ui/api/events") as feed:
            assert (await read_event(feed))["type"] == "hello"
            async with asyncio.timeout(60):  # a guard, far below the grace period: fail instead of hanging
                await h.gateway.runner.shutdown()  # on_shutdown: what a stop does first (the grace period too)
                rest = await feed.content.read()
        assert rest == b"\n"  # the blank line closing the hello event, then the end of the body
    finally:
        await h.__aexit__(None, None, None)


async def test_slow_subscriber_is_reset_never_waited_for():
    hub = LiveHub()
    sub = hub.subscribe()
    rows = [({"id": f"gen-{i}", "status": 200}, None) for i in range(QUEUE_SIZE + 10)]
    hub.publish(rows)  # returns at once although nobody reads
    assert await sub.next() is RESET and sub.queue.empty()
    hub.publish([({"id": "gen-after", "status": 200}, None)])
    assert json.loads((await asyncio.wait_for(sub.next(), 5))[6:])["row"]["id"] == "gen-after"
    hub.publish([({"no id": 1}, None)])  # a bad row is logged, never raised into the ledger's writer


# -- usage --------------------------------------------------------------------------------


async def test_usage_up_to_now_counts_a_row_of_this_very_millisecond(tmp_path, monkeypatch):
    """A request answered in under a millisecond and read back at once: its row is in the span."""
    from datetime import datetime, timezone

    from kilnproxy.inspector import queries as store_module
    from kilnproxy.inspector.queries import InspectorStore
    from kilnproxy.store.sqlite.inspector_reader import SQLiteReader
    from kilnproxy.store.sqlite.ledger import SQLiteLedger
    from kilnproxy.usage import COLUMNS

    now = datetime(2026, 11, 30, 13, 4, 59, 999000, tzinfo=timezone.utc)

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return now

    ledger = SQLiteLedger(tmp_path / "usage.db")
    await ledger.open()
    row = dict.fromkeys(COLUMNS, 0)
    row.update(id="gen-now", created_at=now.isoformat(timespec="milliseconds"), org="acme", key_id="k",
               model="m", endpoint="completions", status=200, error_code=None, finish_reason="stop")
    await ledger.submit(row)
    await ledger.close()
    store = InspectorStore(SQLiteReader(tmp_path / "usage.db"))
    await store.open()
    try:
        monkeypatch.setattr(store_module, "datetime", Frozen)
        usage = await store.usage("minute", None, None)
    finally:
        await store.close()
    assert [(s["org"], s["requests"]) for s in usage["series"]] == [("acme", 1)]


async def test_usage_buckets_add_up_to_the_rows(any_gw):
    for key in (None, None, OTHER_KEY):
        await complete(any_gw, key=key)
    usage = await get_json(any_gw, "/ui/api/usage?bucket=minute")
    assert len(usage["buckets"]) in (60, 61)
    assert all(s["t"] in usage["buckets"] for s in usage["series"])
    by_org = {}
    for s in usage["series"]:
        by_org[s["org"]] = by_org.get(s["org"], 0) + s["requests"]
    assert by_org == {"acme": 2, "globex": 1}
    assert [(s["t"], s["org"]) for s in usage["series"]] == sorted((s["t"], s["org"]) for s in usage["series"])
    rows = await any_gw.rows()
    assert {type(s[k]) for s in usage["series"] for k in ("requests", "total_tokens", "errors")} == {int}
    assert sum(s["total_tokens"] for s in usage["series"]) == sum(r["total_tokens"] for r in rows)
    assert sum(s["cost"] for s in usage["series"]) == pytest.approx(sum(r["cost"] for r in rows))
    day = await get_json(any_gw, "/ui/api/usage?bucket=day&org=globex")
    assert [(s["org"], s["requests"]) for s in day["series"]] == [("globex", 1)]


@pytest.mark.parametrize("query, param", [("bucket=year", "bucket"), ("since=yesterday", "since"),
                                          ("since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z", "since"),
                                          ("bucket=minute&since=2020-01-01T00:00:00Z", "bucket")])
async def test_bad_usage_parameters_get_400(gw, query, param):
    body = await get_json(gw, f"/ui/api/usage?{query}", 400)
    assert body["error"]["param"] == param


@pytest.mark.parametrize("query, param", [("since=9999-12-31T23:00&until=9999-12-31T23:59:59.999999", "until"),
                                          ("until=0001-01-01T00:30", "until"),
                                          ("until=0001-01-02&bucket=day", "until"),
                                          ("since=0001-01-01T00:00%2B01:00&until=0001-01-01T05:00", "since"),
                                          ("since=9999-12-31T23:00-01:00", "since"),
                                          ("since=9999-12-31T20:00&until=9999-12-31T23:59:59-01:00", "until")])
async def test_times_at_the_ends_of_the_calendar_get_400(gw, query, param):
    body = await get_json(gw, f"/ui/api/usage?{query}", 400)
    assert body["error"]["code"] == "invalid_request" and body["error"]["param"] == param


async def test_detail_of_a_streamed_request_the_upstream_rejected(harness):
    """An upstream 400 is passed through as one answer, streamed or not, and captured as such."""
    async with harness(overrides=CAPTURE) as h:
        gen = await complete(h, stream=True, temperature=9)
        detail = await get_json(h, f"/ui/api/requests/{gen}")
    cap = detail["capture"]
    assert detail["row"]["status"] == 400
    assert cap["upstream_answer"] == cap["client_answer"]
    assert json.loads(cap["client_answer"])["error"]["message"] == "temperature must be in [0, 2], got 9."
    assert cap["upstream_events"] == cap["client_events"] == []


async def test_live_feed_to_an_http10_client_says_its_connection_ends_with_the_body(gw):
    """HTTP/1.0 has no chunked encoding: the feed's body can only end with the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
    try:
        writer.write(b"GET /ui/api/events HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n")
        async with asyncio.timeout(30):  # a guard against a hang, no timing asserted
            head = await reader.readuntil(b"\r\n\r\n")
            hello = await reader.readuntil(b"\n\n")
    finally:
        writer.close()
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.0 200 OK"
    assert "Connection: close" in lines and "Transfer-Encoding: chunked" not in lines
    assert json.loads(hello[6:]) == {"type": "hello", "capture": False}
