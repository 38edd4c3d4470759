"""The response rules (docs/reference.md) for streams: bytes on the wire, usage handling, errors, keepalive."""

import asyncio

from pathlib import Path

import orjson
import pytest
from aiohttp import web
from aiohttp.http_writer import StreamWriter
from raw_upstreams import WHOLE_MESSAGES_STREAM, WHOLE_STREAM, raw_upstream
from rawhttp import raw_server, read_request
from relays import cost

from kilnproxy.testing import MODEL, UPSTREAM_MODEL

GEN = "X-Neocloud-Generation-Id"
FIXED = {"id": "cmpl-fixed", "created": 1700000000}


def events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    return raw[:-2].split(b"\n\n")


def payloads(raw: bytes) -> list:
    out = []
    for frame in events(raw):
        assert frame.startswith(b"data: "), frame
        data = frame[6:]
        out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


async def stream_bytes(h, body, path="/v1/completions"):
    async with h.post(path, {"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert resp.headers["Cache-Control"] == "no-cache"
        assert resp.headers["X-Accel-Buffering"] == "no"
        return resp.headers[GEN], await resp.read()


async def direct_bytes(h, body, path="/v1/completions"):
    async with h.session.post(f"{h.mock_url}/v1{path[3:]}", json=body) as resp:
        return await resp.read()


async def test_events_nobody_changes_are_the_upstreams_own_bytes(harness):
    async with harness(configure=lambda c: c["models"][0].update(upstream_model=MODEL)) as h:
        body = {"prompt": "The capital of France is", "max_tokens": 5, "mock": FIXED}
        _, through = await stream_bytes(h, body)
        direct = await direct_bytes(h, {"model": MODEL, "stream": True, **body})
    assert through == direct
    assert through.endswith(b"data: [DONE]\n\n")


async def test_model_is_rewritten_to_catalog_id_in_every_chunk(gw):
    _, raw = await stream_bytes(gw, {"prompt": "a b", "max_tokens": 3, "mock": FIXED,
                                     "stream_options": {"include_usage": True}})
    chunks = payloads(raw)[:-1]
    assert [c["model"] for c in chunks] == [MODEL] * 5
    assert UPSTREAM_MODEL.encode() not in raw


async def test_usage_chunk_removed_when_client_did_not_ask(gw):
    gen, raw = await stream_bytes(gw, {"prompt": "a b", "max_tokens": 3})
    assert b'"usage"' not in raw
    assert payloads(raw)[-1] == "[DONE]"
    row = await gw.row(gen)  # still metered: include_usage was forced upstream
    assert (row["prompt_tokens"], row["completion_tokens"]) == (2, 3)
    assert row["cost"] == pytest.approx(cost(2, 3))


async def test_usage_chunk_kept_with_cost_when_asked(gw):
    gen, raw = await stream_bytes(gw, {"prompt": "a b c", "max_tokens": 4,
                                       "stream_options": {"include_usage": True}})
    items = payloads(raw)
    assert items[-1] == "[DONE]"
    usage_chunks = [i for i in items[:-1] if i.get("usage")]
    assert usage_chunks == [items[-2]]
    last = items[-2]
    assert last["choices"] == [] and last["model"] == MODEL
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "cost": cost(3, 4)}
    assert (await gw.row(gen))["cost"] == last["usage"]["cost"]


async def test_cached_tokens_passed_through_and_priced_at_cached_rate(gw):
    gen, raw = await stream_bytes(gw, {"prompt": "one two three four", "max_tokens": 2,
                                       "stream_options": {"include_usage": True}, "mock": {"cached_tokens": 3}})
    usage = payloads(raw)[-2]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 3}
    assert usage["cost"] == cost(4, 2, cached=3)
    row = await gw.row(gen)
    assert (row["cached_tokens"], row["cost"]) == (3, cost(4, 2, cached=3))


