"""SPEC 13's routing, through a real gateway (``Harness``) in front of several mock upstreams: where each
request went is read from the mocks' own request logs (``/mock/requests``) and prompt caches (``/mock/cache``).

Each test names the rule it needs; without that rule its assertion fails (noted per test)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
from aiohttp import web
from closed_ports import refused_port

from kilnproxy.ops.admin import LOADS
from kilnproxy.testing import Harness
from kilnproxy.web.server import start_app, start_mock

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def mocks(n: int, **options):
    started = [await start_mock(**options) for _ in range(n)]
    try:
        yield started
    finally:
        for m in started:
            await m.stop()


def routed(urls: list[str], **model):
    """A Harness ``configure``: the test model served by ``urls`` with ``model``'s keys."""
    def configure(config: dict) -> None:
        config["models"][0]["upstreams"] = urls
        config["models"][0].update(model)
    return configure


def chat(opening: str, turns: int = 1, **extra) -> dict:
    """A conversation's body at its ``turns``-th turn: the same opening, a growing tail."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": opening}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"and {t}?"}]
    return {"model": "test-model", "messages": messages, "max_tokens": 2, **extra}


async def log_of(session: aiohttp.ClientSession, mock) -> list[dict]:
    async with session.get(f"{mock.url}/mock/requests") as resp:
        return [r for r in await resp.json() if r["path"].endswith("/completions")]


async def where(session, servers, marker: str) -> list[int]:
    """The index of the server that received each request whose first user message is ``marker``: the
    turns in order (a later turn has more messages), then the servers' order."""
    found = []
    for i, m in enumerate(servers):
        for r in await log_of(session, m):
            messages = r["body"].get("messages", [])
            users = [x["content"] for x in messages if x.get("role") == "user"]
            if users and users[0] == marker:
                found.append((len(messages), i))
    return [i for _, i in sorted(found)]


