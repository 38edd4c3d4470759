"""A plugin that raises fails only its own request, whichever hook it raised in.

For each hook there is a ``test_raising_in_<hook>`` (tests/plugins/test_plugin_meta.py
checks it): the failing request gets a clear error naming the plugin, its
usage row and in-flight slot are handled as for any failure (the org may have
only one request in flight, so a leaked slot would make the next request a
429), and the next request succeeds.
"""

import asyncio
import subprocess
import sys
import textwrap

import aiohttp
import orjson
import pytest

from kilnproxy import Refusal, hookimpl
from kilnproxy.errors import PluginError

PROMPT = "The capital of France is"
ONE_SLOT = {"limits": {"max_in_flight_per_org": 1}}


class RaisesOnce:
    """Raises ``exc`` (ValueError("boom")) the first time ``hook`` runs (and ``when(event)`` holds), then behaves."""

    __name__ = "boomer"

    def __init__(self, hook, when=lambda event: True, exc=ValueError):
        self.failed = False

        def maybe_raise(event=None):
            if not self.failed and when(event):
                self.failed = True
                raise exc("boom")

        if hook == "transform_event":
            impl = lambda call, event: maybe_raise(event)  # noqa: E731
        else:
            impl = lambda call: maybe_raise()  # noqa: E731
        setattr(self, hook, hookimpl(specname=hook)(impl))


def plugin_error(hook: str, exc: str = "ValueError") -> dict:
    return {"error": {"message": f"Plugin 'boomer' raised in {hook}: {exc}: boom", "type": "server_error",
                      "param": None, "code": "plugin_error"}}


async def assert_next_request_succeeds(h, stream=False):
    client = h.openai()
    if stream:
        chunks = [c async for c in await client.completions.create(model=h.model, prompt=PROMPT, max_tokens=2,
                                                                   stream=True)]
        assert "".join(c.choices[0].text for c in chunks) == " Paris is"
    else:
        out = await client.completions.create(model=h.model, prompt=PROMPT, max_tokens=2)
        assert out.choices[0].text == " Paris is"
    rows = await h.rows()
    assert rows[-1]["status"] == 200 and rows[-1]["error_code"] is None


async def _fails_before_response(h, hook, stream, exc="ValueError"):
    body = {"model": h.model, "prompt": PROMPT, "max_tokens": 2, "stream": stream}
    async with h.post("/v1/completions", body) as resp:
        assert resp.status == 500
        assert resp.content_type == "application/json"
        assert await resp.json() == plugin_error(hook, exc)
        row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert (row["status"], row["error_code"]) == (500, "plugin_error")
    return row


@pytest.mark.parametrize("stream", [False, True])
async def test_raising_in_check_request(harness, stream):
    async with harness(plugins=[RaisesOnce("check_request")], overrides=ONE_SLOT) as h:
        await _fails_before_response(h, "check_request", stream)
        assert await h.mock_requests() == []
        await assert_next_request_succeeds(h, stream)


@pytest.mark.parametrize("stream", [False, True])
async def test_raising_in_rewrite_request(harness, stream):
    async with harness(plugins=[RaisesOnce("rewrite_request")], overrides=ONE_SLOT) as h:
        await _fails_before_response(h, "rewrite_request", stream)
        assert await h.mock_requests() == []
        await assert_next_request_succeeds(h, stream)


@pytest.mark.parametrize("stream", [False, True])
async def test_raising_in_response_headers(harness, stream):
    async with harness(plugins=[RaisesOnce("response_headers")], overrides=ONE_SLOT) as h:
        await _fails_before_response(h, "response_headers", stream)
        await assert_next_request_succeeds(h, stream)


async def test_raising_in_transform_response(harness):
    async with harness(plugins=[RaisesOnce("transform_response")], overrides=ONE_SLOT) as h:
        row = await _fails_before_response(h, "transform_response", stream=False)
        assert row["completion_tokens"] == 2 and row["cost"] > 0  # the upstream did the work
        await assert_next_request_succeeds(h)


def _error_frame(hook="transform_event", plugin="boomer", error="ValueError: boom") -> bytes:
    return b"data: " + orjson.dumps({"error": {"message": f"Plugin '{plugin}' raised in {hook}: {error}",
                                               "type": "server_error", "param": None,
                                               "code": "plugin_error"}}) + b"\n\n"


async def _stream_raw(h, **extra):
    body = {"model": h.model, "prompt": PROMPT, "max_tokens": 6, "stream": True, **extra}
    async with h.post("/v1/completions", body) as resp:
        assert resp.status == 200
        return await resp.read(), await h.row(resp.headers["X-Neocloud-Generation-Id"])


