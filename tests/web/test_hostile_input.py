"""Bytes a client controls that once ended in a 500: each now gets a clear 4xx JSON error
(or a correct answer), is recorded once, and leaves the connection usable.

Sent over a raw socket (``rawhttp``) where a client library would refuse or rewrite them.
"""

import asyncio
import gzip
import zlib

import orjson
import pytest
from rawhttp import address, exchange, exchange_all, read_response, request

from kilnproxy.proxy.request_body import MAX_DEPTH
from kilnproxy.testing import KEY, MODEL, completion_body

GEN = "x-neocloud-generation-id"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = orjson.dumps(completion_body(max_tokens=3))
NOT_UTF8 = b"Bearer \xff\xfe\x80sk-test-acme"


def post(body: bytes, encoding: str | None = None, path: str = "/v1/completions", **headers) -> bytes:
    extra = {**AUTH, "Content-Type": "application/json", **headers}
    if encoding is not None:
        extra["Content-Encoding"] = encoding
    return request("POST", path, extra, body)


def assert_error(resp, status: int, code: str) -> None:
    assert resp.status == status, resp.body
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    assert resp.error_code == code, resp.body


# -- Authorization ------------------------------------------------------------------------


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("GET", "/v1/models"), ("GET", "/v1/credits"),
                                          ("GET", "/v1/generations/gen-1")])
async def test_a_token_that_is_not_utf8_is_an_unknown_key(gw, method, path):
    resp = await exchange(gw.url, request(method, path, {"Authorization": NOT_UTF8}, BODY))
    assert_error(resp, 401, "invalid_api_key")
    assert GEN not in resp.headers
    assert await gw.rows() == []


async def test_a_token_that_is_not_utf8_is_a_wrong_admin_or_inspector_token(harness):
    overrides = {"admin": {"token": "adm-secret", "allow_loopback": False}, "inspector": {"token": "ui-secret"}}
    async with harness(overrides=overrides) as h:
        for path in ("/metrics", "/ui/api/meta"):
            resp = await exchange(h.url, request("GET", path, {"Authorization": NOT_UTF8}))
            assert_error(resp, 401, "invalid_admin_token" if path == "/metrics" else "invalid_token")
        resp = await exchange(h.url, request("POST", "/admin/reload", {"Authorization": NOT_UTF8}))
        assert_error(resp, 401, "invalid_admin_token")
        resp = await exchange(h.url, request("GET", "/ui/api/meta?token=%FF%FE"))
        assert_error(resp, 401, "invalid_token")


# -- Content-Encoding ---------------------------------------------------------------------


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize("encoding, encode", [("gzip", gzip.compress), ("x-gzip", gzip.compress),
                                              ("GZIP", gzip.compress), ("deflate", zlib.compress),
                                              ("deflate", raw_deflate), ("identity", bytes)])
async def test_a_compressed_body_is_decoded(gw, encoding, encode):
    resp = await exchange(gw.url, post(encode(BODY), encoding))
    assert resp.status == 200, resp.body
    assert resp.json()["usage"]["completion_tokens"] == 3
    assert (await gw.mock_requests())[-1]["body"]["prompt"] == "The capital of France is"
    assert (await gw.row(resp.headers[GEN]))["status"] == 200


async def test_a_compressed_body_without_content_length_is_decoded(gw):
    packed = gzip.compress(BODY)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed)
    resp = await exchange(gw.url, request("POST", "/v1/completions", {**AUTH, "Content-Encoding": "gzip",
                                                                      "Transfer-Encoding": "chunked"}, chunked))
    assert resp.status == 200, resp.body


