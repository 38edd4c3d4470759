"""The admin API of runtime orgs, keys and grants (``/admin/v1``) and ``GET /v1/key``, on real servers.

Every endpoint's happy path with its exact body, on SQLite and on PostgreSQL; every refusal (400
naming the field, 404, 409) leaves the listings, the grants, the audit log and the change counter
as they were; the access rule of ``/admin/reload``; a change in force before its answer; a grant
reference posted to two replicas at once credits once; the secret shown once and stored nowhere.
"""

import asyncio
import re

import aiohttp
import pytest
from admin_calls import NOTHING, api, call
from replicas import stop_all, two_replicas

from kilnproxy.testing import KEY, MODEL, completion_body

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00")
GEN = "X-Neocloud-Generation-Id"


def org(id, granted=0.0, spent=0.0, source="api", max_in_flight=None, disabled=False, **extra):
    return {"id": id, "granted": granted, "spent": spent, "held": 0.0, "remaining": round(granted - spent, 10),
            "max_in_flight": max_in_flight, "disabled": disabled, "source": source,
            "requests_per_minute": None, "tokens_per_minute": None, "priority": "interactive", "weight": 1.0,
            **extra}


def key(body, **fields):
    """The key object ``body`` should be: its own id, prefix and created_at, and ``fields``."""
    assert body["id"].startswith("key_") and ISO.fullmatch(body["created_at"])
    base = {"id": body["id"], "name": None, "org": None, "role": "member", "prefix": body["prefix"], "models": None,
            "disabled": False, "revoked": False, "limit": None, "limit_reset": None, "usage": 0.0,
            "limit_remaining": None, "expires_at": None, "created_at": body["created_at"], "source": "api",
            "requests_per_minute": None, "tokens_per_minute": None, "priority": None, "weight": None}
    return {**base, **fields}


async def test_orgs_are_made_listed_and_changed(any_gw):
    a = api(any_gw)
    assert await a("POST", "/admin/v1/orgs", {"id": "beta", "max_in_flight": 3}) == (
        201, org("beta", max_in_flight=3))
    assert await a("GET", "/admin/v1/orgs/beta") == (200, org("beta", max_in_flight=3))
    assert await a("PATCH", "/admin/v1/orgs/beta", {"disabled": True, "requests_per_minute": 60}) == (
        200, org("beta", max_in_flight=3, disabled=True, requests_per_minute=60))
    assert await a("PATCH", "/admin/v1/orgs/beta", {"max_in_flight": None}) == (
        200, org("beta", disabled=True, requests_per_minute=60))
    assert await a("GET", "/admin/v1/orgs") == (200, {"data": [
        org("acme", 100.0, source="config"), org("beta", disabled=True, requests_per_minute=60),
        org("globex", 100.0, source="config")]})
    assert await a("GET", "/admin/v1/orgs/acme") == (200, org("acme", 100.0, source="config"))
    # priority and weight (fair queues): given at creation, changed, shown
    assert await a("POST", "/admin/v1/orgs", {"id": "evals", "priority": "batch", "weight": 3}) == (
        201, org("evals", priority="batch", weight=3.0))
    assert await a("PATCH", "/admin/v1/orgs/evals", {"priority": "interactive", "weight": 0.5}) == (
        200, org("evals", weight=0.5))
    assert any_gw.gw.shares["evals"] == ("interactive", 0.5)  # in force before the answer
    await a("PATCH", "/admin/v1/orgs/evals", {"weight": 1})
    assert "evals" not in any_gw.gw.shares  # the defaults again
    status, events = await a("GET", "/admin/v1/events?org=beta")
    assert status == 200
    assert [(e["kind"], e["org"], e["subject"], e["actor"]) for e in events["data"]] == [
        ("org.updated", "beta", "beta", "admin-api"), ("org.updated", "beta", "beta", "admin-api"),
        ("org.created", "beta", "beta", "admin-api")]
    assert events["data"][0]["detail"] == {"from": {"max_in_flight": 3}, "to": {"max_in_flight": None}}
    assert [e["id"] for e in events["data"]] == sorted((e["id"] for e in events["data"]), reverse=True)
    assert all(ISO.fullmatch(e["at"]) for e in events["data"])
    # a disabled runtime org's keys are refused at once; enabled again, served at once
    _, made = await a("POST", "/admin/v1/keys", {"org": "beta", "name": "k"})
    async with any_gw.post("/v1/completions", completion_body(), key=made["key"]) as resp:
        assert (resp.status, (await resp.json())["error"]["code"]) == (403, "forbidden")
    await a("PATCH", "/admin/v1/orgs/beta", {"disabled": False})
    await a("POST", "/admin/v1/orgs/beta/grants", {"amount": 1, "reference": "r1"})
    async with any_gw.post("/v1/completions", completion_body(), key=made["key"]) as resp:
        assert resp.status == 200


