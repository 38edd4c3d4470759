"""``SSEResponse`` (kilnproxy/proxy/relay/sse_response.py) sends the bytes ``web.StreamResponse`` sends.

A real aiohttp server streams each case twice, once with an ``SSEResponse`` and
once with the ``web.StreamResponse`` the gateway used to build (its head held
back for the first body bytes, or not), and the raw bytes read off the socket
are compared line by line (the ``Date`` lines only by their form). The
exchanges cover the head made from a dict (HTTP/1.1, kept alive) and each case
that hands over to ``StreamResponse``'s own ``prepare``: HTTP/1.0,
``Connection: close``, the shutdown's drain, ``HEAD``, a reserved header, the
headers asked for before ``prepare``, an ``on_response_prepare`` handler.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from kilnproxy.ops.lifecycle import close_after_response
from kilnproxy.proxy.relay.sse_response import SSE_HEADERS, SSEResponse
from kilnproxy.testing import MODEL

import wire_compare
from wire_compare import assert_same

pytestmark = pytest.mark.asyncio

CASES = {
    "generation id": {"X-Neocloud-Generation-Id": "gen-1"},
    "no headers": {},
    "several": {"X-Neocloud-Generation-Id": "gen-2", "x-plugin": "v", "X-Name": "caf\u00e9"},
    "a plugin's cache-control": {"cache-control": "no-store"},
    "the same key as a stream header": {"Cache-Control": "private"},
    "reserved header": {"server": "mine", "Date": "yesterday"},
    "header with a tab": {"X-T": "a\tb"},
}
EVENTS = (b"data: {\"a\":1}\n\n", b"data: {\"b\":2}\n\n")
MADE: list[web.StreamResponse] = []


class HeldBack(web.StreamResponse):
    """What the gateway built for a stream whose first events were there: the head goes with them."""

    _send_headers_immediately = False


async def handler(request: web.BaseRequest) -> web.StreamResponse:
    kind, case, hold = request.path.strip("/").split("/")
    if request.headers.get("X-Drain"):
        close_after_response(request)
    headers, hold = CASES[case.replace("%20", " ")], hold == "hold"
    if kind == "mine":
        response = SSEResponse(headers, hold)
        if request.headers.get("X-Ask"):
            response.headers["X-Asked"] = "yes"
    else:
        response = (HeldBack if hold else web.StreamResponse)(status=200, headers={**SSE_HEADERS, **headers})
        if request.headers.get("X-Ask"):
            response.headers["X-Asked"] = "yes"
    MADE.append(response)
    await response.prepare(request)
    await response.write(EVENTS[0])
    await response.write_eof(EVENTS[1])
    return response


@contextlib.asynccontextmanager
async def serving(runner: web.BaseRunner):
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.fixture(params=["app", "low-level"])
async def server(request):
    """The routes of an application (a ``web.Request``) and aiohttp's low-level server (a plain
    ``BaseRequest``, as the gateway's hot routes have)."""
    MADE.clear()
    if request.param == "app":
        app = web.Application()
        app.router.add_route("*", "/{kind}/{case}/{hold}", handler)
        runner: web.BaseRunner = web.AppRunner(app, access_log=None)
    else:
        runner = web.ServerRunner(web.Server(handler))
    async with serving(runner) as port:
        yield port


PROBE = b"GET /theirs/no%20headers/now HTTP/1.1\r\nHost: x\r\n\r\n"


async def exchange(port: int, data: bytes) -> tuple[bytes, bool]:
    """The answer to ``data``, and whether the server closed the connection after it."""
    answers, closed = await wire_compare.exchange(port, data, probe=PROBE)
    return answers[0], closed


def request(method: str, kind: str, case: str, hold: str, version: str = "1.1", extra: str = "") -> bytes:
    return f"{method} /{kind}/{case.replace(' ', '%20')}/{hold} HTTP/{version}\r\nHost: x\r\n{extra}\r\n".encode()


