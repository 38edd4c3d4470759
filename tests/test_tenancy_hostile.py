"""The runtime tenancy admin API against hostile and edge-case input, on real servers.

Each test holds one defect a bug hunt found (times before year 1000, out-of-range numbers, bodies
with a Content-Encoding, config reloads that would orphan runtime keys) to the documented answer:
the exact status and error code, and nothing changed by a refusal.
"""

import gzip
import logging
import sqlite3
import zlib

import orjson

from test_admin_api import api

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