@pytest.mark.parametrize("flavor", ["vllm", "vllm_old", "llamacpp", "ollama"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("include_usage", [True, False])
async def test_every_flavor_gives_openais_usage_form(gw, flavor, path, include_usage):
    body = {"max_tokens": 3, "mock": {"flavor": flavor}}
    body.update({"prompt": "x y"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "x y"}]})
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    gen, raw = await stream_bytes(gw, body, path)
    items = payloads(raw)
    assert items[-1] == "[DONE]"
    chunks = items[:-1]
    with_usage = [c for c in chunks if c.get("usage")]
    if include_usage:
        assert with_usage == [chunks[-1]]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        assert chunks[-1]["usage"]["cost"] > 0
    else:
        assert with_usage == []
    assert all(c["choices"] for c in chunks[:len(chunks) - include_usage])
    row = await gw.row(gen)
    assert row["completion_tokens"] == 3 and row["finish_reason"] == "length" and row["status"] == 200


async def test_continuous_usage_stats_final_counts_win(gw):
    gen, raw = await stream_bytes(gw, {"prompt": "p q", "max_tokens": 5, "mock": {"continuous_usage": True},
                                       "stream_options": {"include_usage": True}})
    chunks = payloads(raw)[:-1]
    assert [c for c in chunks if c.get("usage")] == [chunks[-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert (await gw.row(gen))["completion_tokens"] == 5


async def test_sse_fields_other_than_data_never_reach_the_client(gw):
    _, raw = await stream_bytes(gw, {"prompt": "x", "max_tokens": 2, "mock": {"fields": True}})
    for line in raw.split(b"\n"):
        assert not line.startswith((b"event:", b"id:", b"retry:")), line
    assert payloads(raw)[-1] == "[DONE]"


@pytest.mark.parametrize("mock", [{"crlf": True}, {"split": True}, {"crlf": True, "split": True}])
async def test_crlf_and_events_split_across_reads(gw, mock):
    _, raw = await stream_bytes(gw, {"prompt": "x", "max_tokens": 4, "mock": mock,
                                     "stream_options": {"include_usage": True}})
    items = payloads(raw)
    assert "".join(c["choices"][0]["text"] for c in items[:-2]) == " Paris is the capital"
    assert b"\r" not in raw


async def test_a_data_line_of_several_megabytes_passes_intact(gw):
    size = 6 * 1024 * 1024
    _, raw = await stream_bytes(gw, {"prompt": "x", "max_tokens": 2, "mock": {"pad_bytes": size}})
    first = payloads(raw)[0]
    assert first["padding"] == "x" * size


async def test_upstream_comments_pass_and_keepalive_while_silent(harness):
    async with harness(overrides={"server": {"keepalive_seconds": 0.2}}) as h:
        _, raw = await stream_bytes(h, {"prompt": "x", "max_tokens": 2,
                                        "mock": {"flavor": "llamacpp", "silence": 1.0}})
    frames = events(raw)
    assert b":" in frames  # llama.cpp's own keepalive comment, passed through
    assert b": keepalive" in frames
    assert frames[-1] == b"data: [DONE]"


@pytest.mark.parametrize("flavor", ["vllm", "llamacpp"])
async def test_upstream_error_event_mid_stream_then_done(gw, flavor):
    gen, raw = await stream_bytes(gw, {"prompt": "x", "max_tokens": 6,
                                       "mock": {"flavor": flavor, "fail": "error_event", "after": 2}})
    items = payloads(raw)
    assert items[-1] == "[DONE]"
    assert "error" in items[-2] and items[-2]["error"]["message"] == "mock failure mid-stream"
    assert sum("error" in i for i in items[:-1]) == 1
    assert raw.count(b"[DONE]") == 1
    row = await gw.row(gen)
    assert row["status"] == 200 and row["error_code"] == "upstream_error"


@pytest.mark.parametrize("mock, code", [
    ({"fail": "drop", "after": 2}, "upstream_error"),
    ({"fail": "eof", "after": 2, "flavor": "ollama"}, "upstream_error"),
])
async def test_upstream_dying_mid_stream_gives_one_error_event_and_done(gw, mock, code):
    gen, raw = await stream_bytes(gw, {"prompt": "x", "max_tokens": 6, "mock": mock})
    items = payloads(raw)
    assert items[-1] == "[DONE]"
    assert [i for i in items[:-1] if "error" in i] == [items[-2]]
    assert items[-2]["error"]["code"] == code
    row = await gw.row(gen)
    assert row["error_code"] == code and row["completion_tokens"] == 2


async def test_upstream_idle_timeout_mid_stream(harness):
    async with harness(overrides={"server": {"upstream_idle_timeout": 0.3}}) as h:
        gen, raw = await stream_bytes(h, {"prompt": "x", "max_tokens": 6, "mock": {"fail": "stall", "after": 1}})
        assert payloads(raw)[-2]["error"]["code"] == "upstream_timeout"
        assert (await h.row(gen))["error_code"] == "upstream_timeout"


async def test_client_leaving_closes_upstream_and_records_disconnect(gw):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "a b c d", "max_tokens": 500,
                                           "stream": True, "mock": {"delay": 0.01}}) as resp:
        gen = resp.headers[GEN]
        got = b""
        while got.count(b"\n\n") < 3:
            got += await resp.content.readany()
        resp.connection.transport.abort()
    stats = await gw.mock_wait(hangups=1)
    assert stats["hangups"] == 1
    for _ in range(200):  # the row is written by the handler's finally, just after the hang-up
        rows = await gw.rows(id=gen)
        if rows:
            break
        await asyncio.sleep(0.01)
    row = rows[0]
    assert row["disconnected"] == 1
    assert 3 <= row["completion_tokens"] < 500
    assert row["prompt_tokens"] >= 1 and row["cost"] > 0