async def test_grants_raise_credits_once_per_reference(any_gw):
    a = api(any_gw)
    status, grant = await a("POST", "/admin/v1/orgs/acme/grants", {"amount": 25, "reference": "pay_1"})
    assert status == 201 and grant == {"id": grant["id"], "org": "acme", "amount": 25.0, "reference": "pay_1",
                                       "created_at": grant["created_at"]}
    assert grant["id"].startswith("grant_") and ISO.fullmatch(grant["created_at"])
    assert await a("POST", "/admin/v1/orgs/acme/grants", {"amount": 25, "reference": "pay_1"}) == (200, grant)
    assert await a("POST", "/admin/v1/orgs/acme/grants", {"amount": 99, "reference": "pay_1"}) == (200, grant)
    status, fix = await a("POST", "/admin/v1/orgs/acme/grants", {"amount": -0.5, "reference": "refund_1"})
    assert status == 201 and fix["amount"] == -0.5
    assert await a("GET", "/admin/v1/orgs/acme/grants") == (200, {"data": [grant, fix]})
    assert await a("GET", "/v1/credits", headers=any_gw.headers()) == (
        200, {"org": "acme", "granted": 124.5, "spent": 0.0, "remaining": 124.5})
    assert (await a("GET", "/admin/v1/orgs/acme"))[1] == org("acme", 124.5, source="config")
    events = (await a("GET", "/admin/v1/events?org=acme"))[1]["data"]
    assert [(e["kind"], e["detail"]) for e in events] == [
        ("grant.created", {"amount": -0.5, "reference": "refund_1"}),
        ("grant.created", {"amount": 25.0, "reference": "pay_1"})]
    assert await a("GET", "/admin/v1/events?org=acme&limit=1") == (200, {"data": events[:1]})
    assert await a("GET", f"/admin/v1/events?org=acme&before={events[0]['id']}") == (200, {"data": events[1:]})


async def test_a_key_works_at_once_and_a_revoked_key_at_once_no_more(any_gw, eventually):
    a = api(any_gw)
    status, made = await a("POST", "/admin/v1/keys", {
        "org": "acme", "name": "ci", "models": [MODEL], "limit": 2, "limit_reset": "monthly",
        "expires_at": "2099-01-01T00:00:00Z"})
    secret, body = made["key"], made["data"]
    assert status == 201 and set(made) == {"key", "data"}
    assert re.fullmatch(r"sk-[A-Za-z0-9_-]{40,}", secret) and body["prefix"] == secret[:8]
    expected = key(body, name="ci", org="acme", models=[MODEL], limit=2.0, limit_reset="monthly",
                   limit_remaining=2.0, expires_at="2099-01-01T00:00:00.000+00:00")
    assert body == expected
    async with any_gw.post("/v1/completions", completion_body(), key=secret) as resp:
        assert resp.status == 200
        generation = resp.headers[GEN]
    row = (await eventually(lambda: any_gw.rows(id=generation)))[0]
    assert (row["key_id"], row["org"]) == (body["id"], "acme")
    used = {**expected, "usage": row["cost"], "limit_remaining": round(2.0 - row["cost"], 10)}
    assert await a("GET", "/v1/key", headers=any_gw.headers(secret)) == (200, used)
    assert await a("GET", f"/admin/v1/keys/{body['id']}") == (200, used)
    status, changed = await a("PATCH", f"/admin/v1/keys/{body['id']}", {"name": "ci-2", "limit": None,
                                                                        "priority": "batch", "weight": 2})
    assert (status, changed) == (200, {**used, "name": "ci-2", "limit": None, "limit_remaining": None,
                                       "priority": "batch", "weight": 2.0})
    claim = any_gw.gw.claim_of(any_gw.gw.keys.authenticate(f"Bearer {secret}"))  # the key's own win
    assert (claim.org, claim.weight, claim.batch) == ("acme", 2.0, True)
    status, listing = await a("GET", "/admin/v1/keys?org=acme")
    assert status == 200 and [k["id"] for k in listing["data"]] == ["acme-key", body["id"]]
    assert listing["data"][1] == changed
    assert (await a("GET", "/admin/v1/keys"))[1]["data"][1]["id"] == "globex-key"

    assert await a("DELETE", f"/admin/v1/keys/{body['id']}") == (200, {**changed, "revoked": True})
    assert await a("DELETE", f"/admin/v1/keys/{body['id']}") == (200, {**changed, "revoked": True})
    async with any_gw.post("/v1/completions", completion_body(), key=secret) as resp:
        assert (resp.status, (await resp.json())["error"]["code"]) == (401, "invalid_api_key")
    assert (await a("GET", "/v1/key", headers=any_gw.headers(secret)))[0] == 401
    async with any_gw.post("/v1/completions", completion_body()) as resp:  # a later row: the 401 wrote none
        last = resp.headers[GEN]
    await eventually(lambda: any_gw.rows(id=last))
    assert [r["id"] for r in await any_gw.rows(key_id=body["id"])] == [generation]
    kinds = [e["kind"] for e in (await a("GET", "/admin/v1/events"))[1]["data"]]
    assert kinds == ["key.revoked", "key.updated", "key.created"]  # the second DELETE changed nothing


