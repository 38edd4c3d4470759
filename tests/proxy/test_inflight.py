"""The per-org in-flight limit (request rule 5 (docs/reference.md)): 429 at once, and a slot freed on every path."""

import asyncio
import random
import textwrap

import orjson
import pytest

from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.store.limits import rate_limited
from kilnproxy.testing import KEY, OTHER_KEY
from kilnproxy.testing import completion_body as body

GEN = "X-Neocloud-Generation-Id"

BOOM_PLUGIN = textwrap.dedent('''
    """Raises where the request's ``boom`` field says (removed before the body goes upstream)."""
    from kilnproxy import hookimpl

    @hookimpl
    def rewrite_request(call, body):
        call.state["boom"] = body.pop("boom", None)
        if call.state["boom"] == "rewrite_request":
            raise RuntimeError("boom in rewrite_request")

    @hookimpl
    def transform_event(call, event):
        boom = call.state.get("boom")
        if boom == "transform_event" and event.get("choices"):
            raise RuntimeError("boom in transform_event")
        if boom == "usage_event" and event.get("usage"):
            raise RuntimeError("boom on the usage chunk")

    @hookimpl
    def transform_response(call, body):
        if call.state.get("boom") == "transform_response":
            raise RuntimeError("boom in transform_response")

    @hookimpl
    def response_headers(call):
        if call.state.get("boom") == "bad_headers":
            return "not a mapping"  # a plugin bug the gateway did not foresee
''')



def inflight(h):
    return h.app[GATEWAY].admission


@pytest.fixture
def boom_plugin(tmp_path):
    path = tmp_path / "boom.py"
    path.write_text(BOOM_PLUGIN)
    return str(path)


async def hold(h, n, key=KEY, org="acme"):
    """Open ``n`` streams that stall after their first chunk; return the open responses."""
    held = []
    for _ in range(n):
        resp = await h.post("/v1/completions", body(stream=True, mock={"fail": "stall", "after": 1}), key=key)
        assert resp.status == 200
        await resp.content.readany()
        held.append(resp)
    assert inflight(h).count(org) == n
    return held


