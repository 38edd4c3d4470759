"""Spend over HTTP (``GET /admin/v1/usage``), on real gateways over SQLite and PostgreSQL.

The rows are written by real requests through the gateway (two orgs, three keys, two priced models
and a model the catalog lacks), then moved in time by UPDATEs (as another program may change the
ledger; the rollup's triggers follow). Every group, and the spans at and around the rows' own times,
must give exactly the sums over the rows (``spend_rows.expected``, computed from the rows in
Python). CSV: the bytes exactly. Bad input: 400 ``invalid_request`` naming the parameter, and
nothing changed.
"""

import itertools
import json
from datetime import datetime, timedelta, timezone

from admin_calls import api
from rawhttp import exchange, request
from spend_rows import csv_text, execute, expected, move, rollup_and_rows

from kilnproxy.testing import KEY, MODEL, OTHER_KEY, completion_body

OTHER_MODEL = "other-model"


def two_models(config: dict) -> None:
    config["models"].append({**config["models"][0], "id": OTHER_MODEL,
                             "pricing": {"prompt": 0.7, "completion": 1.3}})


async def ledger(h) -> tuple[list[dict], datetime]:
    """Eleven rows of real requests, moved to 5 h apart from midnight three days ago; the rows and
    that midnight."""
    a = api(h)
    _, made = await a("POST", "/admin/v1/keys", {"org": "acme", "name": "second"})
    calls = [(KEY, MODEL, 4), (KEY, MODEL, 7), (KEY, MODEL, 2), (KEY, OTHER_MODEL, 5), (KEY, OTHER_MODEL, 3),
             (OTHER_KEY, MODEL, 6), (OTHER_KEY, MODEL, 1), (made["key"], OTHER_MODEL, 8),
             (made["key"], MODEL, 2), (made["key"], "no-such-model", 2), (OTHER_KEY, OTHER_MODEL, 9)]
    ids = []
    for key, model, max_tokens in calls:
        async with h.post("/v1/completions", completion_body(model=model, max_tokens=max_tokens), key=key) as resp:
            await resp.read()
            ids.append(resp.headers["X-Neocloud-Generation-Id"])
    midnight = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=3)
    await move(h, {i: stamp(midnight + timedelta(hours=5 * n, milliseconds=n)) for n, i in enumerate(ids)})
    rows = sorted(await h.rows(), key=lambda r: r["created_at"])
    assert [r["id"] for r in rows] == ids and len({r["model"] for r in rows}) == 3
    return rows, midnight


def stamp(when: datetime) -> str:
    return when.isoformat(timespec="milliseconds")


async def usage(h, accept: str | None = None, **params):
    headers = {"Accept": accept} if accept else {}
    async with h.session.get(f"{h.url}/admin/v1/usage", params=params, headers=headers) as resp:
        return resp.status, resp.headers.get("Content-Type"), await resp.read()


async def spent(h, **params):
    status, content_type, body = await usage(h, **params)
    assert (status, content_type) == (200, "application/json"), body
    return json.loads(body)["data"]


async def test_every_group_sums_exactly_the_rows(harness, store):
    async with harness(overrides=store, configure=two_models) as h:
        rows, midnight = await ledger(h)
        span = {"from": (midnight - timedelta(days=1)).date().isoformat(),
                "to": (midnight + timedelta(days=4)).date().isoformat()}
        for n in range(5):
            for group_by in itertools.combinations(("day", "model", "key", "org"), n):
                assert await spent(h, **span, group_by=",".join(group_by)) == expected(rows, group_by), group_by
        # the group's fields in the order given, and the rows ordered by them in that order
        assert await spent(h, **span, group_by="org,model,day") == expected(rows, ("org", "model", "day"))
        # the default span: the 30 days up to now
        assert await spent(h, group_by="day,key") == expected(rows, ("day", "key"))
        # one org of the operator's choice
        acme = [r for r in rows if r["org"] == "acme"]
        assert await spent(h, org="acme", group_by="day,model") == expected(acme, ("day", "model"))
        assert await spent(h, org="nobody", group_by="day") == []
        assert await spent(h, org="nobody") == expected([], ())
        # the figures by hand for one group: acme's second key, three requests of 200
        second = [r for r in rows if r["key_id"] not in ("acme-key", "globex-key")]
        assert {r["status"] for r in second} == {200, 404} and len(second) == 3
        rollup, by_rows = await rollup_and_rows(h)
        assert rollup == by_rows