async def test_a_body_after_a_byte_order_mark_is_read_as_the_model_apis_read_one(gw):
    a = api(gw)
    status, grant = await a("POST", "/admin/v1/orgs/acme/grants",
                            raw=b'\xef\xbb\xbf{"amount": 2, "reference": "bom"}')
    assert status == 201 and (grant["amount"], grant["reference"]) == (2.0, "bom")
    assert await a("POST", "/admin/v1/orgs/acme/grants", raw=b"\xef\xbb\xbf") == (400, {"error": {
        "message": "The body is not valid JSON.", "type": "invalid_request_error", "param": None,
        "code": "invalid_request"}})


async def test_get_v1_key_answers_a_config_key(gw):
    assert await api(gw)("GET", "/v1/key", headers=gw.headers(KEY)) == (200, {
        "id": "acme-key", "name": "acme-key", "org": "acme", "role": "member", "prefix": KEY[:8], "models": None,
        "disabled": False, "revoked": False, "limit": None, "limit_reset": None, "usage": 0.0,
        "limit_remaining": None, "expires_at": None, "created_at": None, "source": "config",
        "requests_per_minute": None, "tokens_per_minute": None, "priority": None, "weight": None})
    assert (await api(gw)("GET", "/v1/key", headers=gw.headers("sk-nobody")))[0] == 401


# -- refusals --------------------------------------------------------------------------------------

