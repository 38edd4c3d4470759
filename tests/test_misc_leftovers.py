"""Leftovers, each through a real gateway on real ports: upstreams that answer bytes that are not HTTP
(``upstream_bad_response``, failover and marking down), model ids a discovering upstream lists (escaped
and bounded in the log, refused when they cannot be model ids), plugins that try to write to ``call``
(``plugin_error``), and the inspector's paging cursor with a malformed time (400 ``before``)."""

import asyncio
import base64
from contextlib import asynccontextmanager

import orjson
import pytest
from rawhttp import raw_server, read_request

from kilnproxy import Call, hookimpl
from kilnproxy.config import Pricing
from kilnproxy.mock_servers.mock_upstream import OPTIONS
from kilnproxy.testing import MODEL, free_port

GEN = "X-Neocloud-Generation-Id"
DEAD = f"http://127.0.0.1:{free_port()}/v1"


# -- 1. an upstream whose answer is not HTTP -----------------------------------------------------------


class NotHttp:
    """An upstream that answers every request with ``raw`` and keeps the connection open until the
    gateway hangs up (as a server that thinks it answered would); ``requests`` counts what it got."""

    def __init__(self, raw: bytes):
        self.raw = raw
        self.requests = 0

    async def serve(self, reader, writer):
        try:
            while True:
                await read_request(reader)
                self.requests += 1
                writer.write(self.raw)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self):
        async with raw_server(self.serve) as url:
            yield url


NOT_HTTP = {
    "letters for a status": (b"HTTP/1.1 abc OK\r\n", "Invalid status code"),
    "no status line": (b"garbage\r\n\r\n", "Expected HTTP/, RTSP/ or ICE/"),
    "four digits": (b"HTTP/1.1 2000 X\r\n", "Invalid response status"),
    "status 000": (b"HTTP/1.1 000 X\r\nContent-Length: 0\r\n\r\n", "status 000"),
}


def one_upstream(url: str):
    return lambda config: config["models"][0].update(upstreams=[url])


async def answer_and_row(h, stream: bool) -> tuple[int, str, bytes, dict]:
    async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream}) as resp:
        body = await resp.read()
        return resp.status, resp.headers["Content-Type"], body, await h.row(resp.headers[GEN])


@pytest.mark.parametrize("case", list(NOT_HTTP))
@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_that_is_not_http_is_a_bad_response(harness, case, stream):
    raw, reason = NOT_HTTP[case]
    upstream = NotHttp(raw)
    async with upstream.running() as url:
        # "000" was taken for an interim answer: the gateway then waited for the idle timeout
        async with harness(configure=one_upstream(url), overrides={"server": {"upstream_idle_timeout": 3}}) as h:
            status, content_type, body, row = await answer_and_row(h, stream)
            assert (status, content_type) == (502, "text/plain; charset=utf-8")
            assert body == f"Bad gateway: {url}: UpstreamBadResponse: invalid HTTP response: {reason}\n".encode()
            assert (row["status"], row["error_code"], row["stream"], row["cost"], row["prompt_tokens"]) == (
                502, "upstream_bad_response", int(stream), 0, 0)
            assert len(await h.rows()) == 1
            assert h.gw.admission.count("acme") == 0
    assert upstream.requests == 1


async def test_answers_that_are_not_http_mark_the_upstream_down_like_refusals(harness):
    upstream = NotHttp(b"garbage\r\n\r\n")
    async with upstream.running() as url:
        async with harness(configure=one_upstream(url),
                           overrides={"server": {"upstream_max_failures": 2, "upstream_down_seconds": 60}}) as h:
            got = []
            for _ in range(3):
                status, _, body, row = await answer_and_row(h, False)
                got.append((status, row["error_code"]))
            assert got == [(502, "upstream_bad_response"), (502, "upstream_bad_response"),
                           (503, "no_backend_available")]
            async with h.session.get(f"{h.url}/metrics") as resp:
                metrics = await resp.text()
    assert upstream.requests == 2
    assert f'kilnproxy_upstream_up{{model="{MODEL}",upstream="{url}"}} 0.0' in metrics
    assert f'kilnproxy_upstream_failures_total{{model="{MODEL}",upstream="{url}"}} 2.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_fails_over_from_an_answer_that_is_not_http(harness, stream):
    upstream = NotHttp(b"HTTP/1.1 abc OK\r\n")
    async with upstream.running() as url:
        def configure(config):
            model = config["models"][0]
            model["upstreams"] = [url, model["upstreams"][0]]
        async with harness(configure=configure) as h:
            for _ in range(4):  # ties are taken in turn: the upstream that is not HTTP comes first in some
                status, _, body, row = await answer_and_row(h, stream)
                assert (status, row["status"], row["error_code"]) == (200, 200, None)
                assert body.endswith(b"data: [DONE]\n\n") if stream else b'"choices"' in body
            assert len(await h.rows()) == 4
    assert upstream.requests >= 1


