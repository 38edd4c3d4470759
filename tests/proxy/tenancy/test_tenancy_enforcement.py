"""Runtime orgs, keys and grants in force: a change in the store reaches the request path within a
second, on both stores; revoked and expired keys are 401 (no row), a disabled org 403, a key's
``limit`` is held like its org's credits (402 ``key_limit_exceeded``), grants raise ``remaining``."""

import asyncio
import time
from datetime import datetime, timedelta, timezone

import asyncpg
import pytest

from kilnproxy.errors import ConfigError
from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.store.limits import KeySpending
from kilnproxy.store.tenancy.orgs_keys import TenancyStore
from kilnproxy.store.tenancy.sql import PostgresDb, SQLiteDb
from kilnproxy.testing import completion_body

PROPAGATION = 1.0  # seconds: the contract's bound for a change made by another process


def stalled(**extra):
    return completion_body(stream=True, mock={"fail": "stall", "after": 1}, **extra)


class OtherProcess:
    """The store as a command (or another replica) sees it: its own connection, not the gateway's."""

    def __init__(self, h, store: dict):
        self.h, self.url = h, store.get("storage", {}).get("url")

    async def __aenter__(self) -> TenancyStore:
        if self.url is None:
            self.db = SQLiteDb(self.h.gw.config.db_path)
            await self.db.open()
        else:
            self.conn = await asyncpg.connect(self.url)
            self.db = PostgresDb(self.conn)
        return TenancyStore(self.db)

    async def __aexit__(self, *exc):
        await self.db.close()
        if self.url is not None:
            await self.conn.close()


async def status_of(h, key: str, body: dict | None = None) -> int:
    async with h.post("/v1/completions", body or completion_body(), key=key) as resp:
        await resp.read()
        return resp.status