BAD_BODIES = [  # (method, path, body or raw bytes, status, code, param)
    ("POST", "/admin/v1/orgs", b"{not json", 400, "invalid_request", None),
    ("POST", "/admin/v1/orgs", [], 400, "invalid_request", None),
    ("POST", "/admin/v1/orgs", {}, 400, "invalid_request", "id"),
    ("POST", "/admin/v1/orgs", {"id": 5}, 400, "invalid_request", "id"),
    ("POST", "/admin/v1/orgs", {"id": "has space"}, 400, "invalid_request", "id"),
    ("POST", "/admin/v1/orgs", {"id": "x", "max_in_flight": 0}, 400, "invalid_request", "max_in_flight"),
    ("POST", "/admin/v1/orgs", {"id": "x", "max_in_flight": "3"}, 400, "invalid_request", "max_in_flight"),
    ("POST", "/admin/v1/orgs", {"id": "x", "tokens_per_minute": -1}, 400, "invalid_request", "tokens_per_minute"),
    ("POST", "/admin/v1/orgs", {"id": "x", "max_in_flight": 2**31}, 400, "invalid_request", "max_in_flight"),
    ("POST", "/admin/v1/orgs", {"id": "x", "max_in_flight": 2**64 - 1}, 400, "invalid_request", "max_in_flight"),
    ("POST", "/admin/v1/orgs", {"id": "x", "requests_per_minute": 2**63}, 400, "invalid_request",
     "requests_per_minute"),
    ("PATCH", "/admin/v1/orgs/beta", {"tokens_per_minute": 2**64 - 1}, 400, "invalid_request", "tokens_per_minute"),
    ("POST", "/admin/v1/orgs", {"id": "x", "priority": "urgent"}, 400, "invalid_request", "priority"),
    ("POST", "/admin/v1/orgs", {"id": "x", "weight": 0}, 400, "invalid_request", "weight"),
    ("PATCH", "/admin/v1/orgs/beta", {"priority": None}, 400, "invalid_request", "priority"),
    ("PATCH", "/admin/v1/orgs/beta", {"weight": None}, 400, "invalid_request", "weight"),
    ("PATCH", "/admin/v1/orgs/beta", {"weight": -2}, 400, "invalid_request", "weight"),
    ("PATCH", "/admin/v1/orgs/beta", {"weight": "2"}, 400, "invalid_request", "weight"),
    ("PATCH", "/admin/v1/orgs/beta", {"weight": True}, 400, "invalid_request", "weight"),
    ("PATCH", "/admin/v1/orgs/beta", {"weight": 1e7}, 400, "invalid_request", "weight"),
    ("PATCH", "/admin/v1/orgs/beta", b'{"weight": 1e999}', 400, "invalid_request", "weight"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "priority": "high"}, 400, "invalid_request", "priority"),
    ("PATCH", "/admin/v1/keys/{key}", {"priority": 1}, 400, "invalid_request", "priority"),
    ("PATCH", "/admin/v1/keys/{key}", {"weight": 0}, 400, "invalid_request", "weight"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "requests_per_minute": 2**64 - 1}, 400,
     "invalid_request", "requests_per_minute"),
    ("PATCH", "/admin/v1/keys/{key}", {"tokens_per_minute": 2**63}, 400, "invalid_request", "tokens_per_minute"),
    ("POST", "/admin/v1/orgs", {"id": "x", "disabled": True}, 400, "invalid_request", "disabled"),
    ("POST", "/admin/v1/orgs", {"id": "x", "credits": 5}, 400, "invalid_request", "credits"),
    ("POST", "/admin/v1/orgs", {"id": "acme"}, 409, "conflict", "id"),
    ("POST", "/admin/v1/orgs", {"id": "beta"}, 409, "conflict", "id"),
    ("POST", "/admin/v1/orgs?x=1", {"id": "x"}, 400, "invalid_request", "x"),
    ("PATCH", "/admin/v1/orgs/beta", {"disabled": "yes"}, 400, "invalid_request", "disabled"),
    ("PATCH", "/admin/v1/orgs/beta", {"max_in_flight": 1.5}, 400, "invalid_request", "max_in_flight"),
    ("PATCH", "/admin/v1/orgs/beta", {"id": "gamma"}, 400, "invalid_request", "id"),
    ("PATCH", "/admin/v1/orgs/beta", b"", 400, "invalid_request", None),
    ("PATCH", "/admin/v1/orgs/nope", {"disabled": 1}, 400, "invalid_request", "disabled"),
    ("PATCH", "/admin/v1/orgs/nope", {"disabled": True}, 404, "not_found", None),
    ("PATCH", "/admin/v1/orgs/acme", {"disabled": "x"}, 400, "invalid_request", "disabled"),
    ("PATCH", "/admin/v1/orgs/acme", {"disabled": True}, 409, "managed_by_config", None),
    ("PATCH", "/admin/v1/orgs/acme", {}, 409, "managed_by_config", None),
    ("POST", "/admin/v1/orgs/beta/grants", {"amount": "5", "reference": "r"}, 400, "invalid_request", "amount"),
    ("POST", "/admin/v1/orgs/beta/grants", {"amount": True, "reference": "r"}, 400, "invalid_request", "amount"),
    ("POST", "/admin/v1/orgs/beta/grants", {"amount": 1e308, "reference": "r"}, 400, "invalid_request", "amount"),
    ("POST", "/admin/v1/orgs/beta/grants", {"amount": -1e12 - 1, "reference": "r"}, 400, "invalid_request",
     "amount"),
    # Numbers orjson refuses (beyond a double) are still named by their field
    ("POST", "/admin/v1/orgs/beta/grants", b'{"amount": 1e309, "reference": "r"}', 400, "invalid_request", "amount"),
    ("POST", "/admin/v1/orgs/beta/grants", b'{"amount": -1' + b"0" * 400 + b', "reference": "r"}', 400,
     "invalid_request", "amount"),
    ("POST", "/admin/v1/orgs/beta/grants", b'{"amount": NaN, "reference": "r"}', 400, "invalid_request", None),
    ("PATCH", "/admin/v1/keys/{key}", b'{"limit": 1e999}', 400, "invalid_request", "limit"),
    ("PATCH", "/admin/v1/orgs/beta", b'{"max_in_flight": 1' + b"0" * 30 + b"}", 400, "invalid_request",
     "max_in_flight"),
    ("POST", "/admin/v1/orgs/beta/grants", {"reference": "r"}, 400, "invalid_request", "amount"),
    ("POST", "/admin/v1/orgs/beta/grants", {"amount": 5}, 400, "invalid_request", "reference"),
    ("POST", "/admin/v1/orgs/beta/grants", {"amount": 5, "reference": ""}, 400, "invalid_request", "reference"),
    ("POST", "/admin/v1/orgs/beta/grants", {"amount": 5, "reference": 7}, 400, "invalid_request", "reference"),
    ("POST", "/admin/v1/orgs/beta/grants", {"amount": 5, "reference": "r", "note": "x"}, 400, "invalid_request",
     "note"),
    ("POST", "/admin/v1/orgs/nope/grants", {"amount": "5", "reference": "r"}, 400, "invalid_request", "amount"),
    ("POST", "/admin/v1/orgs/nope/grants", {"amount": 5, "reference": "r"}, 404, "not_found", None),
    ("POST", "/admin/v1/keys", {"org": "beta"}, 400, "invalid_request", "name"),
    ("POST", "/admin/v1/keys", {"name": "n"}, 400, "invalid_request", "org"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "limit": -1}, 400, "invalid_request", "limit"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "limit": 1e300}, 400, "invalid_request", "limit"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "limit": "5"}, 400, "invalid_request", "limit"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "limit_reset": "hourly"}, 400, "invalid_request",
     "limit_reset"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "expires_at": "tomorrow"}, 400, "invalid_request",
     "expires_at"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "expires_at": 1893456000}, 400, "invalid_request",
     "expires_at"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "expires_at": "9999-12-31T23:59:59-23:59"}, 400,
     "invalid_request", "expires_at"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "models": "m"}, 400, "invalid_request", "models"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "models": []}, 400, "invalid_request", "models"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "disabled": True}, 400, "invalid_request", "disabled"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "role": "owner"}, 400, "invalid_request", "role"),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "role": None}, 400, "invalid_request", "role"),
    ("PATCH", "/admin/v1/keys/{key}", {"role": "Admin"}, 400, "invalid_request", "role"),
    ("PATCH", "/admin/v1/keys/{key}", {"role": ["admin"]}, 400, "invalid_request", "role"),
    ("PATCH", "/admin/v1/keys/acme-key", {"role": "admin"}, 409, "managed_by_config", None),
    ("POST", "/admin/v1/keys", {"org": "beta", "name": "n", "key": "sk-mine"}, 400, "invalid_request", "key"),
    ("POST", "/admin/v1/keys", {"org": "nope", "name": "n", "limit": -1}, 400, "invalid_request", "limit"),
    ("POST", "/admin/v1/keys", {"org": "nope", "name": "n"}, 404, "not_found", "org"),
    ("PATCH", "/admin/v1/keys/{key}", {"limit": -1}, 400, "invalid_request", "limit"),
    ("PATCH", "/admin/v1/keys/{key}", {"expires_at": "0001-01-01T00:00:00+05:00"}, 400, "invalid_request",
     "expires_at"),
    ("PATCH", "/admin/v1/keys/{key}", {"limit": 2e12}, 400, "invalid_request", "limit"),
    ("PATCH", "/admin/v1/keys/{key}", {"org": "acme"}, 400, "invalid_request", "org"),
    ("PATCH", "/admin/v1/keys/{key}", {"disabled": "no"}, 400, "invalid_request", "disabled"),
    ("PATCH", "/admin/v1/keys/{key}", {"revoked": False}, 400, "invalid_request", "revoked"),
    ("PATCH", "/admin/v1/keys/nope", {"limit": -1}, 400, "invalid_request", "limit"),
    ("PATCH", "/admin/v1/keys/nope", {"name": "x"}, 404, "not_found", None),
    ("PATCH", "/admin/v1/keys/acme-key", {"limit": -1}, 400, "invalid_request", "limit"),
    ("PATCH", "/admin/v1/keys/acme-key", {"name": "x"}, 409, "managed_by_config", None),
    ("DELETE", "/admin/v1/keys/acme-key", NOTHING, 409, "managed_by_config", None),
    ("DELETE", "/admin/v1/keys/nope", NOTHING, 404, "not_found", None),
    ("GET", "/admin/v1/orgs/nope", NOTHING, 404, "not_found", None),
    ("GET", "/admin/v1/orgs/nope/grants", NOTHING, 404, "not_found", None),
    ("GET", "/admin/v1/keys/nope", NOTHING, 404, "not_found", None),
    ("GET", "/admin/v1/keys?org=nope", NOTHING, 404, "not_found", "org"),
    ("GET", "/admin/v1/events?org=nope", NOTHING, 404, "not_found", "org"),
    ("GET", "/admin/v1/keys?bogus=1", NOTHING, 400, "invalid_request", "bogus"),
    ("GET", "/admin/v1/events?limit=0", NOTHING, 400, "invalid_request", "limit"),
    ("GET", "/admin/v1/events?before=x", NOTHING, 400, "invalid_request", "before"),
    ("GET", "/admin/v1/events?limit=%C2%B2", NOTHING, 400, "invalid_request", "limit"),
    ("GET", "/admin/v1/events?before=%C2%B3", NOTHING, 400, "invalid_request", "before"),
    ("GET", "/admin/v1/events?limit=%D9%A1", NOTHING, 400, "invalid_request", "limit"),
]


