"""The org API (``/v1/org``): an org's own admin keys manage its keys and read its events and spend, on real
servers, SQLite and PostgreSQL.

Each rule with the case that breaks it: a member key, no key, a revoked, disabled or unknown key, the
operator's loopback access (no key) and its token are refused on every route; another org's keys are
404 as if absent; bad bodies are 400 naming the field before 404 and 409; an admin cannot revoke,
disable, expire or demote its org's last active admin key (the operator can); every refusal leaves
the keys, the events and the change counter as they were; a key made here is usable at once with the
openai SDK and refused at once once revoked here; its secret is in no log line, row or file.
"""

import openai
import pytest
from admin_calls import NOTHING, api, call

from kilnproxy.testing import KEY, MODEL, OTHER_KEY, completion_body

ADMIN_TOKEN = "adm-secret"
ABSENT = "key_0000000000000000"


def as_key(h, secret, **headers):
    """Calls to the gateway with ``secret`` as the bearer."""
    auth = {} if secret is None else {"Authorization": f"Bearer {secret}"}
    return lambda method, path, body=NOTHING, **kw: call(h.session, h.url, method, path, body,
                                                         headers={**auth, **headers}, **kw)


async def admin_key(a, org="acme", name="boss"):
    """``(secret, key)`` of a new admin key of ``org``, made by the operator."""
    status, made = await a("POST", "/admin/v1/keys", {"org": org, "name": name, "role": "admin"})
    assert status == 201 and made["data"]["role"] == "admin"
    return made["key"], made["data"]


async def everything(h, a):
    """What a refused request must leave as it was: every key, every event, the change counter."""
    return [await a("GET", "/admin/v1/keys"), await a("GET", "/admin/v1/events"), await h.gw.tenancy.version()]


def error(status, code, message, param=None, type="invalid_request_error"):
    return status, {"error": {"message": message, "type": type, "param": param, "code": code}}


async def test_an_admin_key_manages_its_orgs_keys_and_reads_its_events(any_gw, eventually):
    a = api(any_gw)
    boss_secret, boss = await admin_key(a)
    await a("POST", "/admin/v1/keys", {"org": "globex", "name": "theirs"})  # an event of another org
    o = as_key(any_gw, boss_secret)
    assert await o("GET", "/v1/org") == await a("GET", "/admin/v1/orgs/acme")
    assert await o("GET", "/v1/org/keys") == await a("GET", "/admin/v1/keys?org=acme")
    assert [k["id"] for k in (await o("GET", "/v1/org/keys"))[1]["data"]] == ["acme-key", boss["id"]]

    status, made = await o("POST", "/v1/org/keys", {"name": "ci", "models": [MODEL], "limit": 2,
                                                    "limit_reset": "daily"})
    assert status == 201 and set(made) == {"key", "data"}
    secret, ci = made["key"], made["data"]
    assert (ci["org"], ci["role"], ci["name"], ci["prefix"], ci["limit"], ci["source"]) == (
        "acme", "member", "ci", secret[:8], 2.0, "api")
    assert await a("GET", f"/admin/v1/keys/{ci['id']}") == (200, ci)
    client = any_gw.openai(secret)  # usable at once: in force before the answer was sent
    done = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4)
    assert done.usage.total_tokens > 0
    [row] = await eventually(lambda: any_gw.rows(key_id=ci["id"]))
    assert row["org"] == "acme"

    status, changed = await o("PATCH", f"/v1/org/keys/{ci['id']}", {"name": "ci-2", "limit": None, "role": "admin"})
    assert status == 200 and changed == {**ci, "name": "ci-2", "limit": None, "limit_remaining": None,
                                         "role": "admin", "usage": row["cost"]}
    assert await o("DELETE", f"/v1/org/keys/{ci['id']}") == (200, {**changed, "revoked": True})
    with pytest.raises(openai.AuthenticationError) as refused:  # refused at once
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert (refused.value.status_code, refused.value.code) == (401, "invalid_api_key")

    status, events = await o("GET", "/v1/org/events")
    actor = f"key:{boss['id']}"
    assert status == 200 and [(e["kind"], e["org"], e["subject"], e["actor"]) for e in events["data"]] == [
        ("key.revoked", "acme", ci["id"], actor), ("key.updated", "acme", ci["id"], actor),
        ("key.created", "acme", ci["id"], actor), ("key.created", "acme", boss["id"], "admin-api")]
    assert set(events["data"][0]) == {"id", "at", "kind", "org", "subject", "actor", "detail"}
    assert events["data"][1]["detail"] == {"from": {"name": "ci", "limit": 2.0, "role": "member"},
                                           "to": {"name": "ci-2", "limit": None, "role": "admin"}}
    assert await a("GET", "/admin/v1/events?org=acme") == (200, events)
    assert await o("GET", "/v1/org/events?limit=1") == (200, {"data": events["data"][:1]})
    before = events["data"][1]["id"]
    assert await o("GET", f"/v1/org/events?before={before}") == (200, {"data": events["data"][2:]})


