"""Fallbacks across catalog models, `first_byte_timeout` and `request_timeout`, and the row's `requested_model`."""

import asyncio
import sqlite3
import time

import pytest
from closed_ports import refused_port

from kilnproxy.mock_servers.mock_upstream import OPTIONS, STATS
from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.testing import MODEL
from kilnproxy.web.server import start_mock

GEN = "X-Neocloud-Generation-Id"
SMALL = "small-model"
OTHER = "other-model"
DEAD = f"http://127.0.0.1:{refused_port()}/v1"


@pytest.fixture
async def hung():
    """A model server that accepts requests and never answers them."""
    running = await start_mock()
    running.app[OPTIONS]["fail"] = "hang"
    yield running
    await running.stop()


def chain(first_upstream: str, fallbacks=(SMALL,), key_models=None, **first):
    """The test model on ``first_upstream``, falling back to SMALL and OTHER (both on the mock)."""
    def configure(config):
        m = config["models"][0]
        mock = m["upstreams"][0]
        config["models"] += [{**m, "id": SMALL, "upstream_model": "org/Small-1B", "upstreams": [mock],
                              "pricing": {"prompt": 0.01, "completion": 0.02}},
                             {**m, "id": OTHER, "upstream_model": "org/Other-3B", "upstreams": [mock]}]
        m.update(upstreams=[first_upstream], fallbacks=list(fallbacks), **first)
        if key_models is not None:
            config["keys"][0]["models"] = key_models
    return configure


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_model_falls_back_with_its_name_and_prices(harness, stream):
    async with harness(configure=chain(DEAD)) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 4,
                                              "stream": stream}) as resp:
            assert resp.status == 200
            raw = await resp.read()
            gen = resp.headers[GEN]
        assert b'"model":"small-model"' in raw and MODEL.encode() not in raw
        sent = (await h.mock_requests())[-1]["body"]
        assert sent["model"] == "org/Small-1B"
        row = await h.row(gen)
        assert (row["model"], row["requested_model"], row["status"]) == (SMALL, MODEL, 200)
        assert row["cost"] == pytest.approx((3 * 0.01 + 4 * 0.02) / 1_000_000)
        assert h.gw.fallback_counts == {(MODEL, SMALL): 1}
        assert h.gw.admission.count("acme") == 0 and h.gw.admission.held("acme") == 0
        async with h.session.get(f"{h.url}/metrics") as m:
            assert 'kilnproxy_fallbacks_total{from_model="test-model",to_model="small-model"} 1.0' in await m.text()


async def test_a_chain_where_every_model_is_down_is_503_with_one_row(harness):
    async with harness(configure=chain(DEAD, fallbacks=(SMALL, OTHER))) as h:
        until = time.monotonic() + 600
        for route in h.gw.routes.values():
            for upstream in route.upstreams:
                upstream.mark_down(until)
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_backend_available"
        rows = await h.rows()
        assert [(r["status"], r["error_code"], r["model"], r["requested_model"]) for r in rows] == [
            (503, "no_backend_available", MODEL, MODEL)]  # no model served: the one asked for
        assert h.mock.app[STATS]["requests"] == 0


async def test_a_fallback_the_key_may_not_use_is_skipped(harness, store):
    async with harness(overrides=store, configure=chain(DEAD, fallbacks=(SMALL, OTHER),
                                                        key_models=[MODEL, OTHER])) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200
            assert (await resp.json())["model"] == OTHER
            gen = resp.headers[GEN]
        assert [r["body"]["model"] for r in await h.mock_requests()] == ["org/Other-3B"]
        row = await h.row(gen)
        assert (row["model"], row["requested_model"]) == (OTHER, MODEL)
        assert h.gw.fallback_counts == {(MODEL, OTHER): 1}