# ids of their own: gzip's bytes hold the time, and an id made of them would differ between pytest-xdist's
# workers, which must collect the very same tests
@pytest.mark.parametrize("encoding, body, message", [
    ("gzip", BODY, "not valid gzip data"),
    ("deflate", b"\x78\x9c\xff\xff\xff", "not valid deflate data"),
    ("gzip", gzip.compress(BODY)[:-12], "not one complete gzip stream"),
    ("gzip", gzip.compress(BODY) + b"trailing", "not one complete gzip stream"),
], ids=["not gzip", "not deflate", "gzip cut short", "gzip and bytes after it"])
async def test_a_body_that_does_not_decode_is_400_and_the_connection_stays_usable(gw, encoding, body, message):
    first, second = await exchange_all(gw.url, post(body, encoding), post(BODY))
    assert_error(first, 400, "invalid_request")
    assert message in first.json()["error"]["message"]
    assert second.status == 200, second.body  # the same kept-alive connection
    assert [r["status"] for r in await gw.rows()] == [400, 200]


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, gzip", "gzip, br", "bogus"])
async def test_other_encodings_are_415(gw, encoding):
    first, second = await exchange_all(gw.url, post(BODY, encoding), post(BODY))
    assert_error(first, 415, "unsupported_content_encoding")
    assert second.status == 200
    assert (await gw.row(first.headers[GEN]))["error_code"] == "unsupported_content_encoding"
    assert len(await gw.mock_requests()) == 1


async def test_two_content_encoding_lines_are_a_list_of_encodings(gw):
    data = request("POST", "/v1/completions", [*AUTH.items(), ("Content-Encoding", "gzip"),
                                               ("Content-Encoding", "br")], gzip.compress(BODY))
    assert_error(await exchange(gw.url, data), 415, "unsupported_content_encoding")


async def test_the_size_limit_applies_to_the_decoded_body(harness):
    async with harness(overrides={"server": {"max_request_bytes": 4000}}) as h:
        bomb = gzip.compress(orjson.dumps(completion_body(prompt="a" * 100_000)))
        assert len(bomb) < 4000 / 10
        resp = await exchange(h.url, post(bomb, "gzip"))
        assert_error(resp, 413, "request_too_large")
        fits = gzip.compress(orjson.dumps(completion_body(prompt="b" * 3900)))
        assert (await exchange(h.url, post(fits, "gzip"))).status == 200
        assert len(await h.mock_requests()) == 1


async def test_a_body_that_does_not_arrive_in_time_is_408(harness):
    """A client that announces more than it sends (or trickles it) holds a connection for
    ``request_body_timeout`` at most, never for ever."""
    async with harness(overrides={"server": {"request_body_timeout": 0.2}}) as h:
        resp = await exchange(h.url, post(BODY, **{"Content-Length": str(len(BODY) + 100)}))
        assert_error(resp, 408, "request_timeout")
        assert (await h.row(resp.headers[GEN]))["status"] == 408
        assert await h.mock_requests() == []


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_a_body_that_comes_after_its_headers_in_pieces_is_read_whole(gw, framing):
    """The body is read from the socket as it comes (the usual body came with its headers)."""
    prompt = "p" * 3000
    body = orjson.dumps(completion_body(prompt=prompt, max_tokens=2))
    if framing == "length":
        data = post(body)
    else:
        data = request("POST", "/v1/completions", {**AUTH, "Content-Type": "application/json",
                                                   "Transfer-Encoding": "chunked"}, chunked(body[:1000], body[1000:]))
    head_end = data.index(b"\r\n\r\n") + 4
    reader, writer = await asyncio.open_connection(*address(gw.url))
    try:
        for start in range(0, len(data), head_end + 700):  # the head and a part, then the rest in parts
            writer.write(data[start:start + head_end + 700])
            await writer.drain()
            await asyncio.sleep(0.02)  # apart on the wire, so that the handler waits for the rest
        resp = await read_response(reader)
    finally:
        writer.close()
    assert resp.status == 200, resp.body
    assert (await gw.mock_requests())[-1]["body"]["prompt"] == prompt