async def test_raising_in_transform_event(harness):
    async with harness(plugins=[RaisesOnce("transform_event")], overrides=ONE_SLOT) as h:
        raw, row = await _stream_raw(h, mock={"delay": 0.02})
        assert raw == _error_frame() + b"data: [DONE]\n\n"
        assert (row["status"], row["error_code"], row["disconnected"]) == (200, "plugin_error", 0)
        assert (await h.mock_wait(hangups=1))["hangups"] == 1  # the upstream request was closed
        await assert_next_request_succeeds(h, stream=True)


async def test_raising_in_transform_event_on_the_usage_chunk(harness):
    plugin = RaisesOnce("transform_event", when=lambda event: event["choices"] == [])
    async with harness(plugins=[plugin], overrides=ONE_SLOT) as h:
        raw, row = await _stream_raw(h, stream_options={"include_usage": True})
        frames = raw.split(b"\n\n")
        assert len(frames) == 7 + 2 + 1 and frames[-1] == b""  # 6 words, the finish chunk, error, [DONE]
        assert b"\n\n".join(frames[-3:]) == _error_frame() + b"data: [DONE]\n\n"
        assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, "plugin_error", 6)
        await assert_next_request_succeeds(h, stream=True)


class Custom(BaseException):
    """A plugin's own exception outside ``Exception``."""


BASE_EXCEPTIONS = (KeyboardInterrupt, SystemExit, GeneratorExit, Custom, asyncio.CancelledError)


class AsyncRaisesOnce:
    """``RaisesOnce`` as an ``async def`` hook: the ``CancelledError`` it raises is its own, not a cancellation."""

    __name__ = "boomer"

    def __init__(self, hook, exc):
        self.failed = False

        async def maybe_raise(call):
            await asyncio.sleep(0)
            if not self.failed:
                self.failed = True
                raise exc("boom")

        setattr(self, hook, hookimpl(specname=hook)(maybe_raise))


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS, ids=lambda exc: exc.__name__)
@pytest.mark.parametrize("hook", ["check_request", "rewrite_request", "response_headers", "transform_response"])
@pytest.mark.parametrize("plugin", [RaisesOnce, AsyncRaisesOnce])
async def test_a_base_exception_of_a_plugin_is_its_plugin_error(harness, caplog, plugin, hook, exc):
    async with harness(plugins=[plugin(hook, exc=exc)], overrides=ONE_SLOT) as h:
        await _fails_before_response(h, hook, stream=False, exc=exc.__name__)
        await assert_next_request_succeeds(h)
    assert f"plugin 'boomer' raised in {hook}" in caplog.text


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS, ids=lambda exc: exc.__name__)
async def test_a_base_exception_in_transform_event_ends_the_stream(harness, exc):
    async with harness(plugins=[RaisesOnce("transform_event", exc=exc)], overrides=ONE_SLOT) as h:
        raw, row = await _stream_raw(h, mock={"delay": 0.02})
        assert raw == _error_frame(error=f"{exc.__name__}: boom") + b"data: [DONE]\n\n"
        assert (row["status"], row["error_code"], row["disconnected"]) == (200, "plugin_error", 0)
        await assert_next_request_succeeds(h, stream=True)


class SlowCheck:
    @hookimpl
    async def check_request(self):
        await asyncio.sleep(30)


