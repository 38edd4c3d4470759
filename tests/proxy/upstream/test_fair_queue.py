"""The order of the queue for upstream slots (SPEC 14): interactive before batch priority, weighted round robin
between the orgs that wait, first come, first served within an org, ``batch_reserve`` slots never taken by batch
priority; checked on the pools themselves (the order of grants) and through a gateway on a real port."""

import asyncio
from dataclasses import replace

import pytest
from aiohttp import web

from kilnproxy.config import parse_config
from kilnproxy.proxy.upstream.fair_queue import Claim
from kilnproxy.proxy.upstream.routes import carry_over, routes_from
from kilnproxy.proxy.upstream.slots import SlotPool, UpstreamBusy, take_slot
from kilnproxy.testing import KEY, MODEL, OTHER_KEY
from kilnproxy.web.server import start_app

BATCH_KEY = "sk-test-acme-batch"
INITECH_KEY = "sk-test-initech"


# -- the pools' order, grant by grant ----------------------------------------------------------------

class Queue:
    """Requests waiting on ``pools`` and the order the pools granted them slots in (read off each waiter's
    future as the pool grants it, in the same call: no task needs to run in between)."""

    def __init__(self, *pools: SlotPool):
        self.pools = list(pools)
        self.granted: list[str] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self.waiting: dict[str, object] = {}  # name -> its waiter, while queued

    async def wait(self, name: str, claim: Claim, pools: list[SlotPool] | None = None) -> None:
        pools = pools or self.pools
        known = {w for p in pools for w in p.waiters}
        self.tasks[name] = asyncio.create_task(
            take_slot(pools, asyncio.get_running_loop().time() + 3600, claim=claim))
        await asyncio.sleep(0)  # the task runs up to its wait (or takes a free slot)
        new = [w for p in pools for w in p.waiters if w not in known]
        if new:
            self.waiting[name] = new[0]
        else:
            self.granted.append(name)

    def collect(self) -> list[str]:
        done = [n for n, w in self.waiting.items() if w.future.done() and not w.future.cancelled()]
        for n in done:
            del self.waiting[n]
        self.granted += done
        return done

    async def free(self, pool: SlotPool, turns: int = 1) -> list[str]:
        """Give back ``turns`` slots of ``pool``, one at a time: the names granted, in that order."""
        order = []
        for _ in range(turns):
            pool.give_back()
            order += self.collect()
        return order


def full(limit: int, reserve: int = 0) -> SlotPool:
    pool = SlotPool("http://gpu/v1", limit, reserve)
    pool.busy = limit
    return pool


async def test_an_org_queueing_many_delays_another_org_by_one_turn_per_org_waiting():
    pool = full(1)
    q = Queue(pool)
    for i in range(100):
        await q.wait(f"a{i}", Claim("a"))
    await q.wait("b0", Claim("b"))
    await q.wait("c0", Claim("c"))
    assert pool.queued() == 102
    assert await q.free(pool, 5) == ["a0", "b0", "c0", "a1", "a2"]  # b and c wait one turn per org before them
    assert await q.free(pool, 97) == [f"a{i}" for i in range(3, 100)]
    assert pool.queued() == 0 and pool.busy == 1


async def test_first_come_first_served_within_an_org_and_fewest_slots_for_the_weight_between_orgs():
    pool = full(1)
    q = Queue(pool)
    for i in range(30):
        await q.wait(f"a{i}", Claim("a", weight=2))
        await q.wait(f"b{i}", Claim("b", weight=1))
    order = await q.free(pool, 30)
    assert [n for n in order if n[0] == "a"] == [f"a{i}" for i in range(20)]  # in arrival order
    assert [n for n in order if n[0] == "b"] == [f"b{i}" for i in range(10)]  # half a's slots: half its weight
    for start in range(0, 30, 3):  # and in turns, not in runs
        assert sorted(n[0] for n in order[start:start + 3]) == ["a", "a", "b"]