async def test_429_at_once_without_rate_limit_headers_and_per_org_override(harness, store, eventually):
    orgs = [{"id": "acme", "credits": 100.0, "max_in_flight": 2}, {"id": "globex", "credits": 100.0}]
    async with harness(overrides={**store, "orgs": orgs, "limits": {"max_in_flight_per_org": 3}}) as h:
        held = await hold(h, 2)
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 429
            error = (await resp.json())["error"]
            assert (error["code"], error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
            assert "Retry-After" not in resp.headers
            assert not [k for k in resp.headers if k.lower().startswith(("x-ratelimit", "ratelimit"))]
            assert resp.headers[GEN]
        held += await hold(h, 3, key=OTHER_KEY, org="globex")  # globex: the [limits] default, 3
        async with h.post("/v1/completions", body(), key=OTHER_KEY) as resp:
            assert resp.status == 429
        assert (await h.mock_requests())[-1]["body"]["mock"] == {"fail": "stall", "after": 1}
        assert len(await h.mock_requests()) == 5  # the refused requests never reached the upstream
        for resp in held:
            resp.close()
        await h.mock_wait(hangups=5)
        await eventually(lambda: inflight(h).snapshot() == {})
        await eventually(lambda: _count(h, 7))  # a shared store frees a slot in the commit of its row
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 200
        rows = await eventually(lambda: _count(h, 8))
        assert sorted(r["status"] for r in rows) == [200] * 6 + [429] * 2


async def _count(h, n):
    rows = await h.rows()
    return rows if len(rows) == n else None


@pytest.mark.parametrize("case", [
    "ok", "ok_stream", "upstream_500", "upstream_500_stream", "drop", "error_event", "garbage",
    "garbage_stream", "reset", "rewrite_request", "transform_event", "usage_event", "transform_response",
    "bad_headers", "idle_timeout_before_headers", "idle_timeout_mid_stream",
])
async def test_slot_is_released(harness, store, boom_plugin, case):
    """On every path; with PostgreSQL the hold's row goes with the request's row (the next request
    is admitted only if it did)."""
    overrides = {**store, "server": {"upstream_idle_timeout": 0.3}, "limits": {"max_in_flight_per_org": 1}}
    async with harness(plugins=[boom_plugin], overrides=overrides) as h:
        stream = case.endswith("_stream") or case in ("drop", "error_event", "transform_event", "usage_event",
                                                     "idle_timeout_mid_stream")
        request = body(stream=stream)
        mock = {"ok": None, "ok_stream": None, "upstream_500": "500", "upstream_500_stream": "500",
                "drop": "drop", "error_event": "error_event", "garbage": "garbage", "garbage_stream": "garbage",
                "reset": "reset", "idle_timeout_before_headers": "hang", "idle_timeout_mid_stream": "stall"}
        if mock.get(case):
            request["mock"] = {"fail": mock[case], "after": 2}
        elif case not in ("ok", "ok_stream"):
            request["boom"] = case
        async with h.post("/v1/completions", request) as resp:
            raw = await resp.read()
            status = resp.status
            gen_id = resp.headers[GEN]
        assert inflight(h).snapshot() == {}
        row = await h.row(gen_id)
        expected = {"ok": 200, "ok_stream": 200, "rewrite_request": 500, "transform_response": 500,
                    "bad_headers": 500, "upstream_500_stream": 502, "garbage_stream": 502}.get(case, 502 if not stream else 200)
        assert (status, row["status"]) == (expected, expected)
        if stream and status == 200:
            assert raw.endswith(b"data: [DONE]\n\n")
            if case != "ok_stream":
                assert "error" in orjson.loads(raw.split(b"data: ")[-2])
                assert row["error_code"] is not None
        elif status == 500:
            assert (await resp.json())["error"]["code"] == row["error_code"]
        if case in ("rewrite_request", "transform_event", "usage_event", "transform_response"):
            assert "boom" in raw.decode() and row["error_code"] == "plugin_error"
        async with h.post("/v1/completions", body()) as resp:  # the one slot is free again
            assert resp.status == 200


async def test_slot_is_released_on_client_disconnect(harness, store, eventually):
    async with harness(overrides={**store, "limits": {"max_in_flight_per_org": 1}}) as h:
        held = await hold(h, 1)
        held[0].close()
        await h.mock_wait(hangups=1)
        await eventually(lambda: inflight(h).snapshot() == {})
        await eventually(lambda: _count(h, 1))  # a shared store frees a slot in the commit of its row
        task = asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(),
                                                  json=body(mock={"fail": "hang"})))
        await eventually(lambda: inflight(h).count("acme") == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await h.mock_wait(hangups=2)
        await eventually(lambda: inflight(h).snapshot() == {})
        rows = await eventually(lambda: _count(h, 2))  # committed just after the slot was freed
        assert [r["disconnected"] for r in rows] == [1, 1]
        async with h.post("/v1/completions", body()) as resp:  # the one slot (and hold) is free again
            assert resp.status == 200


async def test_thousands_of_requests_with_failures_and_hang_ups_leave_no_slot_taken(harness, eventually):
    """2000 requests, 64 at a time, over two orgs: every org's in-flight count ends at 0."""
    total, concurrency = 2000, 64
    rng = random.Random(1234)
    overrides = {"limits": {"max_in_flight_per_org": 24}, "server": {"upstream_idle_timeout": 5}}
    async with harness(overrides=overrides) as h:
        seen: dict[str, int] = {}
        outcomes: dict[str, int] = {}
        queue = list(range(total))

        async def one(i: int) -> None:
            kind = rng.choice(["ok", "ok_stream", "500", "drop", "error_event", "garbage", "hangup_stream",
                               "hangup_early"])
            stream = kind in ("ok_stream", "drop", "error_event", "hangup_stream", "hangup_early")
            request = body(stream=stream, max_tokens=rng.randint(1, 12))
            if kind in ("500", "drop", "error_event", "garbage"):
                request["mock"] = {"fail": kind, "after": 1}
            if kind == "hangup_stream":
                request["mock"] = {"fail": "stall", "after": 1}
            if kind == "hangup_early":  # the client leaves before the first chunk
                request["mock"] = {"silence": 30}
            key = KEY if i % 2 else OTHER_KEY
            async with h.post("/v1/completions", request, key=key) as resp:
                seen[resp.headers[GEN]] = resp.status
                if kind.startswith("hangup") and resp.status == 200:
                    if kind == "hangup_stream":
                        await resp.content.readany()
                    resp.close()
                    outcomes["hangup"] = outcomes.get("hangup", 0) + 1
                    return
                await resp.read()
                outcomes[str(resp.status)] = outcomes.get(str(resp.status), 0) + 1

        async def worker() -> None:
            while queue:
                await one(queue.pop())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        assert sum(outcomes.values()) == total
        assert {"200", "429", "502", "hangup"} <= set(outcomes)
        rows = await eventually(lambda: _count(h, total))  # hung-up handlers finish after the client left
        assert inflight(h).snapshot() == {}
        by_id = {r["id"]: r for r in rows}
        assert all(by_id[g]["status"] == s for g, s in seen.items())
        assert sum(r["disconnected"] for r in rows) == outcomes["hangup"]
        stats = await eventually(lambda: _mock_idle(h))
        assert stats["open"] == 0


async def _mock_idle(h):
    async with h.session.get(f"{h.mock_url}/mock/stats") as resp:
        stats = await resp.json()
    return stats if stats["open"] == 0 else None


class RemoteAdmission:
    """Slots with a round trip in ``admit``, as a shared store has."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []

    async def admit(self, hold, limit: int) -> None:
        await asyncio.sleep(0)
        self.calls.append(("admit", hold.org))
        if self.counts.get(hold.org, 0) >= limit:
            raise rate_limited(hold.org, limit)
        self.counts[hold.org] = self.counts.get(hold.org, 0) + 1

    def release(self, hold) -> None:
        self.calls.append(("release", hold.org))
        self.counts[hold.org] -= 1

    def settled(self, hold, row) -> None:
        pass

    def held(self, org: str) -> float:
        return 0.0

    def count(self, org: str) -> int:
        return self.counts.get(org, 0)

    def snapshot(self) -> dict[str, int]:
        return {org: n for org, n in self.counts.items() if n}


async def test_another_in_flight_store_slots_in_behind_the_interface(harness, eventually):
    async with harness(overrides={"limits": {"max_in_flight_per_org": 1}}) as h:
        store = h.app[GATEWAY].admission = RemoteAdmission()
        held = await hold(h, 1)
        async with h.post("/v1/completions", body()) as resp:
            assert resp.status == 429
        held[0].close()
        await eventually(lambda: store.count("acme") == 0)
        async with h.post("/v1/completions", body(stream=True)) as resp:
            assert resp.status == 200
            await resp.read()
        assert store.calls == [("admit", "acme"), ("admit", "acme"), ("release", "acme"),
                               ("admit", "acme"), ("release", "acme")]
