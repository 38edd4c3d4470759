"""Requests and tokens per minute, per org and per key: exact over any 60 s, on both stores and across
two gateways on one PostgreSQL; tokens reserved at admission and settled to the real count."""

import asyncio

import aiohttp
import asyncpg
import pytest
from replicas import stop_all, two_replicas

from kilnproxy.config import parse_config
from kilnproxy.errors import ConfigError
from kilnproxy.store.minute_windows import MinuteWindows
from kilnproxy.testing import KEY, OTHER_KEY, base_config, completion_body


def orgs(**acme) -> list[dict]:
    return [{"id": "acme", "credits": 100.0, **acme}, {"id": "globex", "credits": 100.0}]


async def status_and_code(h, body=None, key=None) -> tuple[int, str | None]:
    async with h.post("/v1/completions", body or completion_body(), key=key) as resp:
        data = await resp.json()
        return resp.status, (data.get("error") or {}).get("code")


async def test_an_org_gets_exactly_its_requests_per_minute_however_many_come_at_once(harness, store):
    async with harness(overrides={**store, "orgs": orgs(requests_per_minute=10),
                                  "limits": {"max_in_flight_per_org": 64}}) as h:
        results = await asyncio.gather(*(status_and_code(h) for _ in range(30)))
        assert sorted(results) == [(200, None)] * 10 + [(429, "rate_limit_exceeded")] * 20
        assert await status_and_code(h, key=OTHER_KEY) == (200, None)  # another org is not bound by it
        rows = await h.rows(org="acme")
        assert sorted((r["status"], r["error_code"]) for r in rows) == sorted(results)


async def test_a_runtime_key_has_its_own_requests_per_minute(harness, store):
    async with harness(overrides=store) as h:
        secret, key = await h.gw.tenancy.create_key("acme", "batch", requests_per_minute=2)
        await h.gw.tenants.refresh()
        assert [await status_and_code(h, key=secret) for _ in range(3)] == [
            (200, None), (200, None), (429, "rate_limit_exceeded")]
        assert await status_and_code(h, key=KEY) == (200, None)  # the org's other key is not bound by it


async def test_tokens_are_reserved_at_admission_and_settled_to_the_real_count(harness, store, committed):
    # the prompt "The capital of France is" is bounded at 88 tokens (24 bytes + 64 for the template):
    # max_tokens=60 reserves 148
    async with harness(overrides={**store, "orgs": orgs(tokens_per_minute=200)}) as h:
        stalled = completion_body(stream=True, max_tokens=60, mock={"fail": "stall", "after": 1})
        first = await h.post("/v1/completions", stalled)
        assert first.status == 200
        await first.content.readline()
        second = await h.post("/v1/completions", stalled)  # 148 reserved by the other: below 200
        assert second.status == 200
        await second.content.readline()
        assert await status_and_code(h, completion_body(max_tokens=1)) == (429, "rate_limit_exceeded")
        first.close()
        second.close()
        await committed(h, 3, org="acme")  # the 429's row and the two closed streams'
        # the two rows settled what was streamed (a few tokens each), not the 296 reserved
        used = sum(r["total_tokens"] for r in await h.rows(org="acme") if r["status"] == 200)
        assert used < 200
        assert await status_and_code(h, completion_body(max_tokens=1)) == (200, None)


async def test_a_request_refused_after_admission_counts_as_a_request_with_no_tokens(harness, store, committed):
    async with harness(overrides={**store, "orgs": orgs(requests_per_minute=2, tokens_per_minute=10_000)}) as h:
        assert await status_and_code(h, {**completion_body(), "stream": "maybe"}) == (400, "invalid_request")
        assert await status_and_code(h) == (200, None)
        assert await status_and_code(h) == (429, "rate_limit_exceeded")
        rows = await committed(h, 3, org="acme")
        assert [r["total_tokens"] for r in rows if r["status"] == 400] == [0]


async def test_two_gateways_on_one_database_share_an_orgs_requests_per_minute(harness, pg_url, tmp_path):
    config = {"orgs": orgs(requests_per_minute=6), "limits": {"max_in_flight_per_org": 64}}
    a_store = {"storage": {"url": pg_url, "spool_path": str(tmp_path / "a.db")}}
    b_store = {"storage": {"url": pg_url, "spool_path": str(tmp_path / "b.db")}}
    async with harness(overrides={**config, **a_store}) as a, harness(overrides={**config, **b_store}) as b:
        results = await asyncio.gather(*(status_and_code(h) for h in (a, b) * 10))
        assert sorted(results) == [(200, None)] * 6 + [(429, "rate_limit_exceeded")] * 14