async def test_a_fallback_the_org_cannot_afford_is_skipped(harness):
    async with harness(configure=chain(DEAD)) as h:
        h.gw.credits.granted["acme"] = 1e-9  # admitted (remaining > 0), but nothing left for a new hold
        h.gw.credits.spent["acme"] = 0.0
        h.gw.admission.rehold_was = h.gw.admission.rehold

        async def refuse(old, new):
            h.gw.credits.spent["acme"] = 1.0  # spent meanwhile by another request
            return await h.gw.admission.rehold_was(old, new)
        h.gw.admission.rehold = refuse
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi"}) as resp:
            assert resp.status == 502  # what the model asked for answered: refused
        rows = await h.rows()
        assert [(r["model"], r["requested_model"], r["error_code"]) for r in rows] == [
            (MODEL, MODEL, "upstream_unreachable")]
        assert h.mock.app[STATS]["requests"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_server_that_never_answers_misses_its_first_byte_and_falls_back(harness, hung, stream):
    # long enough for the hung server to have read the request on a loaded machine (it counts it then): 1 s
    # was not, once, with the suite's workers beside other work (a load average of 20 on two cores)
    async with harness(configure=chain(f"{hung.url}/v1", first_byte_timeout=3.0)) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                              "stream": stream}) as resp:
            assert resp.status == 200
            raw = await resp.read()
            gen = resp.headers[GEN]
        assert b'"model":"small-model"' in raw
        row = await h.row(gen)
        assert (row["model"], row["requested_model"], row["error_code"]) == (SMALL, MODEL, None)
        assert hung.app[STATS]["requests"] == 1
        async with h.session.get(f"{hung.url}/mock/wait", params={"hangups": 1}) as w:
            assert (await w.json())["hangups"] == 1  # the hung request was closed


async def test_a_missed_first_byte_with_no_fallback_is_504(harness, hung):
    async with harness(configure=chain(f"{hung.url}/v1", fallbacks=(), first_byte_timeout=0.1)) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}) as resp:
            assert resp.status == 504 and resp.headers["Content-Type"].startswith("application/json")
            assert (await resp.json())["error"]["code"] == "upstream_timeout"
            row = await h.row(resp.headers[GEN])
        assert (row["status"], row["error_code"]) == (504, "upstream_timeout")


@pytest.mark.parametrize("small", ["down", "busy", "free"])
async def test_a_fallback_whose_request_timeout_has_passed_is_504_however_its_upstreams_are(harness, hung, small):
    """The requested model misses its first byte; by then the fallback's request_timeout (counted from
    admission) has passed: 504 upstream_timeout and no further fallback, whether the fallback's
    upstream is marked down, has no free slot, or has one."""
    def configure(config):
        chain(f"{hung.url}/v1", fallbacks=(SMALL, OTHER), first_byte_timeout=0.2)(config)
        m = next(m for m in config["models"] if m["id"] == SMALL)
        m.update(request_timeout=0.1, upstreams=[{"url": m["upstreams"][0], "max_in_flight": 1}], queue_timeout=60)
        next(m for m in config["models"] if m["id"] == OTHER)["upstreams"] = [DEAD]
    async with harness(configure=configure) as h:
        upstream = h.gw.routes[SMALL].upstreams[0]
        if small == "down":
            upstream.mark_down(time.monotonic() + 600)
        elif small == "busy":
            upstream.slots.take()
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "upstream_timeout"
            row = await h.row(resp.headers[GEN])
        assert (row["status"], row["error_code"], row["requested_model"]) == (504, "upstream_timeout", MODEL)
        assert h.gw.fallback_counts == {(MODEL, SMALL): 1}  # OTHER was not tried
        assert h.mock.app[STATS]["requests"] == 0 and upstream.slots.queued() == 0


async def test_a_stream_past_request_timeout_ends_with_an_error_event(harness):
    async with harness(configure=lambda c: c["models"][0].update(request_timeout=1.0)) as h:  # room for 2 words
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 6,
                                              "mock": {"fail": "stall", "after": 2}}) as resp:
            assert resp.status == 200
            raw = await resp.read()
            gen = resp.headers[GEN]
        assert raw.endswith(b'"code":"upstream_timeout"}}\n\ndata: [DONE]\n\n')
        row = await h.row(gen)
        assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, "upstream_timeout", 2)