async def test_an_org_that_comes_late_takes_turns_and_claims_nothing_of_what_the_others_had():
    pool = full(1)
    q = Queue(pool)
    for i in range(60):
        await q.wait(f"a{i}", Claim("a"))
    assert await q.free(pool, 40) == [f"a{i}" for i in range(40)]
    for i in range(10):
        await q.wait(f"b{i}", Claim("b"))
    order = await q.free(pool, 20)
    assert order == [x for i in range(10) for x in (f"b{i}", f"a{40 + i}")]  # not b's ten in a row


async def test_interactive_before_batch_and_the_reserve_never_taken_by_batch():
    pool = SlotPool("http://gpu/v1", 3, reserve=1)
    q = Queue(pool)
    await q.wait("batch0", Claim("evals", batch=True))
    await q.wait("batch1", Claim("evals", batch=True))
    await q.wait("batch2", Claim("evals", batch=True))  # 1 slot free, the reserve: it waits
    assert q.granted == ["batch0", "batch1"] and pool.busy == 2 and pool.queued() == 1
    await q.wait("chat0", Claim("acme"))  # the reserved slot is an interactive request's at once
    await q.wait("chat1", Claim("acme"))
    await q.wait("chat2", Claim("globex"))
    assert q.granted[2:] == ["chat0"] and pool.busy == 3 and pool.queued() == 3
    assert await q.free(pool) == ["chat1"]  # interactive first, though batch2 waited longer
    assert await q.free(pool) == ["chat2"]
    assert await q.free(pool) == []  # no interactive request waits, but the last free slot is the reserve
    assert (pool.busy, pool.queued()) == (2, 1)
    assert await q.free(pool) == ["batch2"]  # two free: batch takes one and leaves the reserve
    assert (pool.busy, pool.queued()) == (2, 0)


async def test_a_batch_request_takes_a_free_slot_only_beyond_the_reserve_and_a_raised_limit_serves_it():
    pool = SlotPool("http://gpu/v1", 2, reserve=1)
    q = Queue(pool)
    await q.wait("batch0", Claim("evals", batch=True))
    await q.wait("batch1", Claim("evals", batch=True))
    assert q.granted == ["batch0"] and pool.queued() == 1
    pool.set_limit(3, 1)  # a reload: one more slot, the reserve kept
    q.collect()
    assert q.granted == ["batch0", "batch1"] and (pool.busy, pool.queued()) == (2, 0)
    pool.set_limit(3, 0)  # no reserve: batch may take every slot
    await q.wait("batch2", Claim("evals", batch=True))
    assert q.granted[-1] == "batch2" and pool.busy == 3


async def test_no_cap_no_queue_whatever_the_priority():
    pool = SlotPool("http://gpu/v1", None, reserve=0)
    q = Queue(pool)
    for i in range(5):
        await q.wait(f"batch{i}", Claim("evals", batch=True))
    assert len(q.granted) == 5 and pool.queued() == 0


async def test_a_waiter_that_leaves_loses_its_place_and_nobody_loses_a_slot():
    pool = full(1)
    q = Queue(pool)
    await q.wait("a0", Claim("a"))
    await q.wait("b0", Claim("b"))
    await q.wait("b1", Claim("b"))
    await q.wait("c0", Claim("c"))
    q.tasks["b0"].cancel()
    await asyncio.gather(q.tasks["b0"], return_exceptions=True)
    del q.waiting["b0"]
    assert pool.queued() == 3
    assert await q.free(pool, 3) == ["a0", "b1", "c0"]
    assert pool.busy == 1 and pool.queued() == 0


async def test_the_entries_of_waiters_gone_do_not_pile_up_while_a_server_is_stuck():
    pool = full(1)
    q = Queue(pool)
    await q.wait("stays", Claim("a"))
    for i in range(1000):
        await q.wait(f"gone{i}", Claim(f"org{i % 7}"))
        q.tasks[f"gone{i}"].cancel()  # its client left (or its queue_timeout passed)
        await asyncio.gather(q.tasks[f"gone{i}"], return_exceptions=True)
        entries = sum(len(f.waiters) for f in pool.interactive.flows.values())
        assert entries <= 2 * len(pool.waiters) + 66
    assert await q.free(pool) == ["stays"]  # and the one still waiting kept its place