async def test_a_chunked_body_over_the_limit_that_came_whole_is_413(harness):
    async with harness(overrides={"server": {"max_request_bytes": 1000}}) as h:
        body = orjson.dumps(completion_body(prompt="z" * 1200))
        data = request("POST", "/v1/completions", {**AUTH, "Content-Type": "application/json",
                                                   "Transfer-Encoding": "chunked"}, chunked(body[:600], body[600:]))
        resp = await exchange(h.url, data)
        assert_error(resp, 413, "request_too_large")
        assert await h.mock_requests() == []


# -- depth ---------------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    """A body whose ``prompt`` is ``depth`` levels deep in all (the body itself is level 1)."""
    inner = depth - 1
    return b'{"model":"%s","max_tokens":2,"prompt":%s"x"%s}' % (MODEL.encode(), b"[" * inner, b"]" * inner)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 255, 256, 700, 1024, 1025, 5000])
async def test_a_body_nested_too_deep_is_400_before_anything_else(gw, depth):
    resp = await exchange(gw.url, post(nested(depth)))
    assert_error(resp, 400, "invalid_request")
    row = await gw.row(resp.headers[GEN])
    assert (row["status"], row["model"]) == (400, None)  # refused before the model was looked at
    assert await gw.mock_requests() == []


async def test_a_body_nested_up_to_the_limit_is_forwarded(gw):
    resp = await exchange(gw.url, post(nested(MAX_DEPTH)))
    assert resp.status == 200, resp.body
    sent = (await gw.mock_requests())[0]["body"]["prompt"]
    for _ in range(MAX_DEPTH - 1):
        sent = sent[0]
    assert sent == "x"


# -- Expect, and what no route serves ---------------------------------------------------------


@pytest.mark.parametrize("expect", ["100-continue", "bogus", b"\xff\xfe"])
async def test_any_expect_header_gets_the_usual_answer(gw, expect):
    resp = await exchange(gw.url, post(BODY, Expect=expect))
    assert resp.status == 200, resp.body
    assert (await gw.row(resp.headers[GEN]))["status"] == 200


@pytest.mark.parametrize("method, path, status, code", [
    ("PUT", "/v1/completions", 405, "method_not_allowed"), ("DELETE", "/metrics", 405, "method_not_allowed"),
    ("GET", "/no/such/path", 404, "not_found"), ("POST", "/ui/api/nothing", 404, "not_found")])
@pytest.mark.parametrize("expect", [None, "bogus", b"\xff"])
async def test_what_no_route_serves_is_a_json_error_whatever_the_expect_header(gw, method, path, status, code,
                                                                               expect):
    headers = {} if expect is None else {"Expect": expect}
    resp = await exchange(gw.url, request(method, path, headers))
    assert_error(resp, status, code)
    if status == 405:
        assert resp.headers["allow"] in ("POST", "GET,HEAD")


@pytest.mark.parametrize("path", ["/v1/models/%0A", "/x%0Ay", "/%0D%0A"])
@pytest.mark.parametrize("expect", [None, "bogus", b"\x80"])
async def test_a_path_with_a_newline_is_a_json_404(gw, path, expect):
    """Found by the long fuzz run: a path no route's ``.`` matched got aiohttp's own 404, or with an
    ``Expect`` header that is not UTF-8, its 500."""
    resp = await exchange(gw.url, request("GET", path, {} if expect is None else {"Expect": expect, **AUTH}))
    assert_error(resp, 404, "not_found")


async def test_the_mock_answers_odd_messages_as_vllm_does(gw):
    """Found by the long fuzz run: the mock crashed (500, so the gateway's 502) on a number as
    ``messages``; vLLM's validation answers 400, which the gateway passes through."""
    resp = await exchange(gw.url, post(orjson.dumps({"model": MODEL, "messages": 1})))
    assert resp.status == 400 and resp.json()["error"]["type"] == "BadRequestError"
    assert (await gw.row(resp.headers[GEN]))["status"] == 400
