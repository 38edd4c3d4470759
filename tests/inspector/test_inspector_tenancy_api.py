"""The JSON side of the inspector's "Orgs & keys" page (/ui/api/orgs, /ui/api/keys, grants):
the admin API's objects and refusals, behind the inspector's own access rule, on both stores."""

import gzip

import orjson
import pytest

from kilnproxy.testing import completion_body
from kilnproxy.usage import round_usd

ACME = {"id": "acme", "granted": 100.0, "spent": 0.0, "held": 0.0, "remaining": 100.0, "max_in_flight": None,
        "disabled": False, "source": "config", "requests_per_minute": None, "tokens_per_minute": None,
        "priority": "interactive", "weight": 1.0}
CONFIG_KEY = {"id": "acme-key", "name": "acme-key", "org": "acme", "role": "member", "prefix": "sk-test-",
              "models": None,
              "disabled": False, "revoked": False, "limit": None, "limit_reset": None, "usage": 0.0,
              "limit_remaining": None, "expires_at": None, "created_at": None, "source": "config",
              "requests_per_minute": None, "tokens_per_minute": None, "priority": None, "weight": None,
              "last_used": None}


async def call(h, method, path, body=None, *, raw=None, headers=None):
    data = raw if raw is not None else (None if body is None else orjson.dumps(body))
    async with h.session.request(method, f"{h.url}{path}", data=data, headers=headers or {}) as resp:
        return resp.status, orjson.loads(await resp.read())


async def complete(h, key):
    async with h.post("/v1/completions", completion_body(), key=key) as resp:
        await resp.read()
        return resp.status


async def tables(h):
    """Everything a change could touch: the audit log, the keys, the grants, the orgs."""
    store = h.gw.tenancy
    return (await store.list_events(limit=1000), await store.list_keys(), await store.list_grants("acme"),
            await store.list_orgs())


async def test_orgs_list_both_sources_with_their_balances(harness, store):
    async with harness(overrides=store) as h:
        await h.gw.tenancy.create_org("initech")
        assert await call(h, "GET", "/ui/api/orgs") == (200, {"data": [
            ACME, {**ACME, "id": "globex"},
            {**ACME, "id": "initech", "granted": 0.0, "remaining": 0.0, "source": "api"}]})


async def test_a_key_is_made_used_granted_for_and_revoked(harness, store):
    async with harness(overrides=store) as h:
        status, made = await call(h, "POST", "/ui/api/keys", {"org": "acme", "name": "ci", "limit": 1.5,
                                                              "limit_reset": "daily"})
        assert status == 201
        secret, key = made["key"], made["data"]
        assert secret.startswith("sk-") and len(secret) > 40
        assert key["id"].startswith("key_") and key["created_at"].endswith("+00:00")
        ci = {"id": key["id"], "name": "ci", "org": "acme", "role": "member", "prefix": secret[:8], "models": None,
              "disabled": False, "revoked": False, "limit": 1.5, "limit_reset": "daily", "usage": 0.0,
              "limit_remaining": 1.5, "expires_at": None, "created_at": key["created_at"], "source": "api",
              "requests_per_minute": None, "tokens_per_minute": None, "priority": None, "weight": None}
        assert made == {"key": secret, "data": ci}

        assert await complete(h, secret) == 200  # in force before the answer: no wait
        [row] = await h.rows(key_id=key["id"])
        status, listing = await call(h, "GET", "/ui/api/keys?org=acme")
        used = {**ci, "usage": row["cost"], "limit_remaining": round_usd(1.5 - row["cost"]),
                "last_used": row["created_at"]}
        assert (status, listing) == (200, {"data": [CONFIG_KEY, used]})
        assert secret not in orjson.dumps(listing).decode() and secret[8:] not in str(await tables(h))

        assert await call(h, "POST", "/ui/api/orgs/acme/grants", {"amount": 25, "reference": "inv-1"}) == (
            201, first := {**(await h.gw.tenancy.list_grants("acme"))[0]})
        assert (first["org"], first["amount"], first["reference"]) == ("acme", 25.0, "inv-1")
        assert await call(h, "POST", "/ui/api/orgs/acme/grants", {"amount": 99, "reference": "inv-1"}) == (
            200, first)  # a reference already used: the first grant, nothing added
        status, org = await call(h, "GET", "/ui/api/orgs")
        assert org["data"][0]["granted"] == 125.0
        assert await call(h, "GET", "/ui/api/orgs/acme/grants") == (200, {"data": [first]})

        status, revoked = await call(h, "DELETE", f"/ui/api/keys/{key['id']}")
        assert (status, revoked["revoked"], revoked["id"]) == (200, True, key["id"])
        assert await complete(h, secret) == 401
        events = await h.gw.tenancy.list_events()
        assert [(e["kind"], e["actor"]) for e in events] == [
            ("key.revoked", "inspector"), ("grant.created", "inspector"), ("key.created", "inspector")]