async def test_a_json_answer_past_request_timeout_is_504(harness):
    async with harness(configure=lambda c: c["models"][0].update(request_timeout=0.2, fallbacks=[])) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "mock": {"fail": "hang"}}) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "upstream_timeout"
            row = await h.row(resp.headers[GEN])
        assert (row["status"], row["error_code"]) == (504, "upstream_timeout")


async def test_an_upstream_answering_500_falls_back(harness):
    bad = await start_mock()
    bad.app[OPTIONS]["fail"] = "500"
    try:
        async with harness(configure=chain(f"{bad.url}/v1")) as h:
            async with h.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) as resp:
                assert resp.status == 200 and (await resp.json())["model"] == SMALL
    finally:
        await bad.stop()


@pytest.mark.parametrize("first", ["refused", "503"])
async def test_a_client_leaving_between_a_failed_attempt_and_its_fallback_pays_nothing(harness, store, eventually,
                                                                                       first):
    """The requested model's upstream refused the connection (or answered 503); the client leaves while
    its request waits for the fallback's only slot: no model server worked on it, so its row charges
    nothing, and everything it held is given back."""
    bad = await start_mock()
    bad.app[OPTIONS]["fail"] = "503"

    def configure(config):
        chain(DEAD if first == "refused" else f"{bad.url}/v1")(config)
        small = next(m for m in config["models"] if m["id"] == SMALL)
        small.update(upstreams=[{"url": small["upstreams"][0], "max_in_flight": 1}], queue_timeout=3600)
    try:
        async with harness(overrides=store, configure=configure) as h:
            slots = h.gw.routes[SMALL].upstreams[0].slots
            holder = await h.post("/v1/completions", {"model": SMALL, "prompt": "hi", "max_tokens": 2,
                                                      "stream": True, "mock": {"silence": 3600}}).__aenter__()
            leaver = asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": MODEL, "prompt": "a long prompt " * 200, "max_tokens": 2}))
            await eventually(lambda: slots.queued() == 1)
            leaver.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaver
            [row] = await eventually(lambda: h.rows(status=499))
            assert (row["disconnected"], row["prompt_tokens"], row["total_tokens"], row["cost"]) == (1, 0, 0, 0)
            assert (row["model"], row["requested_model"]) == (SMALL, MODEL)
            await eventually(lambda: (slots.queued(), h.gw.admission.count("acme")) == (0, 1))
            holder.close()
            await eventually(lambda: (slots.busy, h.gw.admission.count("acme")) == (0, 0))
    finally:
        await bad.stop()


async def test_an_older_ledger_gets_requested_model_filled_from_model(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE usage_events (id TEXT PRIMARY KEY, created_at TEXT NOT NULL, org TEXT NOT NULL,"
               " key_id TEXT NOT NULL, model TEXT, endpoint TEXT NOT NULL, stream INTEGER NOT NULL,"
               " status INTEGER NOT NULL, error_code TEXT, prompt_tokens INTEGER NOT NULL DEFAULT 0,"
               " completion_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0,"
               " total_tokens INTEGER NOT NULL DEFAULT 0, cost REAL NOT NULL DEFAULT 0, duration_ms REAL,"
               " ttft_ms REAL, finish_reason TEXT, disconnected INTEGER NOT NULL DEFAULT 0)")
    db.execute("INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status)"
               " VALUES ('gen-1', '2026-01-01T00:00:00.000+00:00', 'acme', 'k', 'm', 'completions', 0, 200)")
    db.commit()
    db.close()
    ledger = SQLiteLedger(path)
    await ledger.open()
    try:
        assert (await ledger.get("gen-1"))["requested_model"] == "m"
    finally:
        await ledger.close()
