"""The runtime tenancy admin API against hostile and edge-case input, on real servers.

Each test holds one defect a bug hunt found (times before year 1000, out-of-range numbers, bodies
with a Content-Encoding, config reloads that would orphan runtime keys) to the documented answer:
the exact status and error code, and nothing changed by a refusal.
"""

import gzip
import logging
import signal
import sqlite3
import zlib

import aiohttp
import orjson
from admin_calls import api, call
from processes import GatewayProcess, gateway_config

from kilnproxy.testing import completion_body


async def status_of_completion(h, secret):
    async with h.post("/v1/completions", completion_body(), key=secret) as resp:
        body = await resp.json()
        return resp.status, body["error"]["code"] if resp.status != 200 else None


async def test_an_expiry_before_year_1000_is_stored_with_four_digits(gw):
    a = api(gw)
    _, good = await a("POST", "/admin/v1/keys", {"org": "acme", "name": "good"})
    for given, stored in (("0999-01-01T00:00:00Z", "0999-01-01T00:00:00.000+00:00"),
                          ("1000-01-01T00:00:00+01:00", "0999-12-31T23:00:00.000+00:00")):
        status, made = await a("POST", "/admin/v1/keys", {"org": "acme", "name": "old", "expires_at": given})
        assert (status, made["data"]["expires_at"]) == (201, stored)
        assert await status_of_completion(gw, made["key"]) == (401, "invalid_api_key")
    assert await status_of_completion(gw, good["key"]) == (200, None)
    status, revoked = await a("DELETE", f"/admin/v1/keys/{good['data']['id']}")
    assert (status, revoked["revoked"]) == (200, True)
    assert await status_of_completion(gw, good["key"]) == (401, "invalid_api_key")
    status, disabled = await a("PATCH", "/admin/v1/keys/" + made["data"]["id"], {"disabled": True})
    assert (status, disabled["disabled"]) == (200, True)


async def test_a_stored_expiry_that_cannot_be_read_refuses_that_key_alone(harness, caplog):
    async with harness() as h:
        a = api(h)
        _, good = await a("POST", "/admin/v1/keys", {"org": "acme", "name": "good"})
        _, old = await a("POST", "/admin/v1/keys", {"org": "acme", "name": "old",
                                                    "expires_at": "2099-01-01T00:00:00Z"})
    old_id = old["data"]["id"]
    with sqlite3.connect(h.db) as conn:  # as an older version wrote it
        conn.execute("UPDATE kiln_keys SET expires_at = '999-01-01T00:00:00.000+00:00' WHERE id = ?", (old_id,))
    caplog.set_level(logging.WARNING, "kilnproxy.tenancy")
    async with harness() as h:  # the gateway starts on this store
        a = api(h)
        assert await status_of_completion(h, old["key"]) == (401, "invalid_api_key")
        assert await status_of_completion(h, good["key"]) == (200, None)
        assert (await a("DELETE", f"/admin/v1/keys/{good['data']['id']}"))[0] == 200
        assert await status_of_completion(h, good["key"]) == (401, "invalid_api_key")
        assert (await a("POST", "/admin/v1/orgs", {"id": "beta"}))[0] == 201
        status, mended = await a("PATCH", f"/admin/v1/keys/{old_id}", {"expires_at": "2099-01-01T00:00:00Z"})
        assert (status, mended["expires_at"]) == (200, "2099-01-01T00:00:00.000+00:00")
        assert await status_of_completion(h, old["key"]) == (200, None)
    warnings = [r.getMessage() for r in caplog.records if r.name == "kilnproxy.tenancy"]
    assert len(warnings) == 1 and old_id in warnings[0], warnings


async def test_grants_are_bounded_so_that_their_sum_stays_finite(gw):
    a = api(gw)
    await a("POST", "/admin/v1/orgs", {"id": "beta"})
    for reference in ("a", "b"):
        assert (await a("POST", "/admin/v1/orgs/beta/grants", {"amount": 1e12, "reference": reference}))[0] == 201
    status, refused = await a("POST", "/admin/v1/orgs/beta/grants", {"amount": 1e308, "reference": "c"})
    assert (status, refused["error"]["code"], refused["error"]["param"]) == (400, "invalid_request", "amount")
    assert (await a("POST", "/admin/v1/orgs/beta/grants", {"amount": -1e12, "reference": "fix"}))[0] == 201
    status, beta = await a("GET", "/admin/v1/orgs/beta")
    assert (status, beta["granted"], beta["remaining"]) == (200, 1e12, 1e12)


async def test_a_body_too_large_is_request_too_large(harness):
    async with harness(overrides={"server": {"max_request_bytes": 1000}}) as h:
        a = api(h)
        big = orjson.dumps({"id": "big", "pad": "x" * 2000})
        for path in ("/admin/v1/orgs", "/admin/v1/orgs/acme/grants", "/admin/v1/keys"):
            status, answer = await a("POST", path, raw=big)
            assert (status, answer["error"]["code"]) == (413, "request_too_large"), path
        status, answer = await a("POST", "/admin/v1/orgs", raw=gzip.compress(big),
                                 headers={"Content-Encoding": "gzip"})
        assert (status, answer["error"]["code"]) == (413, "request_too_large")  # decoded, it is too large
        assert (await a("GET", "/admin/v1/orgs/big"))[0] == 404