async def test_a_client_leaving_during_an_async_hook_is_a_disconnect_not_a_plugin_error(harness, eventually):
    async with harness(plugins=[SlowCheck()], overrides=ONE_SLOT) as h:
        body = {"model": h.model, "prompt": PROMPT, "max_tokens": 2}
        with pytest.raises(asyncio.TimeoutError):
            async with h.post("/v1/completions", body, timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        rows = await eventually(h.rows)
        assert [(r["status"], r["error_code"], r["disconnected"]) for r in rows] == [(499, None, 1)]


class Unserialisable:
    @hookimpl
    def transform_event(self, event):
        event["when"] = object()


async def test_transform_event_leaving_no_json_is_named(harness):
    async with harness(plugins=[Unserialisable()], overrides=ONE_SLOT) as h:
        raw, row = await _stream_raw(h)
        assert raw.startswith(b"data: {\"error\":{\"message\":\"Plugin 'Unserialisable' raised in transform_event:"
                              b" TypeError: the event is no longer JSON")
        assert raw.endswith(b"\"type\":\"server_error\",\"param\":null,\"code\":\"plugin_error\"}}\n\n"
                            b"data: [DONE]\n\n")
        assert row["error_code"] == "plugin_error"


class UnserialisableBody:
    @hookimpl
    def rewrite_request(self, body):
        body["when"] = object()


@pytest.mark.parametrize("stream", [False, True])
async def test_rewrite_request_leaving_no_json_is_named(harness, stream):
    async with harness(plugins=[UnserialisableBody()], overrides=ONE_SLOT) as h:
        async with h.post("/v1/completions", {"model": h.model, "prompt": PROMPT, "stream": stream}) as resp:
            answer = await resp.json()
            row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
        assert resp.status == 500 and answer["error"]["code"] == "plugin_error"
        assert answer["error"]["message"].startswith("Plugin 'UnserialisableBody' raised in rewrite_request: "
                                                     "TypeError: the body is no longer JSON")
        assert (row["status"], row["error_code"]) == (500, "plugin_error")


class WrongReturns:
    @hookimpl
    def check_request(self, body):
        return True if body.get("user") == "check" else None

    @hookimpl
    def response_headers(self, call):
        return {"X-Count": 3}


async def test_hooks_returning_the_wrong_type_are_plugin_errors(harness):
    async with harness(plugins=[WrongReturns()], overrides=ONE_SLOT) as h:
        for user, hook, expected in (("check", "check_request", "None or a kilnproxy.Refusal"),
                                     ("other", "response_headers", "None or a dict of str to str")):
            async with h.post("/v1/completions", {"model": h.model, "prompt": PROMPT, "user": user}) as resp:
                assert resp.status == 500
                got = "bool" if hook == "check_request" else "dict"
                assert (await resp.json())["error"]["message"] == (
                    f"Plugin 'WrongReturns' raised in {hook}: TypeError: returned {got}; expected {expected}")


BAD_HEADERS = ({"X-A": "1\r\nX-Inj: 2"}, {"X-A": "1\x00"}, {"x-neocloud-generation-id": "forged"},
               {"X-Neocloud-Generation-Id": "forged"}, {"Content-Length": "3"}, {"transfer-encoding": "chunked"},
               {"Connection": "close"}, {"Content-Type": "text/plain"}, {"X-\u00e9": "v"}, {"X A": "v"},
               {"X:A": "v"}, {"": "v"})


class ReturnsHeaders:
    def __init__(self, headers):
        self.headers = headers

    @hookimpl
    def response_headers(self):
        return self.headers


def _may_not(hook: str, plugin: str):
    return f"Plugin '{plugin}' raised in {hook}: ValueError: returned something it may not: "


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("headers", BAD_HEADERS, ids=repr)
async def test_response_headers_the_gateway_may_not_send_are_plugin_errors(harness, headers, stream):
    async with harness(plugins=[ReturnsHeaders(headers)], overrides=ONE_SLOT) as h:
        body = {"model": h.model, "prompt": PROMPT, "max_tokens": 2, "stream": stream}
        async with h.post("/v1/completions", body) as resp:
            assert resp.status == 500 and resp.content_type == "application/json"
            assert resp.headers.getall("X-Neocloud-Generation-Id") != ["forged"]
            error = (await resp.json())["error"]
            assert error["code"] == "plugin_error"
            assert error["message"].startswith(_may_not("response_headers", "ReturnsHeaders"))
            row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
        assert (row["status"], row["error_code"]) == (500, "plugin_error")


class Refuses:
    def __init__(self, refusal, raised):
        self.refusal, self.raised = refusal, raised

    @hookimpl
    def check_request(self):
        if self.raised:
            raise self.refusal
        return self.refusal


@pytest.mark.parametrize("raised", [False, True])
@pytest.mark.parametrize("refusal", [
    *(Refusal(status, "nope", "no") for status in (99, 200, 204, 304, 600, "400", 400.0, True)),
    *(Refusal(400, "nope", "no", headers=headers) for headers in BAD_HEADERS)], ids=repr)
async def test_a_refusal_the_gateway_may_not_send_is_a_plugin_error(harness, refusal, raised):
    async with harness(plugins=[Refuses(refusal, raised)], overrides=ONE_SLOT) as h:
        async with h.post("/v1/completions", {"model": h.model, "prompt": PROMPT}) as resp:
            assert resp.status == 500
            error = (await resp.json())["error"]
            assert error["message"].startswith(_may_not("check_request", "Refuses"))
            row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
        assert (row["status"], row["error_code"]) == (500, "plugin_error")
        assert await h.mock_requests() == []


class FailingRecorder:
    def __init__(self, exc=ValueError):
        self.calls = 0
        self.exc = exc
        self.shut = False

    @hookimpl
    def record_usage(self, usage):
        self.calls += 1
        if self.calls == 1:
            raise self.exc("boom")

    @hookimpl
    def shutdown(self):
        self.shut = True


class GoodRecorder:
    def __init__(self):
        self.ids = []

    @hookimpl(trylast=True)
    async def record_usage(self, usage):
        self.ids.append(usage["id"])


@pytest.mark.parametrize("exc", (ValueError, *BASE_EXCEPTIONS), ids=lambda exc: exc.__name__)
async def test_raising_in_record_usage(harness, caplog, exc):
    failing, good = FailingRecorder(exc), GoodRecorder()
    async with harness(plugins=[failing, good], overrides=ONE_SLOT) as h:
        await assert_next_request_succeeds(h)
        await assert_next_request_succeeds(h, stream=True)
        await h.usage_recorded()
        rows = await h.rows()
        assert [r["status"] for r in rows] == [200, 200]
        assert failing.calls == 2 and good.ids == [r["id"] for r in rows]
    assert f"plugin 'FailingRecorder' failed in record_usage for {rows[0]['id']}" in caplog.text
    assert f"{exc.__name__}: boom" in caplog.text and failing.shut


class FailingStartup:
    def __init__(self):
        self.shut = False

    @hookimpl
    def startup(self, gateway):
        raise ConnectionRefusedError("the metrics database at 127.0.0.1:1 refused the connection")

    @hookimpl
    def shutdown(self):
        self.shut = True


class StartsFine:
    def __init__(self):
        self.events = []

    @hookimpl(tryfirst=True)
    def startup(self):
        self.events.append("startup")

    @hookimpl
    def shutdown(self):
        self.events.append("shutdown")


async def test_raising_in_startup(harness):
    failing, fine = FailingStartup(), StartsFine()
    with pytest.raises(PluginError) as err:
        async with harness(plugins=[failing, fine]):
            pass
    assert str(err.value) == ("plugin 'FailingStartup': startup failed: ConnectionRefusedError: the metrics "
                              "database at 127.0.0.1:1 refused the connection")
    assert fine.events == ["startup", "shutdown"] and failing.shut is False


def test_raising_in_startup_stops_serve_with_one_line(tmp_path):
    done = _serve_with(tmp_path, """
        from kilnproxy import hookimpl

        @hookimpl
        async def startup(gateway):
            raise RuntimeError("settings.grumpy.url is required")
    """)
    assert done.returncode == 2
    assert done.stderr == ("kilnproxy: error: plugin 'grumpy': startup failed: RuntimeError: "
                           "settings.grumpy.url is required\n")
    assert done.stdout == ""


@pytest.mark.parametrize("exc", ["SystemExit", "KeyboardInterrupt", "Custom", "asyncio.CancelledError"])
@pytest.mark.parametrize("define", ["async def", "def"])
def test_a_base_exception_in_startup_stops_serve_with_one_line(tmp_path, exc, define):
    done = _serve_with(tmp_path, f"""
        import asyncio
        from kilnproxy import hookimpl

        class Custom(BaseException):
            pass

        @hookimpl
        {define} startup(gateway):
            raise {exc}("no")
    """)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"kilnproxy: error: plugin 'grumpy': startup failed: {exc.split('.')[-1]}: no\n"


@pytest.mark.parametrize("exc", ["SystemExit", "KeyboardInterrupt", "Custom"])
def test_a_base_exception_at_import_stops_serve_with_one_line(tmp_path, exc):
    done = _serve_with(tmp_path, f"""
        class Custom(BaseException):
            pass

        raise {exc}("no")
    """)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"kilnproxy: error: plugin 'grumpy': {tmp_path / 'grumpy.py'} failed to import: "
                           f"{exc}: no\n")