async def test_from_is_inclusive_to_exclusive_to_the_millisecond(harness, store):
    async with harness(overrides=store, configure=two_models) as h:
        rows, midnight = await ledger(h)
        at = [r["created_at"] for r in rows]
        for lo, hi in [(0, 11), (3, 7), (2, 10), (5, 6), (4, 4), (1, 9), (0, 5), (6, 11)]:
            params = {"from": at[lo]} if lo < len(at) else {}
            if hi < len(at):
                params["to"] = at[hi]
            else:
                params["to"] = stamp(midnight + timedelta(days=4))
            assert await spent(h, **params, group_by="day,model") == expected(rows[lo:hi], ("day", "model")), params
        # a millisecond either side of a row's time
        t3 = datetime.fromisoformat(at[3])
        after = stamp(t3 + timedelta(milliseconds=1))
        assert await spent(h, **{"from": after, "to": at[8]}) == expected(rows[4:8])
        assert await spent(h, **{"from": at[2], "to": after}) == expected(rows[2:4])
        # a microsecond past a row's millisecond: the row is before `from`, and before `to`
        past = (t3 + timedelta(microseconds=1)).isoformat()
        assert await spent(h, **{"from": past, "to": at[8]}) == expected(rows[4:8])
        assert await spent(h, **{"from": at[0], "to": past}) == expected(rows[0:4])
        # whole days, days and times mixed, times with an offset (converted to UTC), a time within one day
        day = [(midnight + timedelta(days=d)).date().isoformat() for d in range(4)]
        in_day = [[r for r in rows if r["created_at"].startswith(d)] for d in day]
        assert await spent(h, **{"from": day[1], "to": day[2]}, group_by="day") == expected(in_day[1], ("day",))
        assert await spent(h, **{"from": day[0], "to": day[3]}, group_by="key") == expected(
            in_day[0] + in_day[1] + in_day[2], ("key",))
        noon = stamp(midnight + timedelta(hours=12))
        late = stamp(midnight + timedelta(days=2, hours=7, minutes=30))
        inside = [r for r in rows if noon <= r["created_at"] < late]
        assert await spent(h, **{"from": noon, "to": late}, group_by="day,model") == expected(inside, ("day", "model"))
        assert await spent(h, **{"from": noon, "to": day[2]}, group_by="day") == expected(
            [r for r in rows if noon <= r["created_at"] < day[2]], ("day",))
        shifted = (midnight + timedelta(hours=12)).astimezone(timezone(timedelta(hours=2))).isoformat()
        assert shifted.endswith("+02:00")
        assert await spent(h, **{"from": shifted, "to": late}, group_by="day,model") == expected(
            inside, ("day", "model"))
        within = [r for r in rows if stamp(midnight + timedelta(hours=1)) <= r["created_at"] < noon]
        assert await spent(h, **{"from": stamp(midnight + timedelta(hours=1)), "to": noon}) == expected(within)
        assert await spent(h, **{"from": at[4], "to": at[4]}) == expected([])


async def test_csv_is_the_json_as_csv(harness, store):
    async with harness(overrides=store, configure=two_models) as h:
        rows, midnight = await ledger(h)
        for group_by in [("day", "model"), ("key",), (), ("org", "day", "key", "model")]:
            status, content_type, body = await usage(h, "text/csv", group_by=",".join(group_by))
            assert (status, content_type) == (200, "text/csv; charset=utf-8")
            assert body == csv_text(expected(rows, group_by), group_by)
        status, _, body = await usage(h, "text/csv")
        assert body.split(b"\r\n")[0] == b"requests,prompt_tokens,completion_tokens,cached_tokens,cost"
        # one line by hand: the model the catalog lacks, no tokens, no cost
        status, _, body = await usage(h, "application/json;q=0.5, text/csv", group_by="model")
        assert b"\r\nno-such-model,1,0,0,0,0\r\n" in body
        status, content_type, _ = await usage(h, "text/csv;q=0, application/json")
        assert content_type == "application/json"


BAD = [
    ({"group_by": "week"}, "group_by"),
    ({"group_by": "day,week"}, "group_by"),
    ({"group_by": "day,"}, "group_by"),
    ({"group_by": "day,day"}, "group_by"),
    ({"group_by": "key_id"}, "group_by"),
    ({"from": "yesterday"}, "from"),
    ({"from": "2026-13-01"}, "from"),
    ({"from": "2026-11-31"}, "from"),
    ({"to": "2026-11-01T25:00"}, "to"),
    ({"to": ""}, "to"),
    ({"from": "2026-11-02", "to": "2026-11-01"}, "from"),
    ({"to": "0001-01-05"}, "to"),
    ({"since": "2026-11-01"}, "since"),
]