async def test_a_waiter_on_two_pools_is_served_once_in_each_pools_own_order():
    one, two = full(1), full(1)
    two.url = "http://gpu2/v1"
    q = Queue(one, two)
    await q.wait("a0", Claim("a"), [one])
    await q.wait("a1", Claim("a"), [one, two])
    await q.wait("b0", Claim("b"), [one, two])
    assert await q.free(two) == ["a1"]  # two's first: a's oldest waiting there
    assert await q.free(one) == ["a0"]
    assert await q.free(one) == ["b0"]  # a1 was served by the other pool: not twice
    assert (one.busy, two.busy, one.queued(), two.queued()) == (1, 1, 0, 0)
    await asyncio.gather(*q.tasks.values())
    assert [await q.tasks[n] for n in ("a0", "a1", "b0")] == [one, two, one]
    assert not one.waiters and not two.waiters  # a waiter served leaves the other pools it waited on


async def test_a_batch_request_past_its_deadline_is_busy():
    pool = SlotPool("http://gpu/v1", 2, reserve=1)
    pool.busy = 1
    with pytest.raises(UpstreamBusy):
        await take_slot([pool], None, claim=Claim("evals", batch=True))
    assert pool.busy == 1


# -- the config ---------------------------------------------------------------------------------------

def model(**fields):
    return {"id": "m", "upstreams": [{"url": "http://gpu1:8000/v1", "max_in_flight": 4}], **fields}


def test_priority_weight_and_batch_reserve_are_read_with_their_defaults():
    config = parse_config({
        "models": [model(), {"id": "n", "upstreams": [{"url": "http://gpu2:8000/v1", "max_in_flight": 1},
                                                       {"url": "http://gpu3:8000/v1", "max_in_flight": 6,
                                                        "batch_reserve": 2}, "http://gpu4:8000/v1"]}],
        "orgs": [{"id": "acme"}, {"id": "evals", "priority": "batch", "weight": 0.5}],
        "keys": [{"key": "sk-1", "org": "acme"}, {"key": "sk-2", "org": "acme", "priority": "batch", "weight": 3}]})
    m, n = config.models
    assert [m.batch_reserve_of(0)] == [1]  # max_in_flight >= 2: 1
    assert [n.batch_reserve_of(i) for i in range(3)] == [0, 2, 0]  # 1 slot: 0; given: 2; no cap: 0
    assert [(o.priority, o.weight) for o in config.orgs] == [("interactive", 1.0), ("batch", 0.5)]
    assert [(k.priority, k.weight) for k in config.keys] == [(None, None), ("batch", 3.0)]
    shared = parse_config({"models": [model(batch_reserve=3), model(id="m2")]})
    routes = routes_from(shared.models, shared.server)
    assert routes["m2"].upstreams[0].slots.reserve == 3  # the URL's: given by one model, it is every model's


async def test_a_reload_changing_batch_reserve_applies_to_the_requests_waiting():
    old = parse_config({"models": [model(batch_reserve=3)]})
    routes = routes_from(old.models, old.server)
    pool = routes["m"].upstreams[0].slots
    q = Queue(pool)
    await q.wait("batch0", Claim("evals", batch=True))
    await q.wait("batch1", Claim("evals", batch=True))  # 3 of 4 free: the reserve
    assert q.granted == ["batch0"] and pool.queued() == 1
    new = parse_config({"models": [model()]})  # batch_reserve back to its default, 1
    carry_over(routes, routes_from(new.models, new.server))
    q.collect()
    assert q.granted == ["batch0", "batch1"] and (pool.reserve, pool.busy, pool.queued()) == (1, 2, 0)