async def test_the_org_api_answers_whatever_the_orgs_credits(harness, store):
    async with harness(overrides={**store, "orgs": [{"id": "acme", "credits": 0.0}, {"id": "globex"}]}) as h:
        secret, _ = await admin_key(api(h))
        async with h.post("/v1/completions", completion_body(), key=secret) as resp:
            assert (resp.status, (await resp.json())["error"]["code"]) == (402, "insufficient_credits")
        status, org = await as_key(h, secret)("GET", "/v1/org")
        assert status == 200 and (org["id"], org["remaining"]) == ("acme", 0.0)
        assert (await as_key(h, secret)("POST", "/v1/org/keys", {"name": "more"}))[0] == 201


ROUTES = [("GET", "/v1/org"), ("GET", "/v1/org/keys"), ("POST", "/v1/org/keys"), ("PATCH", "/v1/org/keys/{key}"),
          ("DELETE", "/v1/org/keys/{key}"), ("GET", "/v1/org/usage"), ("GET", "/v1/org/events")]
UNKNOWN_KEY = error(401, "invalid_api_key", "Invalid API key. The org API takes an admin key of the org, sent "
                    "as 'Authorization: Bearer <key>'.", type="authentication_error")


async def test_only_an_admin_key_of_an_enabled_org_passes_on_every_route(harness, store):
    async with harness(overrides={**store, "admin": {"token": ADMIN_TOKEN}}) as h:
        a = api(h)
        _, member = await a("POST", "/admin/v1/keys", {"org": "acme", "name": "member"})
        revoked, revoked_key = await admin_key(a, name="revoked")
        disabled, disabled_key = await admin_key(a, name="disabled")
        expired = (await a("POST", "/admin/v1/keys", {"org": "acme", "name": "expired", "role": "admin",
                                                      "expires_at": "2000-01-01T00:00:00Z"}))[1]["key"]
        await a("POST", "/admin/v1/orgs", {"id": "beta"})
        of_disabled_org, _ = await admin_key(a, org="beta")
        await a("DELETE", f"/admin/v1/keys/{revoked_key['id']}")
        await a("PATCH", f"/admin/v1/keys/{disabled_key['id']}", {"disabled": True})
        await a("PATCH", "/admin/v1/orgs/beta", {"disabled": True})
        before = await everything(h, a)
        member_only = error(403, "forbidden", "This key is a member of its org: the org API takes one of its "
                            "org's admin keys.", type="permission_error")
        callers = [
            (as_key(h, None), UNKNOWN_KEY),  # a local client without a key: the operator's rule counts for nothing
            (as_key(h, ADMIN_TOKEN), UNKNOWN_KEY),  # nor the operator's token
            (as_key(h, "sk-nobody"), UNKNOWN_KEY),
            (as_key(h, None, **{"x-api-key": disabled}), UNKNOWN_KEY),  # a bearer only
            (as_key(h, KEY), member_only),  # a config member key
            (as_key(h, member["key"]), member_only),
            (as_key(h, revoked), UNKNOWN_KEY),
            (as_key(h, expired), UNKNOWN_KEY),
            (as_key(h, disabled), error(403, "forbidden", "This API key is disabled.", type="permission_error")),
            (as_key(h, of_disabled_org), error(403, "forbidden", "Organization `beta` is disabled.",
                                               type="permission_error")),
        ]
        for caller, refusal in callers:
            for method, path in ROUTES:
                answer = await caller(method, path.format(key=member["data"]["id"]), {"name": "x"})
                assert answer == refusal, (method, path, refusal)
        assert await everything(h, a) == before