async def everything(h, a):
    """What a refused request must leave as it was."""
    paths = ("/admin/v1/orgs", "/admin/v1/keys", "/admin/v1/events", "/admin/v1/orgs/beta/grants",
             "/admin/v1/orgs/acme/grants")
    return [await a("GET", p) for p in paths] + [await h.gw.tenancy.version()]


async def test_every_refusal_names_its_field_and_changes_nothing(any_gw):
    a = api(any_gw)
    await a("POST", "/admin/v1/orgs", {"id": "beta"})
    await a("POST", "/admin/v1/orgs/beta/grants", {"amount": 3, "reference": "r"})
    runtime_key = (await a("POST", "/admin/v1/keys", {"org": "beta", "name": "k"}))[1]["data"]["id"]
    before = await everything(any_gw, a)
    for method, path, body, status, code, param in BAD_BODIES:
        path = path.format(key=runtime_key)
        raw = body if isinstance(body, bytes) else None
        answer = await a(method, path, NOTHING if raw is not None else body, raw=raw)
        case = f"{method} {path} {body!r}"
        assert answer[0] == status, (case, answer)
        assert (answer[1]["error"]["code"], answer[1]["error"]["param"]) == (code, param), (case, answer)
        assert await everything(any_gw, a) == before, case


ROUTES = [("POST", "/admin/v1/orgs"), ("GET", "/admin/v1/orgs"), ("GET", "/admin/v1/orgs/acme"),
          ("PATCH", "/admin/v1/orgs/acme"), ("POST", "/admin/v1/orgs/acme/grants"),
          ("GET", "/admin/v1/orgs/acme/grants"), ("POST", "/admin/v1/keys"), ("GET", "/admin/v1/keys"),
          ("GET", "/admin/v1/keys/acme-key"), ("PATCH", "/admin/v1/keys/acme-key"),
          ("DELETE", "/admin/v1/keys/acme-key"), ("GET", "/admin/v1/events")]