async def test_bad_input_is_400_naming_it_and_changes_nothing(harness):
    async with harness(configure=two_models) as h:
        rows, _ = await ledger(h)
        before = (await rollup_and_rows(h), await spent(h, group_by="day,model"))
        for params, param in BAD:
            status, content_type, body = await usage(h, **params)
            assert (status, content_type) == (400, "application/json"), params
            error = json.loads(body)["error"]
            assert (error["code"], error["type"], error["param"]) == (
                "invalid_request", "invalid_request_error", param), params
            assert error["message"]
        assert (await rollup_and_rows(h), await spent(h, group_by="day,model")) == before
        assert await h.rows() == rows
        # the ends of the calendar are valid: answered, not a 500
        assert await spent(h, **{"from": "9999-12-31T10:00", "to": "9999-12-31T23:59:59.9999"}, group_by="day") == []
        assert await spent(h, **{"from": "0001-01-01T00:00:00.0001"}, group_by="org") == expected(rows, ("org",))


async def test_the_operators_access_rule(harness):
    async with harness(overrides={"admin": {"token": "adm-secret"}}) as h:
        refused = await exchange(h.url, request("GET", "/admin/v1/usage", {"Host": "gw.example"}))
        assert (refused.status, refused.error_code) == (401, "invalid_admin_token")
        with_key = await exchange(h.url, request("GET", "/admin/v1/usage", {"Host": "gw.example",
                                                                          "Authorization": f"Bearer {KEY}"}))
        assert (with_key.status, with_key.error_code) == (401, "invalid_admin_token")  # an org's key is not it
        admitted = await exchange(h.url, request("GET", "/admin/v1/usage", {"Host": "gw.example",
                                                                          "Authorization": "Bearer adm-secret"}))
        assert (admitted.status, json.loads(admitted.body)) == (200, {"data": expected([])})
    async with harness() as h:  # no token: local requests only, and no other site's page
        port = h.gateway.port
        foreign = await exchange(h.url, request("GET", "/admin/v1/usage", {"Host": f"localhost:{port}",
                                                                         "Origin": "http://evil.example"}))
        assert (foreign.status, foreign.error_code) == (403, "forbidden")


async def test_rows_inserted_since_are_counted_at_once(harness, store):
    """The rollup follows every commit: a request's row is in the next answer."""
    async with harness(overrides=store, configure=two_models) as h:
        assert await spent(h) == expected([])
        for n in range(1, 4):
            async with h.post("/v1/completions", completion_body(stream=n == 2)) as resp:
                await resp.read()
            assert await spent(h, group_by="day,model,key") == expected(await h.rows(), ("day", "model", "key"))
        assert (await spent(h))[0]["requests"] == 3
        rollup, by_rows = await rollup_and_rows(h)
        assert rollup == by_rows
        await execute(h, "DELETE FROM usage_events WHERE id = ?", [(await h.rows())[0]["id"]])
        assert (await spent(h))[0]["requests"] == 2


async def test_an_org_admin_reads_its_own_orgs_spend_only(harness, store):
    """``/v1/org/usage`` (the org API's route) gives ``spend_answer``'s answer for the admin key's org."""
    async with harness(overrides=store, configure=two_models) as h:
        rows, midnight = await ledger(h)
        _, admin = await api(h)("POST", "/admin/v1/keys", {"org": "globex", "name": "boss", "role": "admin"})
        globex = [r for r in rows if r["org"] == "globex"]
        assert 0 < len(globex) < len(rows)
        bearer = {"Authorization": f"Bearer {admin['key']}"}
        for group_by in ("", "day,model", "key", "model,key,day"):
            async with h.session.get(f"{h.url}/v1/org/usage", params={"group_by": group_by}, headers=bearer) as resp:
                assert resp.status == 200
                assert await resp.json() == {"data": expected(globex, tuple(g for g in group_by.split(",") if g))}
        async with h.session.get(f"{h.url}/v1/org/usage", params={"group_by": "day,key"},
                                 headers={**bearer, "Accept": "text/csv"}) as resp:
            assert resp.headers["Content-Type"] == "text/csv; charset=utf-8"
            assert await resp.read() == csv_text(expected(globex, ("day", "key")), ("day", "key"))
        assert (await usage(h, "text/csv", org="globex", group_by="day,key"))[2] == csv_text(
            expected(globex, ("day", "key")), ("day", "key"))