async def test_a_key_demoted_revoked_or_disabled_is_refused_at_once(any_gw):
    a = api(any_gw)
    secret, boss = await admin_key(a)
    deputy_secret, deputy = await admin_key(a, name="deputy")
    o = as_key(any_gw, secret)
    assert (await o("GET", "/v1/org"))[0] == 200
    for change, refusal in (({"role": "member"}, 403), ({"disabled": True}, 403)):
        assert (await a("PATCH", f"/admin/v1/keys/{boss['id']}", change))[0] == 200
        assert (await o("GET", "/v1/org/keys"))[0] == refusal, change
        await a("PATCH", f"/admin/v1/keys/{boss['id']}", {"role": "admin", "disabled": False})
        assert (await o("GET", "/v1/org/keys"))[0] == 200
    assert (await as_key(any_gw, deputy_secret)("DELETE", f"/v1/org/keys/{boss['id']}"))[0] == 200
    assert await o("GET", "/v1/org") == UNKNOWN_KEY


async def test_another_orgs_keys_are_not_found_as_if_absent(any_gw):
    a = api(any_gw)
    secret, _ = await admin_key(a)
    _, theirs = await a("POST", "/admin/v1/keys", {"org": "globex", "name": "theirs", "role": "admin"})
    o = as_key(any_gw, secret)
    before = await everything(any_gw, a)
    for key_id in (theirs["data"]["id"], "globex-key", ABSENT):
        absent = error(404, "not_found", f"No key `{key_id}`.")
        assert await o("PATCH", f"/v1/org/keys/{key_id}", {"name": "mine"}) == absent
        assert await o("PATCH", f"/v1/org/keys/{key_id}", {"role": "member"}) == absent
        assert await o("DELETE", f"/v1/org/keys/{key_id}") == absent
        assert await o("PATCH", f"/v1/org/keys/{key_id}", {"limit": -1}) == error(
            400, "invalid_request", "`limit` must not be negative (null for no limit).", "limit")
    for path in ("/v1/org/keys?org=globex", "/v1/org/events?org=globex", "/v1/org/usage?org=globex"):
        status, body = await o("GET", path)
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, "invalid_request", "org"), path
    status, body = await o("POST", "/v1/org/keys", {"name": "mine", "org": "globex"})
    assert (status, body["error"]["param"]) == (400, "org")
    listed = (await o("GET", "/v1/org/keys"))[1]["data"]
    assert {k["org"] for k in listed} == {"acme"}
    events = (await o("GET", "/v1/org/events"))[1]["data"]
    assert {e["org"] for e in events} == {"acme"}
    # paging from another org's event id answers as from an id no event has: the org's events below it
    globex_event = (await a("GET", "/admin/v1/events?org=globex"))[1]["data"][0]["id"]
    assert await o("GET", f"/v1/org/events?before={globex_event}") == await a(
        "GET", f"/admin/v1/events?org=acme&before={globex_event}")
    assert await everything(any_gw, a) == before