@pytest.mark.parametrize("hold", ["hold", "now"])
@pytest.mark.parametrize("case", CASES)
async def test_head_from_a_dict_same_bytes_as_stream_response(server, case, hold):
    mine, mine_closed = await exchange(server, request("POST", "mine", case, hold))
    theirs, theirs_closed = await exchange(server, request("POST", "theirs", case, hold))
    assert not mine_closed and not theirs_closed
    assert_same(mine, theirs)
    assert mine.endswith(b"\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(EVENTS[0]), EVENTS[0], len(EVENTS[1]), EVENTS[1]))
    made = MADE[0]
    assert (made._sent is not None) == (case != "reserved header")  # the dict's head, or StreamResponse's
    assert made.keep_alive is True and made.prepared and made.body_length == MADE[2].body_length
    assert made.headers["Content-Type"] == SSE_HEADERS["Content-Type"]


FALLBACKS = {
    "HTTP/1.0": ("POST", "1.0", ""),
    "Connection: close": ("POST", "1.1", "Connection: close\r\n"),
    "the shutdown's drain": ("POST", "1.1", "X-Drain: 1\r\n"),
    "HEAD": ("HEAD", "1.1", ""),
    "the headers asked for and changed": ("POST", "1.1", "X-Ask: 1\r\n"),
}


@pytest.mark.parametrize("hold", ["hold", "now"])
@pytest.mark.parametrize("exchange_kind", FALLBACKS)
async def test_handed_to_stream_response(server, exchange_kind, hold):
    method, version, extra = FALLBACKS[exchange_kind]
    mine, mine_closed = await exchange(server, request(method, "mine", "generation id", hold, version, extra))
    theirs, theirs_closed = await exchange(server, request(method, "theirs", "generation id", hold, version, extra))
    assert_same(mine, theirs)
    assert mine_closed == theirs_closed
    assert MADE[0]._sent is None
    if extra in ("X-Drain: 1\r\n", "Connection: close\r\n"):
        assert b"\r\nConnection: close\r\n" in mine and mine_closed
    if extra == "X-Ask: 1\r\n":
        assert b"\r\nX-Asked: yes\r\n" in mine


async def test_header_injection_refused_as_stream_response_refuses_it(server):
    """aiohttp refuses to serialise the head: the server's 500 and the connection closed, the same bytes
    for an SSEResponse."""
    CASES["injected"] = {"X-Evil": "a\r\nSet-Cookie: x=1"}
    answers = []
    try:
        for kind in ("mine", "theirs"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server)
            writer.write(request("POST", kind, "injected", "hold"))
            async with asyncio.timeout(30):
                answers.append(await reader.read())  # to the close
            writer.close()
    finally:
        del CASES["injected"]
    assert answers[0].startswith(b"HTTP/1.1 500 Internal Server Error\r\n") and b"Set-Cookie" not in answers[0]
    assert_same(*answers)


async def test_on_response_prepare_handler_sees_and_changes_the_stream():
    seen = []

    async def on_prepare(req, resp):
        seen.append(resp.status)
        resp.headers["X-Prepared"] = "yes"

    app = web.Application()
    app.router.add_route("*", "/{kind}/{case}/{hold}", handler)
    app.on_response_prepare.append(on_prepare)
    MADE.clear()
    async with serving(web.AppRunner(app, access_log=None)) as port:
        mine, _ = await exchange(port, request("POST", "mine", "generation id", "hold"))
        theirs, _ = await exchange(port, request("POST", "theirs", "generation id", "hold"))
    assert seen == [200] * 4  # each stream and each probe
    assert b"\r\nX-Prepared: yes\r\n" in mine and MADE[0]._sent is None
    assert_same(mine, theirs)


async def test_the_gateways_stream_head(gw):
    """A stream from the gateway: aiohttp's headers, in its order, after the stream's own."""
    port = int(gw.url.rsplit(":", 1)[1])
    body = b'{"model":"%s","prompt":"Hi","max_tokens":2,"stream":true}' % MODEL.encode()
    key = gw.headers()["Authorization"].encode()
    got, closed = await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + key
                                 + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    lines = got.partition(b"\r\n\r\n")[0].split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK" and not closed
    assert [line.split(b":")[0] for line in lines[1:]] == [
        b"Content-Type", b"Cache-Control", b"X-Accel-Buffering", b"X-Neocloud-Generation-Id", b"Transfer-Encoding",
        b"Date", b"Server"]
    assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