def chain_of(first: str, fallback: str):
    """The test model on ``first``, falling back to ``small`` on ``fallback``."""
    def configure(config):
        model = config["models"][0]
        config["models"].append({**model, "id": "small", "upstream_model": "small", "upstreams": [fallback]})
        model.update(upstreams=[first], fallbacks=["small"])
    return configure


@pytest.mark.parametrize("not_http_last, code", [(True, "upstream_bad_response"), (False, "upstream_unreachable")])
async def test_with_nothing_left_the_last_failure_names_the_code(harness, not_http_last, code):
    upstream = NotHttp(b"garbage\r\n\r\n")
    async with upstream.running() as url:
        first, fallback = (DEAD, url) if not_http_last else (url, DEAD)
        async with harness(configure=chain_of(first, fallback)) as h:
            status, content_type, body, row = await answer_and_row(h, False)
            assert (status, content_type) == (502, "text/plain; charset=utf-8")
            assert body.startswith(f"Bad gateway: {fallback}: ".encode())
            assert (row["status"], row["error_code"], row["model"], row["requested_model"]) == (
                502, code, MODEL, MODEL)
            assert len(await h.rows()) == 1
    assert upstream.requests == 1


async def test_a_json_body_whose_chunks_are_not_http_is_a_bad_response(harness):
    upstream = NotHttp(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"zz\r\n{}\r\n0\r\n\r\n")
    async with upstream.running() as url:
        async with harness(configure=one_upstream(url)) as h:
            status, content_type, body, row = await answer_and_row(h, False)
    assert (status, content_type) == (502, "text/plain; charset=utf-8")
    assert body == b"Bad gateway: the upstream's answer is not HTTP: invalid HTTP response: Invalid character in chunk size\n"
    assert (row["status"], row["error_code"], row["cost"]) == (502, "upstream_bad_response", 0)


# -- 2. model ids a discovering upstream lists --------------------------------------------------------


HUGE = "x" * 790_000
HOSTILE = ("good/model", "evil\n2026-12-01 kilnproxy INFO admin logged in", HUGE, "tab\there", "line\u2028break",
           "c1\x85", "ok:2", "y" * 256)


def discovering(config):
    model = config["models"][0]
    model.update(id="", discover=True, alias="kiln-demo", upstream_model="mock-vllm")
    del model["reject_chat_params"]


def discovery_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("model discovery")]


