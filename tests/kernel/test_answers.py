"""``Answer`` (kilnproxy/answers.py) sends the bytes ``web.Response`` sends for the same answer.

A real aiohttp server answers each case twice, once with an ``Answer`` and once
with the ``web.Response`` the gateway used to build, and the raw bytes read off
the socket are compared line by line (the ``Date`` lines only by their form:
the two answers may straddle a second). The exchanges cover the pre-built
buffer (HTTP/1.1, kept alive) and each case that hands over to
``web.Response``: HTTP/1.0, ``Connection: close``, the shutdown's drain,
``HEAD``, a reserved or malformed header, an ``on_response_prepare`` handler.
These tests also pin what ``Answer`` relies on in aiohttp: that the server
calls ``prepare`` then ``write_eof`` and keeps the connection by the response's
``keep_alive``, and the header rules of ``web.Response``.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from kilnproxy.answers import Answer
from kilnproxy.ops.lifecycle import close_after_response
from kilnproxy.testing import MODEL

import wire_compare
from wire_compare import assert_same

pytestmark = pytest.mark.asyncio

CASES = {
    "json": (200, b'{"id":"x","model":"m"}', "application/json", {"X-Neocloud-Generation-Id": "gen-1"}),
    "no headers": (200, b"{}", "application/json", {}),
    "error": (429, b'{"error":{"code":"rate_limited"}}', "application/json",
              {"Retry-After": "3", "X-Neocloud-Generation-Id": "gen-2"}),
    "text": (502, b"Bad gateway: nope\n", "text/plain; charset=utf-8", {"X-Neocloud-Generation-Id": "g"}),
    "pass-through type": (400, b'{"error":{}}', "application/json; charset=utf-8", {"x-plugin": "v"}),
    "empty body": (200, b"", "application/json", {}),
    "large body": (200, b"[" + b"0.125," * 3000 + b"1]", "application/json", {"A": "1"}),
    "unknown status": (599, b"{}", "application/json", {}),
    "utf-8 header": (200, b"{}", "application/json", {"X-Name": "caf\u00e9"}),
    "reserved header": (200, b"{}", "application/json", {"server": "mine", "Date": "yesterday"}),
    "header with a tab": (200, b"{}", "application/json", {"X-T": "a\tb"}),
}
ANSWERS: list[Answer] = []


def answer(case: str) -> Answer:
    status, body, content_type, headers = CASES[case]
    made = Answer(body, status, content_type, headers)
    ANSWERS.append(made)
    return made


def response(case: str) -> web.Response:
    """What forward.py and errors.py built before ``Answer``."""
    status, body, content_type, headers = CASES[case]
    return web.Response(status=status, body=body, headers={**headers, "Content-Type": content_type})


async def handler(request: web.Request) -> web.StreamResponse:
    case = request.match_info["case"]
    if request.headers.get("X-Drain"):
        close_after_response(request)
    return answer(case) if request.match_info["kind"] == "answer" else response(case)


@contextlib.asynccontextmanager
async def serving(runner: web.BaseRunner):
    """``runner`` set up on a free port of 127.0.0.1: the port."""
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.fixture
async def server():
    app = web.Application()
    app.router.add_route("*", "/{kind}/{case}", handler)
    ANSWERS.clear()
    async with serving(web.AppRunner(app, access_log=None)) as port:
        yield port


PROBE = b"POST /response/json HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"


async def exchange(port: int, *requests: bytes) -> tuple[list[bytes], bool]:
    return await wire_compare.exchange(port, *requests, probe=PROBE)


def request(method: str, case: str, kind: str, version: str = "1.1", extra: str = "") -> bytes:
    return (f"{method} /{kind}/{case.replace(' ', '%20')} HTTP/{version}\r\nHost: x\r\n{extra}"
            "Content-Length: 0\r\n\r\n").encode()


@pytest.mark.parametrize("case", CASES)
async def test_one_buffer_same_bytes_as_web_response(server, case):
    mine, closed = await exchange(server, request("POST", case, "answer"), request("GET", case, "answer"))
    theirs, _ = await exchange(server, request("POST", case, "response"))
    assert not closed  # kept alive, as web.Response keeps it
    for got in mine:
        assert_same(got, theirs[0])
    fast = case not in ("reserved header",)
    assert [a._fallback is None for a in ANSWERS] == [fast, fast]


FALLBACKS = {
    "HTTP/1.0": ("POST", "1.0", ""),
    "HTTP/1.0 keep-alive": ("POST", "1.0", "Connection: keep-alive\r\n"),
    "Connection: close": ("POST", "1.1", "Connection: close\r\n"),
    "the shutdown's drain": ("POST", "1.1", "X-Drain: 1\r\n"),
    "HEAD": ("HEAD", "1.1", ""),
}


@pytest.mark.parametrize("exchange_kind", FALLBACKS)
@pytest.mark.parametrize("case", ["json", "text", "empty body"])
async def test_handed_to_web_response(server, exchange_kind, case):
    method, version, extra = FALLBACKS[exchange_kind]
    mine, mine_closed = await exchange(server, request(method, case, "answer", version, extra))
    theirs, theirs_closed = await exchange(server, request(method, case, "response", version, extra))
    assert_same(mine[0], theirs[0])
    assert mine_closed == theirs_closed
    assert ANSWERS[0]._fallback is not None
    if extra == "X-Drain: 1\r\n" or extra == "Connection: close\r\n":
        assert b"\r\nConnection: close\r\n" in mine[0] and mine_closed


async def test_header_injection_refused_as_web_response_refuses_it(server):
    """aiohttp refuses to send the header and drops the connection: the same for an Answer."""
    CASES["injected"] = (200, b"{}", "application/json", {"X-Evil": "a\r\nSet-Cookie: x=1"})
    try:
        for kind in ("answer", "response"):
            with pytest.raises(asyncio.IncompleteReadError) as dropped:
                await exchange(server, request("POST", "injected", kind))
            assert dropped.value.partial == b""
    finally:
        del CASES["injected"]


async def test_on_response_prepare_handler_sees_and_changes_the_answer():
    seen = []

    async def on_prepare(req, resp):
        seen.append(resp.status)
        resp.headers["X-Prepared"] = "yes"

    app = web.Application()
    app.router.add_route("*", "/{kind}/{case}", handler)
    app.on_response_prepare.append(on_prepare)
    async with serving(web.AppRunner(app, access_log=None)) as port:
        mine, _ = await exchange(port, request("POST", "json", "answer"))
        theirs, _ = await exchange(port, request("POST", "json", "response"))
    assert seen == [200] * 4  # each answer and each probe
    assert b"\r\nX-Prepared: yes\r\n" in mine[0]
    assert_same(mine[0], theirs[0])


async def test_low_level_server_and_body_length():
    """On aiohttp's low-level server (the hot routes: a plain BaseRequest), the one-buffer path,
    and the bytes counted as aiohttp counts them."""
    sent = []

    async def low_level(req: web.BaseRequest) -> web.StreamResponse:
        made = Answer(b'{"a":1}', 201, headers={"X-A": "b"}) if req.path.startswith("/answer/") \
            else web.Response(status=201, body=b'{"a":1}', headers={"X-A": "b", "Content-Type": "application/json"})
        sent.append(made)
        return made

    async with serving(web.ServerRunner(web.Server(low_level))) as port:
        mine, closed = await exchange(port, request("POST", "x", "answer"))
        theirs, _ = await exchange(port, request("POST", "x", "response"))
    assert_same(mine[0], theirs[0])
    assert not closed
    assert sent[0]._fallback is None and sent[0].keep_alive is True
    assert sent[0].body_length == sent[1].body_length == len(mine[0])
    assert sent[0].prepared and sent[0].status == 201 and sent[0].reason == "Created"


async def test_the_gateway_registers_no_on_response_prepare_handler_and_answers_in_one_buffer(gw):
    """What the one-buffer path relies on in the gateway: no handler may change an answer's headers
    as it is prepared; a JSON answer and an error come with aiohttp's headers, in its order."""
    assert not gw.gateway.app.on_response_prepare
    port = int(gw.url.rsplit(":", 1)[1])
    body = b'{"model":"%s","prompt":"Hi","max_tokens":2}' % MODEL.encode()
    key = gw.headers()["Authorization"].encode()
    answered, _ = await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + key
                                 + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    refused, _ = await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    for got, status in ((answered[0], b"200 OK"), (refused[0], b"401 Unauthorized")):
        lines = got.partition(b"\r\n\r\n")[0].split(b"\r\n")
        assert lines[0] == b"HTTP/1.1 " + status
        assert [line.split(b":")[0] for line in lines[1:]] == [
            b"X-Neocloud-Generation-Id", b"Content-Type", b"Content-Length", b"Date", b"Server"][-len(lines) + 1:]