@pytest.mark.parametrize("raw, says", [
    ({"orgs": [{"id": "a", "priority": "urgent"}]}, "orgs[0].priority: must be one of interactive, batch"),
    ({"orgs": [{"id": "a", "weight": 0}]}, "orgs[0].weight: must be a number above 0"),
    ({"orgs": [{"id": "a", "weight": -1.5}]}, "orgs[0].weight: must be a number above 0"),
    ({"orgs": [{"id": "a", "weight": "2"}]}, "orgs[0].weight: must be"),
    ({"orgs": [{"id": "a"}], "keys": [{"key": "k", "org": "a", "priority": "low"}]}, "keys[0].priority: must be one of"),
    ({"orgs": [{"id": "a"}], "keys": [{"key": "k", "org": "a", "weight": 0}]}, "keys[0].weight: must be a number"),
    ({"models": [model(batch_reserve=-1)]}, "models[0] (m).batch_reserve: must be from 0 to max_in_flight - 1 (3)"),
    ({"models": [model(batch_reserve=4)]}, "models[0] (m).batch_reserve: must be from 0 to max_in_flight - 1 (3)"),
    ({"models": [{"id": "m", "upstreams": ["http://gpu1:8000/v1"], "batch_reserve": 1}]},
     "models[0] (m).batch_reserve: applies to upstreams with max_in_flight; this model has none"),
    ({"models": [{"id": "m", "upstreams": [{"url": "http://gpu1:8000/v1", "batch_reserve": 0}]}]},
     "models[0] (m).upstreams[0].batch_reserve: needs max_in_flight"),
    ({"models": [{"id": "m", "upstreams": [{"url": "http://gpu1:8000/v1", "max_in_flight": 1, "batch_reserve": 1}]}]},
     "upstreams[0].batch_reserve: must be from 0 to max_in_flight - 1 (0)"),
    ({"models": [model(batch_reserve=1.5)]}, "models[0] (m).batch_reserve: must be"),
    ({"models": [model(batch_reserve=2), model(id="m2", batch_reserve=1)]},
     "http://gpu1:8000/v1 has batch_reserve = 1 here but 2 in model 'm'"),
])
def test_bad_priority_weight_or_batch_reserve_is_one_line_naming_the_key(raw, says):
    with pytest.raises(Exception) as refused:
        parse_config(raw)
    assert says in str(refused.value) and "\n" not in str(refused.value)


# -- through a gateway --------------------------------------------------------------------------------