async def test_model_ids_that_cannot_be_ids_are_refused_and_logged_escaped_and_short(harness, caplog):
    caplog.set_level("INFO", logger="kilnproxy")
    async with harness(mock_options={"served_models": HOSTILE}, configure=discovering) as h:
        async with h.session.get(f"{h.url}/v1/models", headers=h.headers()) as resp:
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == ["kiln-demo", "good/model", "ok:2", "y" * 256]
        for model in (HOSTILE[1], HOSTILE[4], "tab\there"):
            async with h.post("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1}) as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "model_not_found"
        async with h.post("/v1/completions", {"model": "y" * 256, "prompt": "hi", "max_tokens": 1}) as resp:
            assert resp.status == 200
        rows = await h.rows()
        assert [(r["model"], r["status"], r["error_code"]) for r in rows] == [
            (HOSTILE[1], 404, "model_not_found"), (HOSTILE[4], 404, "model_not_found"),
            ("tab\there", 404, "model_not_found"), ("y" * 256, 200, None)]
        base = h.config["models"][0]["upstreams"][0]
    lines = discovery_lines(caplog)
    assert lines == [
        f"model discovery: {base}/models: 5 model id(s) refused, with a control character or longer than 256 "
        "characters: 'evil\\n2026-12-01 kilnproxy INFO admin logged in', "
        f"'{'x' * 80}'... (790000 characters), 'tab\\there', 'line\\u2028break', 'c1\\x85'",
        "model discovery: 4 model(s) served; new: 'good/model', 'ok:2', "
        f"'{'y' * 80}'... (256 characters)"]
    assert all("\n" not in r.getMessage() and len(r.getMessage()) < 1000 for r in caplog.records)


async def test_a_long_list_is_named_twenty_ids_a_line_and_refusals_are_logged_once(harness, caplog, monkeypatch):
    from kilnproxy.proxy import discovery
    monkeypatch.setattr(discovery, "INTERVAL", 0.02)
    caplog.set_level("INFO", logger="kilnproxy")
    served = tuple(f"m{i:03d}" for i in range(300)) + ("bad\r\n",)
    async with harness(mock_options={"served_models": served}, configure=discovering) as h:
        for _ in range(10):  # several reads of the same list
            await asyncio.sleep(0.03)
        lines = discovery_lines(caplog)
        base = h.config["models"][0]["upstreams"][0]
        assert lines == [f"model discovery: {base}/models: 1 model id(s) refused, with a control character or "
                         "longer than 256 characters: 'bad\\r\\n'",
                         "model discovery: 301 model(s) served; new: "
                         + ", ".join(f"'m{i:03d}'" for i in range(20)) + " and 280 more"]
        h.mock.app[OPTIONS]["served_models"] = served[:300] + ("worse\x00",)
        for _ in range(100):
            if len(discovery_lines(caplog)) == 3:
                break
            await asyncio.sleep(0.02)
        assert discovery_lines(caplog)[2:] == [
            f"model discovery: {base}/models: 1 model id(s) refused, with a control character or "
            "longer than 256 characters: 'worse\\x00'"]


# -- 3. plugins cannot write to call ------------------------------------------------------------------


class Writes:
    """A plugin whose ``hook`` does ``write(call)`` (and once only, so the next request is served)."""

    __name__ = "thief"

    def __init__(self, hook: str, write):
        self.done = False

        def impl(call, **_):
            if not self.done:
                self.done = True
                write(call)

        args = {"transform_event": lambda call, event: impl(call), "record_usage": lambda call, usage: impl(call),
                "check_request": lambda call, body: impl(call), "rewrite_request": lambda call, body: impl(call),
                "transform_response": lambda call, body: impl(call)}
        setattr(self, hook, hookimpl(specname=hook)(args.get(hook, lambda call: impl(call))))


def refused(name: str) -> str:
    return f"call.{name} is read-only: a plugin may change only what call.state holds"


def to_globex(call):
    call.org = "globex"


def for_free(call):
    call.pricing = Pricing(0.0, 0.0, 0.0)


def other_id(call):
    call.generation_id = "gen-000000000000000000000001"


def no_key(call):
    del call.key_id


def new_state(call):
    call.state = {}


def own_field(call):
    call.mine = 1


@pytest.mark.parametrize("hook, write, message", [
    ("check_request", for_free, refused("pricing")),
    ("rewrite_request", to_globex, refused("org")),
    ("response_headers", no_key, refused("key_id")),
    ("transform_response", other_id, refused("generation_id")),
    ("rewrite_request", new_state, refused("state")),
    ("check_request", own_field, "call has no attribute 'mine' to set: a plugin's own data goes in call.state"),
])
async def test_a_plugin_that_writes_to_call_fails_its_hook_and_the_row_keeps_the_requests_facts(
        harness, hook, write, message):
    async with harness(plugins=[Writes(hook, write)]) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4}) as resp:
            assert resp.status == 500
            assert await resp.json() == {"error": {
                "message": f"Plugin 'thief' raised in {hook}: AttributeError: {message}", "type": "server_error",
                "param": None, "code": "plugin_error"}}
            gen = resp.headers[GEN]
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4}) as resp:
            assert resp.status == 200  # the plugin behaves now: priced as ever
            assert (await resp.json())["usage"]["cost"] == round((3 * 0.10 + 4 * 0.30) / 1e6, 10)
        rows = await h.rows()
    assert [(r["id"] == gen, r["org"], r["key_id"], r["status"], r["error_code"]) for r in rows] == [
        (True, "acme", "acme-key", 500, "plugin_error"), (False, "acme", "acme-key", 200, None)]
    assert rows[1]["cost"] == round((3 * 0.10 + 4 * 0.30) / 1e6, 10)