async def test_an_admin_cannot_leave_its_org_without_an_active_admin_key_but_the_operator_can(any_gw):
    a = api(any_gw)
    secret, boss = await admin_key(a)
    o = as_key(any_gw, secret)
    mine = f"/v1/org/keys/{boss['id']}"
    last = error(409, "conflict", f"The key `{boss['id']}` is its org's last active admin key: make another "
                 "admin key first (the operator may change it).")
    before = await everything(any_gw, a)
    for method, body in (("PATCH", {"role": "member"}), ("PATCH", {"disabled": True}),
                         ("PATCH", {"expires_at": "2000-01-01T00:00:00Z"}), ("PATCH", {"role": "member", "name": "x"}),
                         ("DELETE", NOTHING)):
        assert await o(method, mine, body) == last, body
    assert await everything(any_gw, a) == before
    assert (await o("PATCH", mine, {"role": "owner"}))[0] == 400  # 400 before 409
    assert (await o("PATCH", mine, {"name": "still boss", "limit": 5}))[0] == 200  # it stays an active admin

    status, made = await o("POST", "/v1/org/keys", {"name": "deputy", "role": "admin"})
    assert status == 201
    deputy = as_key(any_gw, made["key"])
    assert (await deputy("PATCH", mine, {"role": "member"}))[0] == 200  # another admin is left: allowed
    assert (await o("GET", "/v1/org"))[0] == 403  # demoted, at once
    theirs = f"/v1/org/keys/{made['data']['id']}"
    assert (await deputy("DELETE", theirs))[1]["error"]["code"] == "conflict"
    assert (await deputy("PATCH", theirs, {"disabled": True}))[1]["error"]["code"] == "conflict"
    # the operator may leave the org without an admin
    assert (await a("PATCH", f"/admin/v1/keys/{made['data']['id']}", {"role": "member"}))[0] == 200
    assert (await a("DELETE", f"/admin/v1/keys/{made['data']['id']}"))[0] == 200
    assert (await a("DELETE", f"/admin/v1/keys/{boss['id']}"))[0] == 200


async def test_a_config_admin_key_counts_and_is_managed_by_the_config(harness, store):
    keys = [{"key": KEY, "org": "acme", "id": "acme-key"}, {"key": OTHER_KEY, "org": "globex", "id": "globex-key"},
            {"key": "sk-test-acme-admin", "org": "acme", "id": "acme-admin", "role": "admin"}]
    async with harness(overrides={**store, "keys": keys}) as h:
        a = api(h)
        o = as_key(h, "sk-test-acme-admin")
        status, shown = await a("GET", "/admin/v1/keys/acme-admin")
        assert status == 200 and (shown["role"], shown["source"]) == ("admin", "config")
        assert (await o("GET", "/v1/org/keys"))[1]["data"][1] == shown
        made = (await o("POST", "/v1/org/keys", {"name": "runtime admin", "role": "admin"}))[1]
        runtime = as_key(h, made["key"])
        # the config's admin key is still there: the runtime one may go
        assert (await runtime("DELETE", f"/v1/org/keys/{made['data']['id']}"))[0] == 200
        assert await o("PATCH", "/v1/org/keys/acme-admin", {"role": "member"}) == error(
            409, "managed_by_config", "The key `acme-admin` is in the gateway's config: change it there and "
            "reload (SIGHUP or POST /admin/reload).")
        assert (await o("DELETE", "/v1/org/keys/acme-admin"))[1]["error"]["code"] == "managed_by_config"
        actors = {e["actor"] for e in (await o("GET", "/v1/org/events"))[1]["data"]}
        assert actors == {"key:acme-admin", f"key:{made['data']['id']}"}