async def test_events_are_parsed_only_when_a_rule_needs_them(harness, monkeypatch):
    from kilnproxy.proxy.relay import plain_bookkeeping, plain_decider, plain_relay as relay, plain_transforms
    parsed = []
    real_loads = relay.orjson.loads

    class CountingOrjson:
        JSONDecodeError = relay.orjson.JSONDecodeError
        dumps = staticmethod(relay.orjson.dumps)

        @staticmethod
        def loads(data):
            parsed.append(data)
            return real_loads(data)

    for module in (relay, plain_decider, plain_transforms, plain_bookkeeping):  # the relay's parts
        monkeypatch.setattr(module, "orjson", CountingOrjson)
    async with harness(configure=lambda c: c["models"][0].update(upstream_model=MODEL)) as h:
        _, raw = await stream_bytes(h, {"prompt": "x", "max_tokens": 20})
    assert len(payloads(raw)) == 22  # 20 words, the finish chunk, [DONE]
    # only the chunk with a finish reason and the usage chunk needed a look
    assert len(parsed) == 2
    assert b'"finish_reason":"length"' in parsed[0] and b'"usage"' in parsed[1]


# path, the client's body, what the upstream sends in one write
WHOLE = {
    "completions": ("/v1/completions", {"model": MODEL, "stream": True, "prompt": "x",
                                        "stream_options": {"include_usage": True}}, WHOLE_STREAM),
    "messages": ("/v1/messages", {"model": MODEL, "stream": True, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "x"}]}, WHOLE_MESSAGES_STREAM),
}


def sent_by_server(monkeypatch) -> list[bytes]:
    """What each of aiohttp's writes to a transport carried (its server's and its client's), one item a write."""
    sent = []
    write, writelines = StreamWriter._write, StreamWriter._writelines

    def one(self, chunk):
        sent.append(bytes(chunk))
        write(self, chunk)

    def several(self, chunks):
        chunks = list(chunks)
        sent.append(b"".join(chunks))
        writelines(self, chunks)
    monkeypatch.setattr(StreamWriter, "_write", one)
    monkeypatch.setattr(StreamWriter, "_writelines", several)
    return sent


