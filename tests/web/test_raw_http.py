"""What an HTTP client library would refuse to send, over a raw socket to a real gateway process.

aiohttp's parser refuses these before any handler; the gateway answers them with its
JSON 400 ``malformed_http`` and the security headers. What must hold besides is that nothing reaches a handler
half-parsed (no usage row, nothing sent upstream), that the gateway logs one
line per such request and no traceback, and that it goes on serving.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import pytest_asyncio
from hostile_target import BUG_SIGNS, Target
from rawhttp import address, exchange, exchange_all, read_response

from kilnproxy.inspector.api import NO_STORE, SECURITY_HEADERS
from kilnproxy.testing import KEY

pytestmark = pytest.mark.asyncio(loop_scope="module")

BODY = b'{"model":"test-model","prompt":"hi","max_tokens":2}'
AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"


def post(extra: bytes = b"", body: bytes = BODY, length: int | None = None,
         line: bytes = b"POST /v1/completions HTTP/1.1") -> bytes:
    head = line + b"\r\nHost: 127.0.0.1\r\n" + AUTH + extra
    if length is not False:
        head += b"Content-Length: %d\r\n" % (len(body) if length is None else length)
    return head + b"\r\n" + body


CHUNKED = b"Transfer-Encoding: chunked\r\n"
MALFORMED = {
    "body longer than announced": post(body=BODY + b"GARBAGE / HTTP/1.1\r\n\r\n", length=len(BODY)),
    "header line without a colon": post(b"NoColonHere\r\n"),
    "space before the colon": post(b"Content-Type : application/json\r\n"),
    "obsolete line folding": post(b"X-A: a\r\n  folded\r\n"),
    "NUL in a header value": post(b"X-A: a\x00b\r\n"),
    "CR alone in a header value": post(b"X-A: a\rb\r\n"),
    "200 headers": post(b"".join(b"X-H%d: v\r\n" % i for i in range(200))),
    "a 20 KiB request line": post(line=b"POST /v1/completions?" + b"a" * 20_000 + b" HTTP/1.1"),
    "a 20 KiB header": post(b"X-Big: " + b"a" * 20_000 + b"\r\n"),
    "Content-Length and Transfer-Encoding": post(CHUNKED),
    "two Content-Lengths": post(b"Content-Length: 5\r\n"),
    "a negative Content-Length": post(length=-1),
    "a Content-Length that is not a number": post(b"Content-Length: 12abc\r\n", length=False),
    "a chunk size that is not hex": post(CHUNKED, body=b"zz\r\n" + BODY + b"\r\n0\r\n\r\n", length=False),
    "bare LF line ends": post().replace(b"\r\n", b"\n"),
    "an unknown method": post(line=b"BREW /v1/completions HTTP/1.1"),
    "an HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "an unknown HTTP version": post(line=b"POST /v1/completions HTTP/7.1"),
    "an asterisk target on GET": b"GET * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "TLS on the plain port": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32),
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(tmp_path_factory):
    t = await Target(tmp_path_factory.mktemp("raw")).start()
    yield t
    await t.stop()


async def mock_requests(target: Target) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{target.mock.url.removesuffix('/v1')}/mock/stats") as r:
            return (await r.json())["requests"]


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_malformed_http_is_400_before_any_handler(target, name):
    rows, upstream = target.row_count(), await mock_requests(target)
    answers = await exchange_all(target.url, MALFORMED[name], post())
    assert answers, "no answer at all"
    assert 400 <= answers[0].status < 500, answers[0]
    assert "x-neocloud-generation-id" not in answers[0].headers
    assert (answers[0].status, answers[0].error_code, answers[0].closed) == (400, "malformed_http", True)
    if len(answers) == 2:  # the connection survived: the next request is served as usual
        target.check(answers[1], method="POST", path="/v1/completions", known_key=True)
        assert answers[1].status == 200
    assert target.row_count() == rows + (len(answers) == 2)
    assert await mock_requests(target) == upstream + (len(answers) == 2)
    ok = await exchange(target.url, post())
    target.check(ok, method="POST", path="/v1/completions", known_key=True)
    assert ok.status == 200


async def test_a_body_shorter_than_announced_is_never_forwarded(target, eventually):
    """The client sends part of its body and leaves: one row (499, client closed), nothing upstream."""
    rows, upstream = target.row_count(), await mock_requests(target)
    reader, writer = await asyncio.open_connection(*address(target.url))
    writer.write(post(length=len(BODY) + 100))
    await writer.drain()
    writer.write_eof()
    with pytest.raises(asyncio.IncompleteReadError):  # no answer: the client is gone
        await read_response(reader)
    writer.close()
    await eventually(lambda: target.row_count() == rows + 1)
    status, code = target._db.execute("SELECT status, error_code FROM usage_events ORDER BY rowid DESC").fetchone()
    assert (status, code) == (499, None)
    target.unanswered_rows += 1
    assert await mock_requests(target) == upstream


async def test_the_log_has_one_line_per_malformed_request_and_no_traceback(target, eventually):
    """Its own malformed requests, each on a connection of its own, and the lines they logged (those
    of the module's other tests before them are not counted: it passes alone as in the module)."""
    stderr = target.gateway.lines["stderr"]
    before = len(stderr)
    for data in MALFORMED.values():
        await exchange_all(target.url, data)

    def refused() -> list[str]:
        return [line for line in stderr[before:] if "refused a malformed request" in line]

    # aiohttp logs a bad method on a connection's first request (TLS, an HTTP/2 preface, BREW: port
    # scanners) at debug level only; every other malformed request is one INFO line.
    await eventually(lambda: len(refused()) >= len(MALFORMED) - 3)
    await target.check_end(eventually)
    assert all(len(line) < 400 for line in refused())
    assert not [line for line in stderr if any(s in line for s in BUG_SIGNS)]


PARSER_REFUSED = {
    "a header line without a colon": b"GET /ui/ HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    "a bare LF line": b"GET /ui/ HTTP/1.1\r\nHost: x\r\n\n\r\n",
    "an invalid method token": b"G(T /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "a malformed POST": post(b"NoColonHere\r\n"),
}
MALFORMED_HTTP_BODY = (b'{"error":{"message":"The request is not valid HTTP/1.1; it was not read.",'
                       b'"type":"invalid_request_error","param":null,"code":"malformed_http"}}')


@pytest.mark.parametrize("name", list(PARSER_REFUSED))
async def test_a_request_the_parser_refuses_gets_the_gateways_json_error_and_security_headers(target, name):
    """The parser's 400 is made for no request (its path cannot be trusted, ``/ui`` or not): the
    gateway's JSON error, the inspector page's security headers, and the connection closed."""
    [answer] = await exchange_all(target.url, PARSER_REFUSED[name], post())
    assert answer.status == 400
    assert answer.body == MALFORMED_HTTP_BODY
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["connection"] == "close"
    assert answer.closed
    for header, value in {**SECURITY_HEADERS, **NO_STORE}.items():
        assert answer.headers[header.lower()] == value