GRANT = {"amount": 5, "reference": "r"}


async def test_the_access_rule_of_admin_reload(harness):
    async with harness(overrides={"admin": {"token": "adm-secret"}}) as h:
        a = api(h)
        before = await everything(h, a)
        for method, path in ROUTES:
            for headers, status, code in (
                    ({"Host": "evil.example"}, 401, "invalid_admin_token"),
                    ({"Host": "localhost", "Origin": "http://evil.example"}, 401, "invalid_admin_token"),
                    ({"Host": "evil.example", "Authorization": "Bearer wrong"}, 401, "invalid_admin_token")):
                answer = await a(method, path, GRANT, headers=headers)
                assert (answer[0], answer[1]["error"]["code"]) == (status, code), (method, path, headers)
        assert await everything(h, a) == before
        token = {"Host": "evil.example", "Authorization": "Bearer adm-secret"}
        assert (await a("POST", "/admin/v1/orgs/acme/grants", GRANT, headers=token))[0] == 201
    async with harness() as h:  # no token configured: 403 to a request that is not local
        for method, path in ROUTES:
            answer = await api(h)(method, path, GRANT, headers={"Host": "evil.example"})
            assert (answer[0], answer[1]["error"]["code"]) == (403, "forbidden"), (method, path)


async def test_the_secret_is_shown_once_and_stored_nowhere(harness, tmp_path, caplog, capsys, eventually):
    async with harness(overrides={"log": {"access": True, "bodies": True}}) as h:
        a = api(h)
        _, made = await a("POST", "/admin/v1/keys", {"org": "acme", "name": "leaky"})
        secret = made["key"]
        async with h.post("/v1/completions", completion_body(), key=secret) as resp:
            generation = resp.headers[GEN]
        await eventually(lambda: h.rows(id=generation))
        await a("PATCH", f"/admin/v1/keys/{made['data']['id']}", {"name": "leaky-2"})
        await a("DELETE", f"/admin/v1/keys/{made['data']['id']}")
        answers = [await a("GET", p) for p in ("/admin/v1/keys", f"/admin/v1/keys/{made['data']['id']}",
                                                "/admin/v1/events", "/admin/v1/orgs")]
        assert secret not in repr(answers)
        assert secret not in repr(await h.rows())
    out = capsys.readouterr()
    assert generation in out.out + out.err or generation in caplog.text  # the access log was written
    assert secret not in out.out + out.err + caplog.text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
            assert secret[8:].encode() not in path.read_bytes(), path


