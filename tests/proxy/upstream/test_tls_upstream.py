"""An ``https://`` upstream (a model server behind a TLS-terminating proxy): the gateway's own client
verifies its certificate against the system's CAs, or the file ``SSL_CERT_FILE`` names (read when the
gateway first connects to that upstream), keeps the connection alive, and streams through it; a
certificate it cannot verify is the contract's 502 ("Bad gateway: ...", saying why) with an
``upstream_unreachable`` row, never a 500.

The certificates are made for each run with the ``openssl`` command: a CA, and a certificate it signed
for 127.0.0.1."""

from __future__ import annotations

import ssl

import pytest
from aiohttp import web
from tls import certificates  # noqa: F401 (a fixture: the test CA and a certificate it signed)

from kilnproxy.mock_servers.mock_upstream import create_mock_app
from kilnproxy.testing import completion_body


@pytest.fixture
async def tls_mock(certificates):
    """The mock upstream (vLLM-like) served over TLS: its ``https://.../v1`` base URL, and the count of
    TLS connections it accepted."""
    _, cert, key = certificates
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    accepted = []
    app = create_mock_app()

    @web.middleware
    async def count(request, handler):
        if request.transport not in accepted:
            accepted.append(request.transport)
        return await handler(request)
    app.middlewares.append(count)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = runner.addresses[0][1]
    yield f"https://127.0.0.1:{port}/v1", accepted
    await runner.cleanup()


async def test_a_verified_https_upstream_serves_answers_and_streams_on_one_kept_connection(
        harness, tls_mock, certificates, monkeypatch):
    url, accepted = tls_mock
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates[0]))
    async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
        async with h.post("/v1/completions", completion_body()) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        async with h.post("/v1/completions", completion_body(stream=True)) as resp:
            assert resp.status == 200
            raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n") and b'"usage"' in raw
        rows = await h.rows()
        assert [(r["status"], r["error_code"], r["stream"]) for r in rows] == [(200, None, 0), (200, None, 1)]
        assert rows[0]["completion_tokens"] == answer["usage"]["completion_tokens"] > 0
        assert rows[1]["completion_tokens"] > 0
        assert len(accepted) == 1  # the second request went out on the first one's connection


async def test_an_https_upstream_whose_certificate_cannot_be_verified_is_a_502_with_a_row(
        harness, tls_mock, monkeypatch, tmp_path):
    url, accepted = tls_mock
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))  # an empty folder of CAs: not even the system's
    async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
        for stream in (False, True):
            async with h.post("/v1/completions", completion_body(stream=stream)) as resp:
                assert (resp.status, resp.content_type) == (502, "text/plain")
                text = await resp.text()
            assert text.startswith(f"Bad gateway: {url}: ClientConnectorError") and "certificate verify failed" in text
        assert [(r["status"], r["error_code"]) for r in await h.rows()] == [(502, "upstream_unreachable")] * 2
        assert accepted == []  # no request reached it