async def send(h: Harness, body: dict) -> dict:
    async with h.post("/v1/chat/completions", body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


# -- cache_aware -------------------------------------------------------------------------------------------


async def test_the_turns_of_a_conversation_go_where_its_first_turn_went(tmp_path):
    """(least_busy or round_robin: the turns spread over the three.)"""
    async with mocks(3) as servers:
        async with Harness(tmp_path, configure=routed([f"{m.url}/v1" for m in servers], routing="cache_aware",
                                                       load_poll=0)) as h:
            for conversation in range(4):
                for turn in range(1, 5):
                    await send(h, chat(f"conversation {conversation}", turn))
            for conversation in range(4):
                placed = await where(h.session, servers, f"conversation {conversation}")
                assert len(placed) == 4 and len(set(placed)) == 1, placed


async def test_different_openings_spread(tmp_path):
    """(a key that picked a fixed upstream, or no key at all with the first upstream first: one server.)"""
    async with mocks(3) as servers:
        async with Harness(tmp_path, configure=routed([f"{m.url}/v1" for m in servers], routing="cache_aware",
                                                       load_poll=0)) as h:
            for c in range(30):
                await send(h, chat(f"opening {c}"))
            counts = [len(await log_of(h.session, m)) for m in servers]
            assert sum(counts) == 30 and min(counts) >= 4, counts


async def test_prompt_cache_key_groups_different_openings(tmp_path):
    """(the opening as the key: the ten openings spread.)"""
    async with mocks(3) as servers:
        async with Harness(tmp_path, configure=routed([f"{m.url}/v1" for m in servers], routing="cache_aware",
                                                       load_poll=0)) as h:
            for c in range(10):
                await send(h, chat(f"grouped {c}", prompt_cache_key="tenant-7"))
            placed = [i for c in range(10) for i in await where(h.session, servers, f"grouped {c}")]
            assert len(placed) == 10 and len(set(placed)) == 1, placed
            logged = [r for m in servers for r in await log_of(h.session, m)]
            assert {r["body"]["prompt_cache_key"] for r in logged} == {"tenant-7"}  # sent on unchanged


async def test_a_hot_opening_spills_over_by_the_bound(tmp_path):
    """Six requests held at once with one opening: the first upstream in its order takes each while its
    load is below ⌈1.25 × (L + 1) / 3⌉ + 1, the others go to the next upstream in the order: loads
    (0,0,0) → first, (1,0,0) → first, (2,0,0) → first (bound 3), (3,0,0) → second (bound 3),
    (3,1,0) → first (bound 4), (4,1,0) → second. (No bound: all six on one.)"""
    async with mocks(3) as servers:
        async with Harness(tmp_path, configure=routed([f"{m.url}/v1" for m in servers], routing="cache_aware",
                                                       load_poll=0)) as h:
            streams = []
            for _ in range(6):
                resp = await h.session.post(f"{h.url}/v1/chat/completions", headers=h.headers(),
                                            json=chat("the shared system prompt", stream=True,
                                                      mock={"silence": 30}))
                assert resp.status == 200
                streams.append(resp)
            try:
                placed = await where(h.session, servers, "the shared system prompt")
                counts = sorted((placed.count(i) for i in range(3)), reverse=True)
                assert counts == [4, 2, 0], placed
            finally:
                for resp in streams:
                    resp.close()


async def test_a_server_marked_down_moves_only_its_conversations_and_they_return(tmp_path):
    """(an order that is not per key, e.g. a modulo of the up upstreams: others move too.)"""
    async with mocks(3) as servers:
        async with Harness(tmp_path, configure=routed([f"{m.url}/v1" for m in servers], routing="cache_aware",
                                                       load_poll=0)) as h:
            names = [f"conv {c}" for c in range(15)]
            for name in names:
                await send(h, chat(name))
            first = {name: (await where(h.session, servers, name))[0] for name in names}
            down = first[names[0]]
            upstream = h.gw.routes["test-model"].upstreams[down]
            upstream.mark_down(time.monotonic() + 600)
            for name in names:
                await send(h, chat(name, 2))
            second = {name: (await where(h.session, servers, name))[1] for name in names}
            for name in names:
                if first[name] == down:
                    assert second[name] != down
                else:
                    assert second[name] == first[name], (name, first[name], second[name])
            upstream.check_passed()
            for name in names:
                await send(h, chat(name, 3))
            third = {name: (await where(h.session, servers, name))[2] for name in names}
            assert third == first


async def test_a_failed_attempt_moves_on_along_the_keys_order(tmp_path):
    """A server that refuses connections, not yet marked down, first in some conversations' orders: each of
    those goes on to the next upstream in its own order, the one it goes to once that server is marked
    down. (A failover in another order, e.g. to the least busy: some land elsewhere.)"""
    dead = f"http://127.0.0.1:{refused_port()}/v1"
    async with mocks(3) as servers:
        def configure(config):
            routed([dead] + [f"{m.url}/v1" for m in servers], routing="cache_aware", load_poll=0)(config)
            config["server"]["upstream_max_failures"] = 1000  # its failures do not mark it down here
        async with Harness(tmp_path, configure=configure) as h:
            names = [f"failing over {c}" for c in range(30)]
            for name in names:
                await send(h, chat(name))
            refused = h.gw.routes["test-model"].upstreams[0]
            assert refused.failures_total >= 3 and refused.is_up(time.monotonic())  # tried first, failed over
            first = {name: (await where(h.session, servers, name))[0] for name in names}
            refused.mark_down(time.monotonic() + 600)
            for name in names:
                await send(h, chat(name, 2))
            second = {name: (await where(h.session, servers, name))[1] for name in names}
            assert second == first


async def test_embeddings_are_routed_least_busy(tmp_path):
    """An embedding has no opening: the least busy upstream, in turn (cache_aware's order would need a key)."""
    async with mocks(2) as servers:
        async with Harness(tmp_path, configure=routed([f"{m.url}/v1" for m in servers], routing="cache_aware",
                                                       load_poll=0, endpoints=["embeddings"])) as h:
            for i in range(4):
                async with h.post("/v1/embeddings", {"model": "test-model", "input": "same words"}) as resp:
                    assert resp.status == 200, await resp.text()
            counts = []
            for m in servers:
                async with h.session.get(f"{m.url}/mock/requests") as resp:
                    counts.append(sum(1 for r in await resp.json() if r["path"].endswith("/embeddings")))
            assert counts == [2, 2]


# -- round_robin and least_busy -----------------------------------------------------------------------------


async def test_round_robin_takes_them_in_turn(tmp_path):
    async with mocks(3) as servers:
        async with Harness(tmp_path, configure=routed([f"{m.url}/v1" for m in servers], routing="round_robin",
                                                       load_poll=0)) as h:
            for c in range(6):
                await send(h, chat(f"rr {c}"))
            order = [(await where(h.session, servers, f"rr {c}"))[0] for c in range(6)]
            assert order[:3] == order[3:] and sorted(order[:3]) == [0, 1, 2]


async def hold_directly(session, mock, n: int) -> list[aiohttp.ClientResponse]:
    """``n`` streams sent to ``mock`` by a client that bypasses the gateway, held open (its /metrics
    counts them running)."""
    held = []
    for _ in range(n):
        resp = await session.post(f"{mock.url}/v1/chat/completions",
                                  json={**chat("from elsewhere", stream=True), "mock": {"silence": 60}})
        assert resp.status == 200
        held.append(resp)
    return held


async def loads_read(h: Harness, url: str, at_least: int) -> None:
    """Until the gateway's poller has read a load of at least ``at_least`` at ``url``."""
    watch = h.app[LOADS]
    for _ in range(500):
        route = h.gw.routes["test-model"]
        pool = next(u.slots for u in route.upstreams if u.base_url == url)
        if pool.load_at(time.monotonic()) >= at_least:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no load {at_least} read at {url}: {watch.pollers}")


async def test_least_busy_avoids_a_server_busy_with_requests_from_elsewhere(tmp_path):
    """Server 0 runs three requests a client sent it directly; its /metrics says so. (Counting only this
    replica's requests, least_busy would send half the requests there.)"""
    async with mocks(2) as servers:
        urls = [f"{m.url}/v1" for m in servers]
        async with Harness(tmp_path, configure=routed(urls, load_poll=0.05)) as h:
            held = await hold_directly(h.session, servers[0], 3)
            try:
                await loads_read(h, urls[0], 3)
                for c in range(6):
                    await send(h, chat(f"lb {c}"))
                placed = [(await where(h.session, servers, f"lb {c}"))[0] for c in range(6)]
                assert placed == [1] * 6
            finally:
                for resp in held:
                    resp.close()


async def test_cache_aware_leaves_a_server_loaded_from_elsewhere(tmp_path):
    """The bound counts the servers' own loads: a conversation whose first upstream runs six requests from
    elsewhere goes to the next one. (Without the reads its first upstream's load is 0.)"""
    async with mocks(2) as servers:
        urls = [f"{m.url}/v1" for m in servers]
        async with Harness(tmp_path, configure=routed(urls, routing="cache_aware", load_poll=0.05)) as h:
            await send(h, chat("where does this go"))
            home = (await where(h.session, servers, "where does this go"))[0]
            held = await hold_directly(h.session, servers[home], 6)
            try:
                await loads_read(h, urls[home], 6)
                await send(h, chat("where does this go", 2))
                assert (await where(h.session, servers, "where does this go"))[1] == 1 - home
            finally:
                for resp in held:
                    resp.close()


# -- a /metrics that hangs, lies or is missing --------------------------------------------------------------


async def odd_server(metrics_answer: str):
    """A model server whose chat answers at once and whose /metrics (and /slots) ``metrics_answer``:
    "hang" (never answers; ``reading`` is set while a read waits), "lie" (a load beyond belief and
    garbage), "missing" (404)."""
    reading = asyncio.Event()
    release = asyncio.Event()

    async def metrics(request: web.Request) -> web.StreamResponse:
        if metrics_answer == "hang":
            reading.set()
            await release.wait()
        if metrics_answer == "lie":
            reading.set()
            return web.Response(text="vllm:num_requests_running 1e99\nvllm:num_requests_waiting -5\n")
        if metrics_answer == "lie-slots":
            return web.Response(body=b'[{"is_processing": "yes"}, 7]', content_type="application/json")
        raise web.HTTPNotFound()

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"id": "x", "object": "chat.completion", "created": 1, "model": body["model"],
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/slots", metrics if metrics_answer != "lie" else metrics)
    app.router.add_post("/v1/chat/completions", completions)
    running = await start_app(app, "127.0.0.1", 0)
    return running, reading, release


@pytest.mark.parametrize("answer", ["hang", "lie", "missing"])
@pytest.mark.parametrize("routing", ["least_busy", "cache_aware"])
async def test_a_metrics_endpoint_that_hangs_lies_or_is_missing_does_not_hold_a_request(tmp_path, answer, routing):
    """Both upstreams' reads hang (or lie, or 404): the requests are answered while they do. (A read on the
    request path would wait with them; a lie believed would be a load no bound lets through.)"""
    servers = [await odd_server(answer) for _ in range(2)]
    try:
        urls = [f"{s[0].url}/v1" for s in servers]
        async with Harness(tmp_path, configure=routed(urls, routing=routing, load_poll=0.05)) as h:
            if answer != "missing":
                for _, reading, _ in servers:
                    await asyncio.wait_for(reading.wait(), 10)
            for c in range(4):
                body = await send(h, chat(f"odd {c}"))
                assert body["choices"][0]["message"]["content"] == "hi"
            if answer == "hang":
                assert not any(release.is_set() for _, _, release in servers)  # still hanging meanwhile
            for upstream in h.gw.routes["test-model"].upstreams:
                assert upstream.slots.load_at(time.monotonic()) == 0
    finally:
        for running, _, release in servers:
            release.set()
            await running.stop()


async def test_a_read_older_than_three_intervals_is_not_used(tmp_path):
    """Server 0 said it ran 5 requests, then its /metrics stopped answering: once that read is older than
    3 load_poll intervals, server 0's load is this replica's own again (0) and least_busy sends it its turn.
    (A stale read believed: server 0 stays at 5 and gets nothing.)"""
    hang, hanging, release, answered = [False], asyncio.Event(), asyncio.Event(), []

    async def metrics(request: web.Request) -> web.Response:
        if hang[0]:
            hanging.set()
            await release.wait()
        return web.Response(text="vllm:num_requests_running 5\n")

    async def completions(request: web.Request) -> web.Response:
        answered.append(await request.json())
        return web.json_response({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", completions)
    stale = await start_app(app, "127.0.0.1", 0)
    try:
        async with mocks(1) as [other]:
            urls = [f"{stale.url}/v1", f"{other.url}/v1"]
            async with Harness(tmp_path, configure=routed(urls, load_poll=0.05)) as h:
                pool = h.gw.routes["test-model"].upstreams[0].slots
                await loads_read(h, urls[0], 5)
                for c in range(2):
                    await send(h, chat(f"fresh {c}"))
                assert answered == []  # its fresh read of 5: the other server takes them
                hang[0] = True
                await asyncio.wait_for(hanging.wait(), 10)
                for _ in range(1000):  # until the last read is more than 3 intervals old
                    if pool.load_at(time.monotonic()) == 0:
                        break
                    await asyncio.sleep(0.01)
                assert pool.load_at(time.monotonic()) == 0
                for c in range(4):
                    await send(h, chat(f"stale {c}"))
                assert len(answered) == 2  # least_busy's turn: two of the four
    finally:
        release.set()
        await stale.stop()


# -- the poller's life: with the gateway, re-watched on reload, stopped at shutdown ---------------------------


async def test_the_poller_starts_with_the_gateway_follows_a_reload_and_stops(tmp_path):
    async with mocks(3) as servers:
        urls = [f"{m.url}/v1" for m in servers]
        config_path = tmp_path / "gw.toml"
        async with Harness(tmp_path, configure=routed(urls[:2], load_poll=0.05)) as h:
            watch = h.app[LOADS]
            [poller] = watch.pollers.values()
            assert sorted(poller.origins()) == sorted(m.url for m in servers[:2])  # one task per origin
            tasks = [s.task for s in poller.origins().values()]
            assert all(t is not None and not t.done() for t in tasks)
            # a reload: the third server in, the first out
            from processes import toml
            config = dict(h.config)
            config["models"] = [{**h.config["models"][0], "upstreams": urls[1:], "load_poll": 0.05}]
            config_path.write_text(toml(config))
            h.gw.config = __import__("dataclasses").replace(h.gw.config, source=str(config_path))
            from kilnproxy.ops.admin import RELOADER
            ok, message = h.app[RELOADER].reload()
            assert ok, message
            assert sorted(poller.origins()) == sorted(m.url for m in servers[1:])
            await asyncio.sleep(0)
            assert tasks[0].cancelled() or tasks[0].done()
            for upstream in h.gw.routes["test-model"].upstreams:
                assert upstream.slots.polled is poller.state_of(upstream.base_url)
            kept = [s.task for s in poller.origins().values()]
        assert all(t.done() for t in kept)  # stopped with the gateway