async def test_postgresql_lets_a_keys_entries_go_once_out_of_the_window_though_its_org_has_no_bound(harness, pg_url,
                                                                                                    tmp_path):
    """Each admission under a per-minute bound leaves an entry in PostgreSQL; those of a key whose org
    has no bound of its own were never deleted (one row per request, for ever)."""
    store = {"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}}
    async with harness(overrides=store) as h:
        secret, _ = await h.gw.tenancy.create_key("acme", "batch", requests_per_minute=3)
        await h.gw.tenants.refresh()
        assert [await status_and_code(h, key=secret) for _ in range(4)] == [(200, None)] * 3 + [
            (429, "rate_limit_exceeded")]
        conn = await asyncpg.connect(pg_url)
        try:
            assert await conn.fetchval("SELECT count(*) FROM kiln_minute") == 3
            # the minute passes (the entries are made older rather than waited for)
            await conn.execute("UPDATE kiln_minute SET at = at - interval '61 seconds'")
            assert await status_and_code(h, key=secret) == (200, None)
            assert await conn.fetchval("SELECT count(*) FROM kiln_minute") == 1
        finally:
            await conn.close()


@pytest.mark.parametrize("who", ["org", "key"])
async def test_postgresql_counts_a_window_whose_tokens_pass_what_a_bigint_holds(harness, pg_url, tmp_path, who):
    """512 entries of 2**54 tokens (a row counts at most 2**53 - 1 prompt and as many completion tokens) under
    a bound of 2**63 - 1: their sum passes a BIGINT, which PostgreSQL refused to hold (every admission of the
    org, or of the key, a 503 for the rest of the minute). Now the window is full: 429."""
    store = {"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}}
    if who == "org":
        store["orgs"] = [{"id": "acme", "credits": 100.0, "tokens_per_minute": 2**63 - 1},
                         {"id": "globex", "credits": 100.0}]
    async with harness(overrides=store) as h:
        key = None
        if who == "key":
            key, _ = await h.gw.tenancy.create_key("acme", "batch", tokens_per_minute=2**63 - 1)
            await h.gw.tenants.refresh()
        assert await status_and_code(h, key=key) == (200, None)
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute("INSERT INTO kiln_minute (id, org, key_id, at, tokens) SELECT 'big-' || i, org, "
                               "key_id, now(), 2^54 FROM kiln_minute, generate_series(1, 512) AS i")
        finally:
            await conn.close()
        assert await status_and_code(h, key=key) == (429, "rate_limit_exceeded")


def test_the_window_slides_over_any_60_seconds():
    now = [1000.0]
    windows = MinuteWindows(clock=lambda: now[0])
    bounds = [("org:acme", 2, None)]
    windows.take("a", 10, ["org:acme"])
    now[0] += 30
    windows.take("b", 10, ["org:acme"])
    assert windows.full(bounds) == "org:acme"
    now[0] += 30  # "a" was admitted 60 s ago: out of the window
    assert windows.full(bounds) is None and windows.usage("org:acme") == (1, 10)
    windows.settle("b", 3)
    assert windows.usage("org:acme") == (1, 3)
    now[0] += 30
    assert windows.usage("org:acme") == (0, 0)
    windows.settle("b", 50)  # settled after leaving the window: nothing to change
    assert windows.usage("org:acme") == (0, 0)


def test_the_windows_of_keys_gone_quiet_are_let_go():
    """A window was trimmed only when its own org or key made a request: a key that made a burst and
    went quiet kept its minute of admissions in memory for ever (thousands of runtime keys: each its own)."""
    now = [0.0]
    windows = MinuteWindows(clock=lambda: now[0])
    for k in range(1000):
        for i in range(50):
            windows.take(f"g{k}-{i}", 10, [f"key:k{k}"])
    windows.settle("g0-0", 3)
    now[0] = 61.0
    windows.take("busy-1", 5, ["key:busy"])
    assert windows.full([("key:busy", 100, None)]) is None
    assert list(windows._windows) == ["key:busy"] and windows.usage("key:busy") == (1, 5)
    windows.settle("g0-1", 4)  # settled after its window was let go: nothing to change, nothing raised
    assert windows.usage("key:k0") == (0, 0)
    windows.take("k0-again", 7, ["key:k0"])
    assert windows.usage("key:k0") == (1, 7)


def test_tokens_per_minute_admit_while_the_others_are_below_the_bound():
    windows = MinuteWindows(clock=lambda: 0.0)
    bounds = [("key:k", None, 100)]
    windows.take("a", 99, ["key:k"])
    assert windows.full(bounds) is None  # 99 < 100: one more may go, whatever it reserves
    windows.take("b", 500, ["key:k"])
    assert windows.full(bounds) == "key:k"


@pytest.mark.parametrize("where", ["orgs", "keys"])
@pytest.mark.parametrize("value", [0, -5, "10", 1.5, True])
def test_a_bad_per_minute_bound_is_one_line_naming_the_key(tmp_path, where, value):
    config = base_config("http://127.0.0.1:1/v1", tmp_path / "u.db")
    config[where][0]["requests_per_minute"] = value
    with pytest.raises(ConfigError) as refused:
        parse_config(config, source="kiln.toml", base_dir=tmp_path)
    assert f"{where}[0].requests_per_minute" in str(refused.value)


async def test_two_replica_processes_share_an_orgs_requests_per_minute(tmp_path, mock_url, pg_url):
    a, b = await two_replicas(tmp_path, mock_url, pg_url, orgs=orgs(requests_per_minute=5, max_in_flight=64))
    try:
        async with aiohttp.ClientSession() as s:
            async def one(url: str) -> int:
                async with s.post(f"{url}/v1/completions", json=completion_body(),
                                  headers={"Authorization": f"Bearer {KEY}"}) as resp:
                    await resp.read()
                    return resp.status
            statuses = await asyncio.gather(*(one(url) for url in (a.url, b.url) * 8))
        assert sorted(statuses) == [200] * 5 + [429] * 11
    finally:
        await stop_all(a, b)


def test_a_long_window_is_compacted_and_settles_what_is_still_in_it():
    now = [0.0]
    windows = MinuteWindows(clock=lambda: now[0])
    bounds = [("org:acme", None, None)]
    for i in range(6000):  # 6000 admissions over 180 s, each checked first as the gateway does
        now[0] = i * 0.03
        assert windows.full(bounds) is None
        windows.take(f"g{i}", 10, ["org:acme"])
    window = windows._windows["org:acme"]
    assert window.dropped > 0 and len(window.times) < 6000  # what left the window was let go
    windows.settle("g10", 1)  # left the window long ago: nothing changes
    windows.settle("g5999", 4)
    assert windows.usage("org:acme") == (2000, 2000 * 10 - 6)  # the last 60 s: admissions 4000-5999
    windows.settle("g5998", 0)
    assert windows.usage("org:acme") == (2000, 2000 * 10 - 16)
