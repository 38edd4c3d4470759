"""Credits (the request rules and usage accounting in docs/reference.md): grants from the config, spending = SUM(cost) of the org's rows."""

import asyncio
import random
import sqlite3

import pytest

from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.testing import KEY, MODEL, OTHER_KEY
from kilnproxy.testing import completion_body as body

GEN = "X-Neocloud-Generation-Id"
ONE_REQUEST = (5 * 0.10 + 4 * 0.30) / 1_000_000  # the default test body: 5 prompt + 4 completion tokens



def orgs(acme: float, globex: float = 100.0) -> dict:
    return {"orgs": [{"id": "acme", "credits": acme}, {"id": "globex", "credits": globex}]}


async def credits(h, key=KEY) -> dict:
    async with h.session.get(f"{h.url}/v1/credits", headers=h.headers(key)) as resp:
        assert resp.status == 200
        return await resp.json()


def spent_in_db(h) -> dict:
    db = sqlite3.connect(h.db)
    try:
        return dict(db.execute("SELECT org, SUM(cost) FROM usage_events GROUP BY org").fetchall())
    finally:
        db.close()


async def test_no_credits_402_before_anything_goes_upstream(harness):
    async with harness(overrides=orgs(0.0)) as h:
        for stream in (False, True):
            async with h.post("/v1/completions", body(stream=stream)) as resp:
                assert resp.status == 402
                error = (await resp.json())["error"]
                assert error["code"] == "insufficient_credits"
                row = await h.row(resp.headers[GEN])
            assert (row["status"], row["error_code"], row["cost"]) == (402, "insufficient_credits", 0)
        async with h.post("/v1/chat/completions", {"model": MODEL, "messages": []}) as resp:
            assert resp.status == 402
        assert await h.mock_requests() == []
        assert await credits(h) == {"org": "acme", "granted": 0.0, "spent": 0.0, "remaining": 0.0}
        async with h.post("/v1/completions", body(), key=OTHER_KEY) as resp:  # another org is not affected
            assert resp.status == 200


async def test_402_comes_before_maintenance_and_body_rules(harness):
    overrides = {**orgs(0.0), "maintenance": {"enabled": True}}
    async with harness(overrides=overrides) as h:
        async with h.session.post(f"{h.url}/v1/completions", data=b"not json", headers=h.headers()) as resp:
            assert resp.status == 402


async def test_last_request_may_go_below_zero_the_next_is_refused(harness):
    async with harness(overrides=orgs(ONE_REQUEST * 1.5)) as h:
        for _ in range(2):
            async with h.post("/v1/completions", body(stream=True)) as resp:
                assert resp.status == 200
                await resp.read()
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 402
        state = await credits(h)
        assert state["spent"] == pytest.approx(2 * ONE_REQUEST)
        assert state["remaining"] == pytest.approx(-0.5 * ONE_REQUEST)
        assert state["remaining"] < 0
        assert len(await h.mock_requests()) == 2


async def test_credits_endpoint(gw):
    assert await credits(gw) == {"org": "acme", "granted": 100.0, "spent": 0.0, "remaining": 100.0}
    async with gw.post("/v1/completions", body()) as resp:
        cost = (await resp.json())["usage"]["cost"]
    state = await credits(gw)
    assert list(state) == ["org", "granted", "spent", "remaining"]
    assert state == {"org": "acme", "granted": 100.0, "spent": cost, "remaining": 100.0 - cost}
    assert (await credits(gw, OTHER_KEY))["spent"] == 0.0
    async with gw.session.get(f"{gw.url}/v1/credits") as resp:
        assert resp.status == 401


async def test_restart_with_a_raised_grant_keeps_the_spending(harness):
    async with harness(overrides=orgs(ONE_REQUEST * 0.5)) as h:
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 200
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 402
        before = await credits(h)
    async with harness(overrides=orgs(ONE_REQUEST * 0.5)) as h:  # same database: still used up
        assert await credits(h) == before
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 402
    async with harness(overrides=orgs(1.0)) as h:
        state = await credits(h)
        assert state == {"org": "acme", "granted": 1.0, "spent": before["spent"], "remaining": 1.0 - before["spent"]}
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 200
        assert (await credits(h))["spent"] == pytest.approx(2 * ONE_REQUEST)
        assert len(await h.rows()) == 4


async def test_spending_equals_the_rows_under_concurrent_load_of_several_orgs(harness, eventually):
    """Hundreds of concurrent streamed and non-streamed requests over four orgs, with hang-ups:
    per org, SUM(cost) of its rows is what /v1/credits says was spent, and each request the
    clients made has its row."""
    names = ["acme", "globex", "initech", "umbrella"]
    overrides = {"orgs": [{"id": n, "credits": 50.0} for n in names],
                 "keys": [{"key": f"sk-{n}", "org": n, "id": f"{n}-key"} for n in names],
                 "limits": {"max_in_flight_per_org": 100}}
    rng = random.Random(7)
    async with harness(overrides=overrides) as h:
        sent = {n: 0 for n in names}
        seen_cost = {n: 0.0 for n in names}
        hangups = 0

        async def one(i: int) -> None:
            nonlocal hangups
            org = names[i % len(names)]
            kind = rng.choice(["json", "stream", "stream_no_usage", "chat", "hangup", "error"])
            request = body(stream=kind in ("stream", "hangup", "error"), max_tokens=rng.randint(1, 16),
                           prompt="word " * rng.randint(1, 40))
            path = "/v1/completions"
            if kind == "stream_no_usage":
                request["stream"] = True
            if kind == "chat":
                path = "/v1/chat/completions"
                request = {"model": MODEL, "messages": [{"role": "user", "content": request["prompt"]}],
                           "max_tokens": request["max_tokens"], "stream": True,
                           "stream_options": {"include_usage": True}}
            if kind == "hangup":
                request["mock"] = {"fail": "stall", "after": 2}
            if kind == "error":
                request["mock"] = {"fail": "drop", "after": 2}
            sent[org] += 1
            async with h.post(path, request, key=f"sk-{org}") as resp:
                assert resp.status == 200
                if kind == "hangup":
                    await resp.content.readany()
                    hangups += 1
                    resp.close()
                    return
                raw = await resp.read()
                if kind == "json":
                    seen_cost[org] += (await resp.json())["usage"]["cost"]
                elif kind in ("stream", "chat"):
                    assert b'"cost":' in raw

        await asyncio.gather(*(one(i) for i in range(400)))
        assert hangups > 20
        total = sum(sent.values())
        await eventually(lambda: len(spent_in_db(h)) == 4 and _row_count(h) == total)
        await h.mock_wait(hangups=hangups)
        rows = await h.rows()
        db_spent = spent_in_db(h)
        for org in names:
            state = await credits(h, f"sk-{org}")
            org_rows = [r for r in rows if r["org"] == org]
            assert len(org_rows) == sent[org]
            assert state["spent"] == pytest.approx(db_spent[org], rel=1e-12) and db_spent[org] > 0
            assert state["spent"] == pytest.approx(h.app[GATEWAY].credits.spent[org], rel=1e-12)
            assert db_spent[org] >= seen_cost[org]
        assert sum(r["disconnected"] for r in rows) == hangups
        assert all(r["cost"] > 0 for r in rows)  # disconnects and upstream drops are charged too


def _row_count(h) -> int:
    db = sqlite3.connect(h.db)
    try:
        return db.execute("SELECT COUNT(*) FROM usage_events").fetchone()[0]
    finally:
        db.close()
