"""/metrics, /admin/* and the inspector share one access rule (kilnproxy.access).

A browser on the gateway's machine must not let a page of another site read or
drive them: under DNS rebinding the page's requests come from loopback but carry
its own name as ``Host``; a cross-site form or ``fetch`` carries its ``Origin``.
The ``[admin]`` token opens all three from anywhere.
"""

import pytest
from rawhttp import exchange, request

ADMIN = {"admin": {"token": "adm-secret"}}
SURFACES = [("GET", "/metrics"), ("POST", "/admin/reload"), ("GET", "/ui/api/meta"), ("GET", "/ui/")]


def assert_admitted(resp, path):
    if path == "/admin/reload":  # past the access rule; the harness has no config file to read again
        assert (resp.status, resp.error_code) == (422, "config_invalid"), resp.body
    else:
        assert resp.status == 200, resp.body


def assert_refused(resp, status=403, code="forbidden"):
    assert resp.status == status, resp.body
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.error_code == code


@pytest.mark.parametrize("method, path", SURFACES)
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "10.0.0.1:8080"])
async def test_a_foreign_host_header_is_refused_from_loopback(gw, method, path, host):
    assert_refused(await exchange(gw.url, request(method, path, {"Host": host})))


@pytest.mark.parametrize("method, path", SURFACES)
@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost:3000", "null"])
async def test_a_page_of_another_origin_is_refused(gw, method, path, origin):
    port = gw.gateway.port
    assert_refused(await exchange(gw.url, request(method, path, {"Host": f"localhost:{port}", "Origin": origin})))


@pytest.mark.parametrize("method, path", SURFACES)
@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "localhost", "ui.localhost:{port}"])
async def test_local_requests_need_no_token(gw, method, path, host):
    host = host.format(port=gw.gateway.port)
    for headers in ({"Host": host}, {"Host": host, "Origin": f"http://{host}"}):
        assert_admitted(await exchange(gw.url, request(method, path, headers)), path)


@pytest.mark.parametrize("method, path", SURFACES)
async def test_the_admin_token_opens_every_surface_from_anywhere(harness, method, path):
    async with harness(overrides=ADMIN) as h:
        resp = await exchange(h.url, request(method, path, {"Host": "gw.example",
                                                            "Authorization": "Bearer adm-secret"}))
        assert_admitted(resp, path)
        if path != "/ui/":  # the page's own files hold no data: served to anyone once a token exists
            resp = await exchange(h.url, request(method, path, {"Host": "gw.example"}))
            assert_refused(resp, 401, "invalid_token" if path.startswith("/ui") else "invalid_admin_token")


async def test_the_inspector_takes_the_admin_token_as_a_query_or_beside_its_own(harness):
    async with harness(overrides={**ADMIN, "inspector": {"token": "ui-secret"}}) as h:
        for token in ("adm-secret", "ui-secret"):
            for headers, query in (({"Authorization": f"Bearer {token}"}, ""), ({}, f"?token={token}")):
                resp = await exchange(h.url, request("GET", f"/ui/api/requests{query}",
                                                     {"Host": "gw.example", **headers}))
                assert resp.status == 200, resp.body
        resp = await exchange(h.url, request("GET", "/ui/api/requests", {"Authorization": "Bearer sk-test-acme"}))
        assert_refused(resp, 401, "invalid_token")  # an API key is not an operator's token
        resp = await exchange(h.url, request("GET", "/metrics", {"Host": "gw.example",
                                                                 "Authorization": "Bearer ui-secret"}))
        assert_refused(resp, 401, "invalid_admin_token")  # the inspector's token is not the admin's