async def test_one_reference_posted_to_two_replicas_at_once_credits_once(tmp_path, mock_url, pg_url):
    a, b = await two_replicas(tmp_path, mock_url, pg_url)
    try:
        async with aiohttp.ClientSession() as session:
            for attempt in range(5):
                body = {"amount": 10, "reference": f"webhook-{attempt}"}
                answers = await asyncio.gather(*(call(session, r.url, "POST", "/admin/v1/orgs/acme/grants", body)
                                                 for r in (a, b)))
                assert sorted(status for status, _ in answers) == [200, 201]
                assert answers[0][1] == answers[1][1]
                for r in (a, b):  # in force on both before either answer came back
                    credits = await call(session, r.url, "GET", "/v1/credits",
                                         headers={"Authorization": f"Bearer {KEY}"})
                    assert credits[1]["granted"] == 100.0 + 10 * (attempt + 1)
            grants = await call(session, a.url, "GET", "/admin/v1/orgs/acme/grants")
            assert [g["reference"] for g in grants[1]["data"]] == [f"webhook-{i}" for i in range(5)]
            events = (await call(session, b.url, "GET", "/admin/v1/events"))[1]["data"]
            assert [e["kind"] for e in events] == ["grant.created"] * 5
    finally:
        await stop_all(a, b)


@pytest.fixture
def own_postgres():
    from kilnproxy.testing.postgres import PostgresServer
    with PostgresServer() as server:
        yield server


async def test_the_database_out_of_reach_is_503_and_nothing_half_written(harness, tmp_path, own_postgres,
                                                                          eventually):
    storage = {"url": own_postgres.url(), "spool_path": str(tmp_path / "spool.db")}
    async with harness(overrides={"storage": storage}) as h:
        a = api(h)
        await a("POST", "/admin/v1/orgs", {"id": "beta"})
        before = await everything(h, a)
        own_postgres.stop("immediate")
        try:
            for method, path, body in (("POST", "/admin/v1/orgs", {"id": "gamma"}), ("GET", "/admin/v1/orgs", NOTHING),
                                       ("POST", "/admin/v1/orgs/beta/grants", GRANT),
                                       ("POST", "/admin/v1/keys", {"org": "beta", "name": "k"}),
                                       ("GET", "/v1/key", NOTHING)):
                status, answer = await a(method, path, body, headers=h.headers())
                assert (status, answer["error"]["code"]) == (503, "store_unavailable"), (method, path, answer)
        finally:
            own_postgres.start()

        async def answered():  # the pool replaces its broken connections as they are used
            return (await a("GET", "/admin/v1/orgs"))[0] == 200

        await eventually(answered)
        assert await everything(h, a) == before