REFUSALS = [
    ("POST", "/ui/api/keys", b"{not json", 400, "invalid_request", None),
    ("POST", "/ui/api/keys", b"[]", 400, "invalid_request", None),
    ("POST", "/ui/api/keys", {"org": "acme"}, 400, "invalid_request", "name"),
    ("POST", "/ui/api/keys", {"org": "acme", "name": "x", "colour": "red"}, 400, "invalid_request", "colour"),
    ("POST", "/ui/api/keys", {"org": "acme", "name": "x", "limit": -1}, 400, "invalid_request", "limit"),
    ("POST", "/ui/api/keys", {"org": "acme", "name": "x", "limit": "5"}, 400, "invalid_request", "limit"),
    ("POST", "/ui/api/keys", {"org": "acme", "name": "x", "limit_reset": "hourly"}, 400, "invalid_request",
     "limit_reset"),
    ("POST", "/ui/api/keys", {"org": "acme", "name": "x", "expires_at": "soon"}, 400, "invalid_request",
     "expires_at"),
    ("POST", "/ui/api/keys", {"org": "acme", "name": "x", "expires_at": "9999-12-31T23:59:59-23:59"}, 400,
     "invalid_request", "expires_at"),
    ("POST", "/ui/api/keys", {"org": "nobody", "name": "x", "limit": -1}, 400, "invalid_request", "limit"),
    ("POST", "/ui/api/keys", {"org": "nobody", "name": "x"}, 404, "not_found", "org"),
    ("POST", "/ui/api/orgs/acme/grants", {"amount": "10", "reference": "r"}, 400, "invalid_request", "amount"),
    ("POST", "/ui/api/orgs/acme/grants", {"amount": 10}, 400, "invalid_request", "reference"),
    ("POST", "/ui/api/orgs/nobody/grants", {"amount": 10, "reference": "r"}, 404, "not_found", None),
    ("GET", "/ui/api/orgs/nobody/grants", None, 404, "not_found", None),
    ("GET", "/ui/api/keys?org=nobody", None, 404, "not_found", "org"),
    ("DELETE", "/ui/api/keys/key_nope", None, 404, "not_found", None),
    ("DELETE", "/ui/api/keys/acme-key", None, 409, "managed_by_config", None),
    ("GET", "/ui/api/orgs?x=1", None, 400, "invalid_request", "x"),
    ("GET", "/ui/api/keys?org=acme&foo=1", None, 400, "invalid_request", "foo"),
    ("GET", "/ui/api/orgs/acme/grants?org=acme", None, 400, "invalid_request", "org"),
    ("POST", "/ui/api/keys?dry_run=1", {"org": "acme", "name": "x"}, 400, "invalid_request", "dry_run"),
    ("POST", "/ui/api/orgs/acme/grants?amount=1", {"amount": 1, "reference": "q"}, 400, "invalid_request",
     "amount"),
    ("DELETE", "/ui/api/keys/key_nope?force=1", None, 400, "invalid_request", "force"),
]


@pytest.mark.parametrize("method, path, body, status, code, param", REFUSALS)
async def test_a_refused_request_names_the_field_and_changes_nothing(harness, method, path, body, status, code,
                                                                     param):
    async with harness() as h:
        await h.gw.tenancy.create_key("acme", "existing")
        await h.gw.tenancy.add_grant("acme", 5, "first")
        before = await tables(h)
        raw = body if isinstance(body, bytes) else None
        got, answer = await call(h, method, path, None if raw else body, raw=raw)
        assert (got, answer["error"]["code"], answer["error"]["param"]) == (status, code, param)
        assert await tables(h) == before
        assert await complete(h, None) == 200  # the config key still works


async def test_changes_need_the_token_in_the_header(harness):
    """With a token, a change takes it from ``Authorization`` only: a link (``?token=``) cannot make one."""
    async with harness(overrides={"inspector": {"token": "s3cret"}}) as h:
        body = {"amount": 1, "reference": "r"}
        assert (await call(h, "POST", "/ui/api/orgs/acme/grants", body))[0] == 401
        assert (await call(h, "POST", "/ui/api/orgs/acme/grants?token=s3cret", body))[0] == 401
        assert (await call(h, "GET", "/ui/api/orgs?token=s3cret"))[0] == 200  # reads take it either way
        assert await h.gw.tenancy.list_grants("acme") == []
        status, grant = await call(h, "POST", "/ui/api/orgs/acme/grants", body,
                                   headers={"Authorization": "Bearer s3cret", "Host": "gw.example"})
        assert (status, grant["amount"]) == (201, 1.0)


async def test_a_foreign_page_cannot_make_a_key(harness):
    async with harness() as h:
        for headers in ({"Origin": "https://evil.example"}, {"Host": "evil.example"}):
            status, answer = await call(h, "POST", "/ui/api/keys", {"org": "acme", "name": "x"}, headers=headers)
            assert (status, answer["error"]["code"]) == (403, "forbidden")
        assert await h.gw.tenancy.list_keys() == []


async def test_meta_lists_runtime_orgs_for_the_filters(harness):
    async with harness() as h:
        await h.gw.tenancy.create_org("initech")
        await h.gw.tenants.refresh()
        status, meta = await call(h, "GET", "/ui/api/meta")
        assert meta["orgs"] == ["acme", "globex", "initech"]


async def test_a_body_is_read_as_the_admin_apis_are(harness):
    """Content-Encoding decoded (gzip, x-gzip, deflate), any other 415, as on the admin API and completions."""
    async with harness() as h:
        status, made = await call(h, "POST", "/ui/api/orgs/acme/grants", headers={"Content-Encoding": "gzip"},
                                  raw=gzip.compress(orjson.dumps({"amount": 1, "reference": "gz"})))
        assert (status, made["reference"]) == (201, "gz")
        status, answer = await call(h, "POST", "/ui/api/orgs/acme/grants", headers={"Content-Encoding": "br"},
                                    raw=orjson.dumps({"amount": 1, "reference": "br"}))
        assert (status, answer["error"]["code"]) == (415, "unsupported_content_encoding")
        assert [g["reference"] for g in (await call(h, "GET", "/ui/api/orgs/acme/grants"))[1]["data"]] == ["gz"]