async def within(seconds: float, predicate) -> float:
    """Await ``predicate()`` until true; fails past ``seconds``. Returns how long it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await predicate():
        assert loop.time() - start < seconds, f"not true within {seconds} s"
        await asyncio.sleep(0.01)
    return loop.time() - start


async def test_a_key_made_by_another_process_works_within_a_second_and_its_revocation_too(harness, store):
    async with harness(overrides=store) as h, OtherProcess(h, store) as other:
        secret, key = await other.create_key("acme", "ci")
        await within(PROPAGATION, lambda: _status_is(h, secret, 200))  # 401s meanwhile write no row
        await other.revoke_key(key["id"])
        served = 1

        async def revoked() -> bool:
            nonlocal served
            status = await status_of(h, secret)
            served += status == 200
            return status == 401

        await within(PROPAGATION, revoked)
        rows = await h.rows(key_id=key["id"])
        assert [(r["org"], r["status"]) for r in rows] == [("acme", 200)] * served  # the 401s wrote none


async def _status_is(h, secret: str, expected: int) -> bool:
    return await status_of(h, secret) == expected


async def test_a_revoked_or_expired_key_gets_401_and_writes_no_row(harness, store):
    async with harness(overrides=store) as h:
        tenancy, tenants = h.gw.tenancy, h.gw.tenants
        # 3 s: time for the store's writes and a refresh before it, on a loaded machine too
        soon = (datetime.now(timezone.utc) + timedelta(seconds=3)).isoformat()
        secret, key = await tenancy.create_key("acme", "short-lived", expires_at=soon)
        revoked_secret, revoked = await tenancy.create_key("acme", "leaked")
        await tenancy.revoke_key(revoked["id"])
        await tenants.refresh()
        assert await status_of(h, revoked_secret) == 401
        deadline = h.gw.keys.authenticate(f"Bearer {secret}").expires_at
        while True:  # valid until its expiry (a request answered before it: 200; one sent after it: 401)...
            sent = time.time()
            status = await status_of(h, secret)
            if time.time() < deadline:
                assert status == 200
            elif sent >= deadline:
                break
            await asyncio.sleep(0.05)
        async with h.post("/v1/completions", completion_body(), key=secret) as resp:  # ...then unknown
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
            assert "X-Neocloud-Generation-Id" not in resp.headers
        assert all(r["status"] == 200 for r in await h.rows(key_id=key["id"]))
        assert await h.rows(key_id=revoked["id"]) == []


async def test_a_disabled_org_is_403_with_a_row_and_enabled_again_serves(harness, store):
    async with harness(overrides=store) as h:
        await h.gw.tenancy.create_org("initech")
        secret, key = await h.gw.tenancy.create_key("initech", "app")
        await h.gw.tenancy.add_grant("initech", 1.0, "invoice-1")
        await h.gw.tenancy.update_org("initech", {"disabled": True})
        await h.gw.tenants.refresh()
        async with h.post("/v1/completions", completion_body(), key=secret) as resp:
            assert resp.status == 403
            assert (await resp.json())["error"]["code"] == "forbidden"
            gen = resp.headers["X-Neocloud-Generation-Id"]
        async with h.session.get(f"{h.url}/v1/credits", headers=h.headers(secret)) as resp:
            assert resp.status == 403
        await h.gw.tenancy.update_org("initech", {"disabled": False})
        await h.gw.tenants.refresh()
        assert await status_of(h, secret) == 200
        assert [(r["id"] == gen, r["status"], r["error_code"]) for r in await h.rows(key_id=key["id"])] == [
            (True, 403, "forbidden"), (False, 200, None)]


async def test_a_runtime_org_starts_with_nothing_and_grants_raise_what_it_may_spend(harness, store):
    async with harness(overrides=store) as h:
        await h.gw.tenancy.create_org("initech")
        secret, _ = await h.gw.tenancy.create_key("initech", "app")
        await h.gw.tenants.refresh()
        async with h.post("/v1/completions", completion_body(), key=secret) as resp:
            assert resp.status == 402
            assert (await resp.json())["error"]["code"] == "insufficient_credits"
        await h.gw.tenancy.add_grant("initech", 0.5, "payment-1")
        await h.gw.tenancy.add_grant("initech", 0.5, "payment-1")  # a retried webhook: credited once
        await h.gw.tenancy.add_grant("acme", 2.0, "top-up")  # a config org takes grants too
        await h.gw.tenants.refresh()
        assert await status_of(h, secret) == 200
        async with h.session.get(f"{h.url}/v1/credits", headers=h.headers(secret)) as resp:
            credits = await resp.json()
        spent = sum(r["cost"] for r in await h.rows(org="initech"))
        assert credits == {"org": "initech", "granted": 0.5, "spent": pytest.approx(spent),
                           "remaining": pytest.approx(0.5 - spent)}
        async with h.session.get(f"{h.url}/v1/credits", headers=h.headers()) as resp:
            assert (await resp.json())["granted"] == 100.0 + 2.0  # the config's credits + the grant


async def test_a_key_limit_is_held_like_credits_and_overrun_by_one_request_at_most(harness, store, eventually,
                                                                                   committed):
    # test model: 0.30 USD per million completion tokens; a hold of max_tokens=1000 is ~0.0003 USD
    async with harness(overrides=store) as h:
        secret, key = await h.gw.tenancy.create_key("acme", "capped", limit=0.0005, limit_reset="daily")
        await h.gw.tenants.refresh()
        first = await h.post("/v1/completions", stalled(max_tokens=1000), key=secret)  # holds 0.0003 of 0.0005
        assert first.status == 200
        await first.content.readline()
        second = await h.post("/v1/completions", stalled(max_tokens=1000), key=secret)  # 0.0002 left: admitted
        assert second.status == 200
        await second.content.readline()
        async with h.post("/v1/completions", completion_body(max_tokens=1), key=secret) as resp:
            assert resp.status == 402
            assert (await resp.json())["error"]["code"] == "key_limit_exceeded"
        assert await status_of(h, None) == 200  # the org's other keys are not limited by it
        first.close()
        second.close()
        await eventually(lambda: h.app[GATEWAY].admission.count("acme") == 0)
        await committed(h, 3, key_id=key["id"])  # the 402's row and the two closed streams'
        assert await status_of(h, secret) == 200  # the holds became the (small) real costs
        statuses = await asyncio.gather(*(status_of(h, secret, completion_body(max_tokens=400)) for _ in range(30)))
        assert 402 in statuses
        spent = sum(r["cost"] for r in await h.rows(key_id=key["id"]))
        most = max(r["cost"] for r in await h.rows(key_id=key["id"]))
        assert spent <= 0.0005 + most  # overrun by one request at most
        refused = [r for r in await h.rows(key_id=key["id"]) if r["status"] == 402]
        assert {r["error_code"] for r in refused} == {"key_limit_exceeded"}


async def test_a_key_limit_counts_across_two_gateways_on_one_database(harness, pg_url, tmp_path, eventually):
    store = {"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool-a.db")}}
    async with harness(overrides=store) as a:
        other = {"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool-b.db")}}
        async with harness(overrides={**other, "server": {"port": 0}}) as b:
            secret, _ = await a.gw.tenancy.create_key("acme", "shared", limit=0.0005)
            await a.gw.tenants.refresh()
            await within(PROPAGATION, lambda: _known(b, secret))
            held = await a.post("/v1/completions", stalled(max_tokens=1000), key=secret)
            assert held.status == 200
            await held.content.readline()
            held_too = await b.post("/v1/completions", stalled(max_tokens=1000), key=secret)
            assert held_too.status == 200
            await held_too.content.readline()
            async with b.post("/v1/completions", completion_body(max_tokens=1), key=secret) as resp:
                assert resp.status == 402  # the other replica's hold counts
                assert (await resp.json())["error"]["code"] == "key_limit_exceeded"
            held.close()
            held_too.close()


async def _known(h, secret: str) -> bool:
    try:
        h.gw.keys.authenticate(f"Bearer {secret}")
        return True
    except Exception:
        return False


async def test_a_config_naming_a_runtime_org_is_refused_at_start_and_at_reload(harness, store, tmp_path):
    async with harness(overrides=store) as h:
        await h.gw.tenancy.create_org("initech")
    config = {**store, "orgs": [{"id": "acme", "credits": 1.0}, {"id": "globex", "credits": 1.0},
                                {"id": "initech", "credits": 5.0}]}
    with pytest.raises(ConfigError) as refused:
        async with harness(overrides=config):
            pass
    assert "initech" in str(refused.value) and "runtime" in str(refused.value)


def test_a_key_period_starts_again_at_zero():
    spending = KeySpending()
    spending.load("k", "2026-11-30T00:00:00.000+00:00", 0.4)
    assert spending.known("k", "2026-11-30T00:00:00.000+00:00")
    spending.charge("k", "2026-11-30T00:00:00.000+00:00", 0.1)
    assert spending.spent("k", "2026-11-30T00:00:00.000+00:00") == pytest.approx(0.5)
    assert spending.spent("k", "2026-12-01T00:00:00.000+00:00") == 0.0  # a new day
    spending.charge("k", "2026-12-01T00:00:00.000+00:00", 0.2)
    assert spending.spent("k", "2026-12-01T00:00:00.000+00:00") == pytest.approx(0.2)


async def test_a_reload_naming_a_runtime_org_is_refused_and_the_running_config_stays(tmp_path, mock_url):
    import aiohttp
    from processes import GatewayProcess, gateway_config

    config = gateway_config([mock_url])
    gw = await GatewayProcess(tmp_path, config).start()
    try:
        db = SQLiteDb(tmp_path / "usage.db")  # what `kilnproxy orgs create` does, from another process
        await db.open()
        try:
            await TenancyStore(db).create_org("initech")
        finally:
            await db.close()
        gw.write_config({**config, "orgs": [*config["orgs"], {"id": "initech", "credits": 5.0}]})
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{gw.url}/admin/reload") as resp:
                assert resp.status == 422
                error = (await resp.json())["error"]
            assert error["code"] == "config_invalid" and "initech" in error["message"]
            async with s.get(f"{gw.url}/v1/credits", headers={"Authorization": "Bearer sk-test-acme"}) as resp:
                assert (await resp.json())["granted"] == 100.0
    finally:
        await gw.stop()
