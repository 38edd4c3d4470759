"""Upstreams whose answer is not HTTP (letters for a status, no status line, four digits, status 000, chunks
that are not chunks), through a real gateway on real ports in front of a raw upstream: a 502
``upstream_bad_response`` with its row, streamed or not; such answers mark the upstream down like refusals, a
request fails over from them, and with nothing left the last failure names the code."""

import asyncio
from contextlib import asynccontextmanager

import pytest
from closed_ports import refused_port
from rawhttp import raw_server, read_request

from kilnproxy.testing import MODEL

GEN = "X-Neocloud-Generation-Id"
DEAD = f"http://127.0.0.1:{refused_port()}/v1"


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