async def test_a_body_is_decoded_as_the_completions_bodies_are(gw):
    a = api(gw)
    for id, encoding, raw in (("gz", "gzip", gzip.compress(b'{"id": "gz"}')),
                              ("xgz", "x-gzip", gzip.compress(b'{"id": "xgz"}')),
                              ("zl", "deflate", zlib.compress(b'{"id": "zl"}')),
                              ("plain", "identity", b'{"id": "plain"}')):
        status, made = await a("POST", "/admin/v1/orgs", raw=raw, headers={"Content-Encoding": encoding})
        assert (status, made["id"]) == (201, id), encoding
    for encoding in ("br", "gzip, gzip"):
        status, answer = await a("POST", "/admin/v1/orgs", raw=b'{"id": "br"}', headers={"Content-Encoding": encoding})
        assert (status, answer["error"]["code"]) == (415, "unsupported_content_encoding"), encoding
    status, answer = await a("POST", "/admin/v1/orgs", raw=b'{"id": "bad"}', headers={"Content-Encoding": "gzip"})
    assert (status, answer["error"]["code"], answer["error"]["param"]) == (400, "invalid_request", None)
    assert [o["id"] for o in (await a("GET", "/admin/v1/orgs"))[1]["data"]] == [
        "acme", "globex", "gz", "plain", "xgz", "zl"]


async def reload_refused(gw, session, says):
    """POST /admin/reload and SIGHUP both refuse the config on disk with one line that ``says`` it all."""
    async with session.post(f"{gw.url}/admin/reload") as resp:
        error = (await resp.json())["error"]
        assert (resp.status, error["code"]) == (422, "config_invalid")
    assert error["message"] == f"{gw.config_path}: {says}"
    gw.send(signal.SIGHUP)
    line = (await gw.wait_for("stderr", "config reload refused", count=2))[1]
    assert line.endswith(f"config reload refused, the running config stays in force: {gw.config_path}: {says}")


async def start_refused(tmp_path, config, says):
    gw = await GatewayProcess(tmp_path, config).start_without_banner()
    try:
        assert await gw.wait() == 2
        # the gateway before it was killed (``gw.stop``): a last row still in the row journal is inserted
        # at this start, which the log says first
        err = [line for line in gw.lines["stderr"] if line.strip() and "of responses that ended before" not in line]
        assert len(err) == 1 and err[0].endswith(says), err
    finally:
        await gw.stop()


async def test_a_config_dropping_an_org_with_runtime_keys_or_grants_is_refused(tmp_path, mock_url):
    config = gateway_config([mock_url])
    gw = await GatewayProcess(tmp_path, config).start()
    dropped = {**config, "orgs": config["orgs"][:1], "keys": config["keys"][:1]}
    says = ("[[orgs]] has no org 'globex', which still has 1 runtime key(s) and grants of 5 USD in the store "
            "(kilnproxy keys / the admin API): keep its [[orgs]] entry")
    try:
        async with aiohttp.ClientSession() as s:
            a = lambda method, path, body=None: call(s, gw.url, method, path, body)  # noqa: E731
            _, made = await a("POST", "/admin/v1/keys", {"org": "globex", "name": "rt"})
            assert (await a("POST", "/admin/v1/orgs/globex/grants", {"amount": 5, "reference": "r1"}))[0] == 201
            gw.write_config(dropped)
            await reload_refused(gw, s, says)
            status, globex = await a("GET", "/admin/v1/orgs/globex")
            assert (status, globex["granted"], globex["source"]) == (200, 105.0, "config")
            async with s.post(f"{gw.url}/v1/completions", json=completion_body(),
                               headers={"Authorization": f"Bearer {made['key']}"}) as resp:
                assert resp.status == 200
    finally:
        await gw.stop()
    await start_refused(tmp_path, dropped, says)


async def test_a_config_key_with_a_runtime_keys_secret_is_refused(tmp_path, mock_url):
    config = gateway_config([mock_url])
    gw = await GatewayProcess(tmp_path, config).start()
    try:
        async with aiohttp.ClientSession() as s:
            _, made = await call(s, gw.url, "POST", "/admin/v1/keys", {"org": "acme", "name": "rt"})
            assert (await call(s, gw.url, "DELETE", f"/admin/v1/keys/{made['data']['id']}"))[0] == 200
            collides = {**config, "keys": [*config["keys"], {"key": made["key"], "org": "globex", "id": "dupcfg"}]}
            says = (f"[[keys]] 'dupcfg' has the same secret as the runtime key '{made['data']['id']}' "
                    "(kilnproxy keys / the admin API): give 'dupcfg' another secret")
            gw.write_config(collides)
            await reload_refused(gw, s, says)
            async with s.post(f"{gw.url}/v1/completions", json=completion_body(),
                              headers={"Authorization": f"Bearer {made['key']}"}) as resp:
                assert (resp.status, (await resp.json())["error"]["code"]) == (401, "invalid_api_key")
    finally:
        await gw.stop()
    await start_refused(tmp_path, collides, says)