def _serve_with(tmp_path, plugin: str) -> subprocess.CompletedProcess:
    """``python -m kilnproxy`` with the one plugin ``grumpy.py``, whose source is ``plugin``."""
    (tmp_path / "grumpy.py").write_text(textwrap.dedent(plugin))
    (tmp_path / "kiln.toml").write_text(textwrap.dedent("""
        [server]
        port = 0
        [[models]]
        id = "m"
        upstreams = ["http://127.0.0.1:9/v1"]
        [[orgs]]
        id = "acme"
        [[keys]]
        key = "sk-1"
        org = "acme"
        [plugins]
        modules = ["grumpy.py"]
        entry_points = false
    """))
    return subprocess.run([sys.executable, "-m", "kilnproxy", "--config", str(tmp_path / "kiln.toml")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


async def test_raising_in_shutdown(harness, caplog):
    class Closer:
        closed = False

        @hookimpl
        def shutdown(self):
            Closer.closed = True

    class Broken:
        @hookimpl(tryfirst=True)
        def shutdown(self):
            raise OSError("disk gone")

    async with harness(plugins=[Closer(), Broken()]) as h:
        await assert_next_request_succeeds(h)
    assert Closer.closed
    assert "plugin 'Broken' failed in shutdown" in caplog.text and "OSError: disk gone" in caplog.text