BAD = [  # (method, path, body or raw bytes, status, code, param)
    ("POST", "/v1/org/keys", b"{not json", 400, "invalid_request", None),
    ("POST", "/v1/org/keys", [], 400, "invalid_request", None),
    ("POST", "/v1/org/keys", {}, 400, "invalid_request", "name"),
    ("POST", "/v1/org/keys", {"name": 5}, 400, "invalid_request", "name"),
    ("POST", "/v1/org/keys", {"name": " "}, 400, "invalid_request", "name"),
    ("POST", "/v1/org/keys", {"name": "n", "org": "acme"}, 400, "invalid_request", "org"),
    ("POST", "/v1/org/keys", {"name": "n", "role": "owner"}, 400, "invalid_request", "role"),
    ("POST", "/v1/org/keys", {"name": "n", "limit": -1}, 400, "invalid_request", "limit"),
    ("POST", "/v1/org/keys", {"name": "n", "limit": "5"}, 400, "invalid_request", "limit"),
    ("POST", "/v1/org/keys", {"name": "n", "limit_reset": "hourly"}, 400, "invalid_request", "limit_reset"),
    ("POST", "/v1/org/keys", {"name": "n", "expires_at": "tomorrow"}, 400, "invalid_request", "expires_at"),
    ("POST", "/v1/org/keys", {"name": "n", "models": []}, 400, "invalid_request", "models"),
    ("POST", "/v1/org/keys", {"name": "n", "disabled": True}, 400, "invalid_request", "disabled"),
    ("POST", "/v1/org/keys", {"name": "n", "requests_per_minute": 10}, 400, "invalid_request", "requests_per_minute"),
    # an org's share of the model servers (SPEC 14) is the operator's: an admin cannot raise its own
    ("POST", "/v1/org/keys", {"name": "n", "priority": "interactive"}, 400, "invalid_request", "priority"),
    ("POST", "/v1/org/keys", {"name": "n", "weight": 100}, 400, "invalid_request", "weight"),
    ("PATCH", "/v1/org/keys/{key}", {"weight": 100}, 400, "invalid_request", "weight"),
    ("PATCH", "/v1/org/keys/{key}", {"priority": None}, 400, "invalid_request", "priority"),
    ("POST", "/v1/org/keys?org=acme", {"name": "n"}, 400, "invalid_request", "org"),
    ("PATCH", "/v1/org/keys/{key}", {"tokens_per_minute": 5}, 400, "invalid_request", "tokens_per_minute"),
    ("PATCH", "/v1/org/keys/{key}", {"revoked": False}, 400, "invalid_request", "revoked"),
    ("PATCH", "/v1/org/keys/{key}", {"org": "globex"}, 400, "invalid_request", "org"),
    ("PATCH", "/v1/org/keys/{key}", {"role": None}, 400, "invalid_request", "role"),
    ("PATCH", "/v1/org/keys/{key}", {"disabled": "yes"}, 400, "invalid_request", "disabled"),
    ("PATCH", "/v1/org/keys/{key}", b"", 400, "invalid_request", None),
    ("PATCH", f"/v1/org/keys/{ABSENT}", {"limit": -1}, 400, "invalid_request", "limit"),
    ("PATCH", f"/v1/org/keys/{ABSENT}", {"name": "x"}, 404, "not_found", None),
    ("DELETE", f"/v1/org/keys/{ABSENT}", NOTHING, 404, "not_found", None),
    ("DELETE", "/v1/org/keys/a%00b", NOTHING, 404, "not_found", None),  # no store can hold a NUL
    ("PATCH", "/v1/org/keys/" + "k" * 5000, {"name": "x"}, 404, "not_found", None),
    ("PATCH", "/v1/org/keys/acme-key", {"limit": -1}, 400, "invalid_request", "limit"),
    ("PATCH", "/v1/org/keys/acme-key", {"name": "x"}, 409, "managed_by_config", None),
    ("DELETE", "/v1/org/keys/acme-key", NOTHING, 409, "managed_by_config", None),
    ("PATCH", "/v1/org/keys/{admin}", {"role": "member"}, 409, "conflict", None),
    ("DELETE", "/v1/org/keys/{admin}", NOTHING, 409, "conflict", None),
    ("GET", "/v1/org?org=acme", NOTHING, 400, "invalid_request", "org"),
    ("GET", "/v1/org/keys?org=acme", NOTHING, 400, "invalid_request", "org"),
    ("GET", "/v1/org/events?org=acme", NOTHING, 400, "invalid_request", "org"),
    ("GET", "/v1/org/events?limit=0", NOTHING, 400, "invalid_request", "limit"),
    ("GET", "/v1/org/events?before=x", NOTHING, 400, "invalid_request", "before"),
    ("GET", "/v1/org/usage?org=acme", NOTHING, 400, "invalid_request", "org"),
    ("GET", "/v1/org/usage?group_by=org", NOTHING, 400, "invalid_request", "group_by"),
    ("GET", "/v1/org/usage?group_by=week", NOTHING, 400, "invalid_request", "group_by"),
    ("GET", "/v1/org/usage?from=yesterday", NOTHING, 400, "invalid_request", "from"),
    ("GET", "/v1/org/usage?to=2026-13-01", NOTHING, 400, "invalid_request", "to"),
    # only the routes of the table: any other path under /v1/org is 404, another method 405
    ("GET", "/v1/org/keys/{key}", NOTHING, 405, "method_not_allowed", None),
    ("POST", "/v1/org", {}, 405, "method_not_allowed", None),
    ("PUT", "/v1/org/keys", {}, 405, "method_not_allowed", None),
    ("DELETE", "/v1/org/events", NOTHING, 405, "method_not_allowed", None),
    ("GET", "/v1/org/grants", NOTHING, 404, "not_found", None),
    ("POST", "/v1/org/grants", {"amount": 5, "reference": "r"}, 404, "not_found", None),
    ("GET", "/v1/org/keys/{key}/usage", NOTHING, 404, "not_found", None),
    ("GET", "/v1/org/", NOTHING, 404, "not_found", None),
    ("GET", "/v1/orgs", NOTHING, 404, "not_found", None),
]