async def test_a_plugin_that_writes_to_call_mid_stream_ends_it_with_its_error_and_one_row(harness):
    async with harness(plugins=[Writes("transform_event", other_id)]) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4,
                                              "stream": True}) as resp:
            assert resp.status == 200
            raw = await resp.read()
            gen = resp.headers[GEN]
        rows = await h.rows()
    assert raw == b"data: " + orjson.dumps({"error": {
        "message": f"Plugin 'thief' raised in transform_event: AttributeError: {refused('generation_id')}",
        "type": "server_error", "param": None, "code": "plugin_error"}}) + b"\n\ndata: [DONE]\n\n"
    assert [(r["id"], r["org"], r["status"], r["error_code"]) for r in rows] == [(gen, "acme", 200, "plugin_error")]


async def test_record_usage_gets_a_read_only_call_also_for_a_request_refused_before_the_plugins(harness, caplog):
    async with harness(plugins=[Writes("record_usage", to_globex)]) as h:
        async with h.post("/v1/completions", {"model": "no-such-model", "prompt": "hi"}) as resp:
            assert resp.status == 404
            gen = resp.headers[GEN]
        await h.usage_recorded()
        rows = await h.rows()
    assert [(r["id"], r["org"], r["status"]) for r in rows] == [(gen, "acme", 404)]
    failed = [r for r in caplog.records if r.getMessage() == f"plugin 'thief' failed in record_usage for {gen}"]
    assert len(failed) == 1 and str(failed[0].exc_info[1]) == refused("org")


def test_a_call_built_by_hand_is_read_only_and_has_what_it_was_given():
    call = Call("gen-1", "acme", "key-1", "completions", model="m", upstream_model="up", stream=True,
                include_usage=True, pricing=Pricing(1.0, 2.0), upstream="http://u/v1")
    assert (call.model, call.upstream_model, call.stream, call.include_usage, call.upstream, call.state) == (
        "m", "up", True, True, "http://u/v1", {})
    assert type(call) is Call
    with pytest.raises(AttributeError, match="call.model is read-only"):
        call.model = "other"
    call.state["mine"] = 1
    assert call.state == {"mine": 1}


# -- 4. the inspector's paging cursor ------------------------------------------------------------------


def cursor(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


BAD_TIME = ("before must be the `next` cursor of a previous page: its time is not an ISO-8601 time such as "
            "2026-11-29T20:00:00.123+00:00")


@pytest.mark.parametrize("time", ["x\x00y", "2026-11-29T20:00:00.123+00:00\x00", "2026-13-45T99:99:99.000+00:00",
                                  "zzz", "2026-11-29T20:00:00.123+00:00\n", "２０２６-11-29", "2" * 100])
async def test_a_cursor_whose_time_is_malformed_is_a_400_naming_before(harness, store, time):
    async with harness(overrides=store) as h:
        async with h.session.get(f"{h.url}/ui/api/requests", params={"before": cursor(f"{time}~5")}) as resp:
            assert resp.status == 400
            assert await resp.json() == {"error": {"message": BAD_TIME, "type": "invalid_request_error",
                                                   "param": "before", "code": "invalid_request"}}


async def test_the_cursors_the_inspector_gives_still_page_through_every_row(harness, store):
    async with harness(overrides=store) as h:
        ids = []
        for _ in range(5):
            async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}) as resp:
                ids.append(resp.headers[GEN])
        seen, url = [], f"{h.url}/ui/api/requests?limit=2"
        while url:
            async with h.session.get(url) as resp:
                assert resp.status == 200
                page = await resp.json()
            seen += [r["id"] for r in page["data"]]
            url = f"{h.url}/ui/api/requests?limit=2&before={page['next']}" if page["next"] else None
    assert seen == ids[::-1]