class Turnstile:
    """A model server that answers each completion only when the test lets it through; ``arrived``: the prompts,
    in the order they reached it."""

    def __init__(self):
        self.arrived: list[str] = []
        self.gates: list[asyncio.Future] = []
        self.running = None

    async def start(self) -> "Turnstile":
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self.running = await start_app(app, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        return f"{self.running.url}/v1"

    async def _completions(self, request):
        body = await request.json()
        gate = asyncio.get_running_loop().create_future()
        self.arrived.append(body["prompt"])
        self.gates.append(gate)
        await gate
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": body["model"],
                                  "choices": [{"index": 0, "text": " ok", "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

    def let_through(self, index: int) -> None:
        self.gates[index].set_result(None)


@pytest.fixture
async def turnstile():
    server = await Turnstile().start()
    yield server
    for gate in server.gates:
        if not gate.done():
            gate.set_result(None)
    await server.running.stop()


def on(server: Turnstile, slots: int, batch_reserve: int | None = None):
    def configure(config):
        upstream = {"url": server.url, "max_in_flight": slots}
        if batch_reserve is not None:
            upstream["batch_reserve"] = batch_reserve
        config["models"][0].update(upstreams=[upstream], queue_timeout=3600)
        config["orgs"].append({"id": "initech", "credits": 100.0, "priority": "batch"})
        config["keys"] += [{"key": BATCH_KEY, "org": "acme", "id": "acme-batch", "priority": "batch"},
                           {"key": INITECH_KEY, "org": "initech", "id": "initech-key"}]
        for org in config["orgs"]:
            org["max_in_flight"] = 500
    return configure


def pool(h):
    return h.gw.routes[MODEL].upstreams[0].slots


async def test_through_the_gateway_an_org_flooding_delays_another_by_one_turn_per_org_waiting(
        harness, turnstile, eventually):
    async with harness(configure=on(turnstile, 1)) as h:
        def send(prompt, key):
            return asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(key),
                                                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1}))
        sent = [send("hold", KEY)]
        await eventually(lambda: turnstile.arrived == ["hold"])
        for i in range(30):
            sent.append(send(f"acme-{i}", KEY))
            await eventually(lambda: pool(h).queued() == i + 1)  # each queued before the next is sent
        sent.append(send("globex", OTHER_KEY))
        await eventually(lambda: pool(h).queued() == 31)
        for turn in range(32):
            turnstile.let_through(turn)
            await eventually(lambda: len(turnstile.arrived) == min(turn + 2, 32))
        assert turnstile.arrived[:4] == ["hold", "acme-0", "globex", "acme-1"]  # one turn: acme's oldest
        assert [p for p in turnstile.arrived if p.startswith("acme-")] == [f"acme-{i}" for i in range(30)]
        for resp in await asyncio.gather(*sent):
            assert resp.status == 200
            resp.close()
        rows = await h.rows()
        assert len(rows) == 32 and {(r["status"], r["org"]) for r in rows} == {(200, "acme"), (200, "globex")}
        await eventually(lambda: (pool(h).busy, pool(h).queued()) == (0, 0))


async def test_through_the_gateway_batch_keys_and_orgs_wait_for_interactive_and_leave_the_reserve(
        harness, turnstile, eventually):
    async with harness(configure=on(turnstile, 2)) as h:  # two slots: batch_reserve 1 by default
        assert pool(h).reserve == 1
        gw = h.gw
        seam = replace(gw.keys.authenticate(f"Bearer {KEY}"), priority="batch")  # as the Batch API's runner runs a line
        assert gw.claim_of(seam).batch and not gw.claim_of(gw.keys.authenticate(f"Bearer {KEY}")).batch
        assert gw.claim_of(gw.keys.authenticate(f"Bearer {INITECH_KEY}")).batch  # its org's priority

        def send(prompt, key):
            return asyncio.create_task(h.session.post(f"{h.url}/v1/completions", headers=h.headers(key),
                                                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1}))
        sent = [send("batch-0", BATCH_KEY)]
        await eventually(lambda: turnstile.arrived == ["batch-0"])
        sent.append(send("batch-1", INITECH_KEY))  # one slot free: the reserve, so it waits
        await eventually(lambda: pool(h).queued() == 1)
        sent.append(send("chat-0", OTHER_KEY))  # the reserved slot: an interactive request's at once
        await eventually(lambda: turnstile.arrived == ["batch-0", "chat-0"])
        sent.append(send("chat-1", KEY))
        await eventually(lambda: pool(h).queued() == 2)
        turnstile.let_through(0)  # batch-0 ends: the interactive request gets its slot, not the older batch one
        await eventually(lambda: turnstile.arrived == ["batch-0", "chat-0", "chat-1"])
        turnstile.let_through(1)  # chat-0 ends: one slot free, the reserve: batch-1 still waits
        await eventually(lambda: pool(h).busy == 1)
        assert pool(h).queued() == 1 and len(turnstile.arrived) == 3
        turnstile.let_through(2)  # nothing in flight: batch-1 takes one slot of two
        await eventually(lambda: turnstile.arrived == ["batch-0", "chat-0", "chat-1", "batch-1"])
        turnstile.let_through(3)
        for resp in await asyncio.gather(*sent):
            assert resp.status == 200
            resp.close()
        await eventually(lambda: (pool(h).busy, pool(h).queued()) == (0, 0))
