"""Runtime keys across two real replica processes on one PostgreSQL: a key made or revoked through
one replica's admin API is in force on the other within a second, and a key's limit holds across
both under concurrent requests; an expired key finishes its stream and is refused after."""

import asyncio
from datetime import datetime, timedelta, timezone

import aiohttp
from replicas import Ledger, open_stream, stalled, stop_all, two_replicas

from kilnproxy.testing import completion_body

PROPAGATION = 1.0  # seconds

# the test model: 0.10 and 0.30 USD per million prompt and completion tokens; the prompt of
# completion_body() is estimated at 6 tokens, so a hold of max_tokens=100 is:
HOLD = (6 * 0.10 + 100 * 0.30) / 1e6


async def status_of(session, url: str, secret: str) -> int:
    async with session.post(f"{url}/v1/completions", json=completion_body(),
                            headers={"Authorization": f"Bearer {secret}"}) as resp:
        await resp.read()
        return resp.status


async def within(seconds: float, predicate) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await predicate():
        assert loop.time() - start < seconds, f"not true within {seconds} s"
        await asyncio.sleep(0.02)


async def test_a_key_made_and_revoked_on_one_replica_is_in_force_on_the_other_within_a_second(
        tmp_path, mock_url, pg_url):
    a, b = await two_replicas(tmp_path, mock_url, pg_url)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{a.url}/admin/v1/keys", json={"org": "acme", "name": "ci"}) as resp:
                assert resp.status == 201
                created = await resp.json()
            secret, key_id = created["key"], created["data"]["id"]
            assert await status_of(s, a.url, secret) == 200  # in force on A before its answer was sent

            async def works_on_b():
                return await status_of(s, b.url, secret) == 200
            await within(PROPAGATION, works_on_b)

            async with s.delete(f"{a.url}/admin/v1/keys/{key_id}") as resp:
                assert resp.status == 200 and (await resp.json())["revoked"] is True
            assert await status_of(s, a.url, secret) == 401

            async def refused_on_b():
                return await status_of(s, b.url, secret) == 401
            await within(PROPAGATION, refused_on_b)
    finally:
        await stop_all(a, b)


async def test_a_key_limit_of_two_requests_holds_under_eight_at_once_over_two_replicas(
        tmp_path, mock_url, pg_url):
    a, b = await two_replicas(tmp_path, mock_url, pg_url)
    held = []
    try:
        async with aiohttp.ClientSession() as s, Ledger(pg_url) as db:
            limit = HOLD * 1.5  # the first hold leaves half a hold: the second is admitted, the third not
            async with s.post(f"{a.url}/admin/v1/keys", json={"org": "acme", "name": "capped",
                                                              "limit": limit}) as resp:
                created = await resp.json()
            secret, key_id = created["key"], created["data"]["id"]

            await within(PROPAGATION, lambda: _key_seen(s, b.url, secret))
            held = await asyncio.gather(*(open_stream(s, url, stalled(max_tokens=100), secret)
                                          for url in (a.url, b.url) * 4))
            statuses = sorted(r.status for r in held)
            assert statuses == [200, 200] + [402] * 6
            for resp in held:
                if resp.status == 402:
                    assert (await resp.json())["error"]["code"] == "key_limit_exceeded"
                resp.close()
            rows = await _rows(db, 8, key_id)
            assert sorted((r["status"], r["error_code"]) for r in rows) == (
                [(200, None)] * 2 + [(402, "key_limit_exceeded")] * 6)
    finally:
        for resp in held:
            resp.close()
        await stop_all(a, b)


async def _key_seen(session, url: str, secret: str) -> bool:
    async with session.get(f"{url}/v1/key", headers={"Authorization": f"Bearer {secret}"}) as resp:
        return resp.status == 200


async def _rows(db: Ledger, n: int, key_id: str) -> list[dict]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while len(rows := await db.rows(key_id=key_id)) < n:
        assert loop.time() < deadline, rows
        await asyncio.sleep(0.02)
    return rows


async def test_an_expired_key_finishes_its_stream_and_is_refused_after(harness):
    async with harness() as h:
        expires = datetime.now(timezone.utc) + timedelta(seconds=1)
        secret, key = await h.gw.tenancy.create_key("acme", "short", expires_at=expires.isoformat())
        await h.gw.tenants.refresh()
        body = completion_body(stream=True, max_tokens=12, mock={"delay": 0.2})  # about 2.4 s of words
        async with h.post("/v1/completions", body, key=secret) as resp:
            assert resp.status == 200
            raw = await resp.read()
        assert datetime.now(timezone.utc) > expires  # the key expired while its stream went on
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
        async with h.post("/v1/completions", completion_body(), key=secret) as resp:
            assert resp.status == 401
        assert [r["status"] for r in await h.rows(key_id=key["id"])] == [200]


async def test_a_runtime_secret_is_nowhere_in_postgresql_files_the_spool_or_the_logs(
        tmp_path, mock_url, pg_url, postgres):
    a, b = await two_replicas(tmp_path, mock_url, pg_url, log={"access": True, "bodies": True})
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{a.url}/admin/v1/keys", json={"org": "acme", "name": "leaky"}) as resp:
                created = await resp.json()
            secret, key_id = created["key"], created["data"]["id"]
            await within(PROPAGATION, lambda: _key_seen(s, b.url, secret))
            for url in (a.url, b.url):
                assert await status_of(s, url, secret) == 200
            async with s.delete(f"{a.url}/admin/v1/keys/{key_id}") as resp:
                assert resp.status == 200
        async with Ledger(pg_url) as db:
            await _rows(db, 2, key_id)
        postgres.psql("CHECKPOINT")  # the tables on disk as well as in the WAL
        for replica in (a, b):  # the access log's line of each request (written out in batches)
            await replica.wait_for("stdout", key_id)
    finally:
        await stop_all(a, b)
    logs = "\n".join(line for p in (a, b) for lines in p.lines.values() for line in lines)
    assert key_id in logs  # the access log was written, with the key's id
    files = [p for root in (postgres.data, tmp_path) for p in root.rglob("*") if p.is_file()] + [postgres.log]
    assert any(p.name.startswith("spool") for p in files)
    assert any(key_id.encode() in p.read_bytes() for p in files if "pg_wal" in p.parts)  # the scan sees the key
    for text in (secret, secret[8:]):
        assert text not in logs
        for path in files:
            assert text.encode() not in path.read_bytes(), path