async def test_every_refusal_names_its_field_and_changes_nothing(any_gw):
    a = api(any_gw)
    secret, boss = await admin_key(a)
    member = (await a("POST", "/admin/v1/keys", {"org": "acme", "name": "m"}))[1]["data"]["id"]
    o = as_key(any_gw, secret)
    before = await everything(any_gw, a)
    for method, path, body, status, code, param in BAD:
        path = path.format(key=member, admin=boss["id"])
        raw = body if isinstance(body, bytes) else None
        answer = await o(method, path, NOTHING if raw is not None else body, raw=raw)
        case = f"{method} {path} {body!r}"
        assert answer[0] == status, (case, answer)
        assert (answer[1]["error"]["code"], answer[1]["error"]["param"]) == (code, param), (case, answer)
        assert await everything(any_gw, a) == before, case
    answer = await o("PATCH", f"/v1/org/keys/{member}", {"role": "admin"})
    assert answer[0] == 200  # the same key, a good body: changed


async def test_usage_is_the_orgs_spend_only(any_gw, eventually):
    a = api(any_gw)
    secret, _ = await admin_key(a)
    for key in (KEY, OTHER_KEY, KEY):
        async with any_gw.post("/v1/completions", completion_body(), key=key) as resp:
            assert resp.status == 200

    async def three_rows():
        return len(await any_gw.rows()) == 3
    await eventually(three_rows)
    o = as_key(any_gw, secret)
    status, spend = await o("GET", "/v1/org/usage?group_by=key,model")
    assert status == 200
    assert (status, spend) == await a("GET", "/admin/v1/usage?org=acme&group_by=key,model")
    rows = await any_gw.rows(org="acme")
    assert [(r["key_id"], r["model"], r["requests"]) for r in spend["data"]] == [("acme-key", MODEL, 2)]
    assert spend["data"][0]["cost"] == pytest.approx(sum(r["cost"] for r in rows), abs=1e-12)
    assert spend["data"][0]["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    headers = {"Authorization": f"Bearer {secret}", "Accept": "text/csv"}
    async with any_gw.session.get(f"{any_gw.url}/v1/org/usage?group_by=key", headers=headers) as resp:
        assert (resp.status, resp.content_type) == (200, "text/csv")
        assert b"globex" not in await resp.read()


async def test_the_secret_of_a_key_made_through_the_org_api_is_stored_nowhere(harness, tmp_path, caplog, capsys,
                                                                              eventually):
    async with harness(overrides={"log": {"access": True, "bodies": True}}) as h:
        boss_secret, _ = await admin_key(api(h))
        o = as_key(h, boss_secret)
        _, made = await o("POST", "/v1/org/keys", {"name": "leaky"})
        secret, key_id = made["key"], made["data"]["id"]
        async with h.post("/v1/completions", completion_body(), key=secret) as resp:
            assert resp.status == 200
        await eventually(lambda: h.rows(key_id=key_id))
        await o("PATCH", f"/v1/org/keys/{key_id}", {"name": "leaky-2"})
        await o("DELETE", f"/v1/org/keys/{key_id}")
        answers = [await o("GET", p) for p in ("/v1/org/keys", "/v1/org/events", "/v1/org", "/v1/org/usage")]
        assert key_id in repr(answers) and secret not in repr(answers)
        assert secret not in repr(await h.rows())
    out = capsys.readouterr()
    assert key_id in out.out + out.err + caplog.text  # the access log was written
    assert secret not in out.out + out.err + caplog.text
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "usage.db" for p in files)
    for path in files:
        for text in (secret, secret[8:]):
            assert text.encode() not in path.read_bytes(), path