@pytest.mark.parametrize("api", list(WHOLE))
async def test_a_stream_that_came_in_one_chunk_goes_out_in_one_write_after_its_row(harness, monkeypatch, api):
    """The upstream's answer was all here when the stream began: the head, its events and the end of the
    body (the usage chunk and ``[DONE]``) go out in one write, after the row's commit (M3's nginx sends a
    whole stream at once)."""
    path, body, stream = WHOLE[api]
    sent = sent_by_server(monkeypatch)
    ends = []
    write_eof = web.StreamResponse.write_eof

    async def write_eof_after_the_row(self, data=b""):
        if data:  # the end of the body (aiohttp calls it once more, with nothing, when the handler returns)
            journaled = [orjson.loads(line) for line in Path(f"{h.db}-rows").read_bytes().splitlines()]
            ends.append(list({r["id"]: r for r in journaled + await h.rows()}.values()))
        await write_eof(self, data)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof_after_the_row)

    def configure(config):
        config["models"][0].update(upstreams=[url], endpoints=["completions", "messages"])
    async with raw_upstream(stream=stream) as url:
        async with harness(configure=configure) as h:
            async with h.post(path, body) as resp:
                assert resp.status == 200, await resp.text()
                raw = await resp.read()
    [response] = [data for data in sent if data.startswith(b"HTTP/1.1 200")]
    head, chunked = response.split(b"\r\n\r\n", 1)
    assert b"Transfer-Encoding: chunked" in head and chunked == b"%x\r\n%s\r\n0\r\n\r\n" % (len(raw), raw)
    if api == "completions":
        assert [p["choices"] for p in payloads(raw)[:3]] == [
            [{"index": 0, "text": "a", "finish_reason": None}], [{"index": 0, "text": " b", "finish_reason": None}],
            [{"index": 0, "text": "", "finish_reason": "length"}]]
    else:
        assert raw.count(b"event: content_block_delta") == 2 and raw.endswith(b'"type":"message_stop"}\n\n')
    [rows] = ends
    # on disk before the write: committed, or (a lone request's) in the row journal
    assert [(r["status"], r["completion_tokens"]) for r in rows] == [(200, 2)]


async def test_the_head_is_not_held_back_for_events_still_to_come(harness, monkeypatch):
    """An upstream that answered its head and not yet its first event (a long prompt's prefill): the
    client gets its head at once."""
    sent = sent_by_server(monkeypatch)
    go = asyncio.Event()
    async with raw_upstream(go) as url:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
            async with h.post("/v1/completions", {"model": MODEL, "stream": True, "prompt": "x"}) as resp:
                assert resp.status == 200  # the head came while the upstream still held its events back
                go.set()
                raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    [head] = [data for data in sent if data.startswith(b"HTTP/1.1 200")]
    assert head.endswith(b"\r\n\r\n")


@pytest.mark.parametrize("api", list(WHOLE))
async def test_keepalive_after_first_events_that_were_there_when_the_stream_began(harness, api):
    """The upstream sends its head with its first events, then falls silent: the stream began with its
    events (its head held back for them, no timer yet), and the silence after them still gets
    ``: keepalive``."""
    path, body, stream = WHOLE[api]
    cut = stream.index(b"\n\n") + 2  # the first event
    go = asyncio.Event()

    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(stream), stream[:cut]))
        await writer.drain()
        await go.wait()
        writer.write(stream[cut:])
        await writer.drain()
        writer.close()

    def configure(config):
        config["models"][0].update(upstreams=[url], endpoints=["completions", "messages"])
    async with raw_server(serve) as url:
        async with harness(overrides={"server": {"keepalive_seconds": 0.1}}, configure=configure) as h:
            async with h.post(path, body) as resp:
                assert resp.status == 200
                raw = b""
                async with asyncio.timeout(30):  # only stops a test that would hang: no keepalive came
                    while b": keepalive\n\n" not in raw:
                        raw += await resp.content.readany()
                go.set()
                raw += await resp.read()
    assert raw.startswith(b"data: {" if api == "completions" else b"event: message_start\n")
    assert raw.index(b": keepalive\n\n") > raw.index(b"\n\n")  # after the first event
    assert raw.endswith(b"data: [DONE]\n\n" if api == "completions" else b'"type":"message_stop"}\n\n')
