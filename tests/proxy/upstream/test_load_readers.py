"""The servers' own load (SPEC 13's `load_poll`): /metrics of llama.cpp, vLLM and SGLang and llama.cpp's /slots
parsed from real texts (tests/data/load/README.md), and the poller against real servers on loopback: one that
answers each format, one that hangs, one that answers garbage, one that stops answering (a read older than
3 × the interval is not used), one whose body is too long. Reading never blocks `load()`."""

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp import web

from kilnproxy.proxy.upstream.load_readers import (
    MAX_BODY,
    LoadPoller,
    load_of_metrics,
    load_of_slots,
    origin_of,
    read_metrics,
    samples,
)
from kilnproxy.web.server import start_app

DATA = Path(__file__).resolve().parents[2] / "data" / "load"


def fixture(name: str) -> str:
    return (DATA / name).read_text()


def test_each_servers_metrics_and_slots_as_they_answer():
    assert read_metrics(fixture("llamacpp_busy_metrics.txt")) == ("llamacpp", 3)  # 2 processing + 1 deferred
    assert read_metrics(fixture("llamacpp_idle_metrics.txt")) == ("llamacpp", 0)
    assert read_metrics(fixture("vllm_v1_dp2_metrics.txt")) == ("vllm", 6)  # engines 0 and 1: 3 + 2 running, 1 waiting
    assert read_metrics(fixture("vllm_v0_metrics.txt")) == ("vllm", 0)
    assert read_metrics(fixture("sglang_metrics.txt")) == ("sglang", 7)  # not the offline batch's 9
    assert read_metrics(fixture("sglang_priority_metrics.txt")) == ("sglang", 17)  # the priority="" aggregates
    assert load_of_slots((DATA / "llamacpp_busy_slots.json").read_bytes()) == 2
    assert load_of_slots((DATA / "llamacpp_one_busy_slots.json").read_bytes()) == 1
    assert load_of_slots((DATA / "llamacpp_idle_slots.json").read_bytes()) == 0


def test_the_text_format_read_robustly():
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        "\n"
        'vllm:num_requests_running{engine="0",model_name="a \\"quoted\\" {name}, with \\\\ and \\n"} 2.0 1700000000000\n'
        '  vllm:num_requests_running{ engine="1" , model_name="x=y#z",} 1e1 # {trace_id="abc"} 1.0 1700000000.5\n'
        "vllm:num_requests_running_total 99\n"
        "vllm:num_requests_waiting 3\n"
        "vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 50\n"
    )
    found = samples(text)
    assert found == {
        "vllm:num_requests_running": [((("engine", "0"), ("model_name", 'a "quoted" {name}, with \\ and \n')), 2.0),
                                      ((("engine", "1"), ("model_name", "x=y#z")), 10.0)],
        "vllm:num_requests_waiting": [((), 3.0)],
    }
    assert load_of_metrics(text) == 15
    assert load_of_metrics("llamacpp:requests_processing 2\n") == 2  # no deferred family: 0 of them
    assert load_of_metrics("vllm:num_requests_running 2.6\nvllm:num_requests_waiting 0.0\n") == 3


@pytest.mark.parametrize("text", [
    "", "garbage", "\x00\x01\x02 binary", "<html>502 Bad Gateway</html>", "process_open_fds 3\n",
    "vllm:num_requests_waiting 3\n",  # waiting without running: not a vLLM that says its load
    "vllm:num_requests_running NaN\n", "vllm:num_requests_running +Inf\n", "vllm:num_requests_running -Inf\n",
    "vllm:num_requests_running -1\n", "vllm:num_requests_running 1e9\n", "vllm:num_requests_running 1_000\n",
    "vllm:num_requests_running{engine=\"0\" 3\n", "vllm:num_requests_running{engine=0} 3\n",
    "vllm:num_requests_running{engine=\"0} 3\n", "vllm:num_requests_running\n", "vllm:num_requests_running 1 2 3\n",
    "vllm:num_requests_running three\n", "vllm:num_requests_running3 3\nvllm:num_requests_runningx 1\n",
    "vllm:num_requests_running 1\nvllm:num_requests_waiting NaN\n",
])
def test_what_says_nothing_usable_is_none(text):
    assert load_of_metrics(text) is None


@pytest.mark.parametrize("body", [b"", b"garbage", b"{}", b"[1, 2]", b'{"slots": []}', b"\xff\xfe", b"null"])
def test_slots_that_are_not_a_list_of_slots_are_none(body):
    assert load_of_slots(body) is None


def test_origin_of():
    assert origin_of("http://h:8000/v1") == "http://h:8000"
    assert origin_of("https://user:pw@gpu.example:443/openai/v1?x=1") == "https://user:pw@gpu.example:443"
    assert origin_of("http://h") == "http://h"
    with pytest.raises(ValueError):
        origin_of("h:8000/v1")


class Server:
    """A model server's load endpoints on loopback: ``answers[path]`` is (status, body), or "hang"; every
    GET's path is kept in ``seen`` and wakes ``changed``."""

    def __init__(self, **answers):
        self.answers = answers
        self.seen: list[str] = []
        self.headers: list[str | None] = []
        self.hanging = 0
        self.running = None

    async def __aenter__(self):
        app = web.Application()
        app.router.add_get("/{path:.*}", self.handle)
        self.running = await start_app(app, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc):
        await self.running.stop()

    @property
    def url(self) -> str:
        return f"{self.running.url}/v1"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.path)
        self.headers.append(request.headers.get("Authorization"))
        answer = self.answers.get(request.path, (404, b"Not Found"))
        if answer == "hang":
            self.hanging += 1
            await asyncio.sleep(3600)
        status, body = answer
        return web.Response(status=status, body=body)


async def poller(interval=0.05, read_timeout=0.2) -> LoadPoller:
    return LoadPoller(interval, read_timeout=read_timeout)


@pytest.mark.parametrize("answers, load, kind, paths", [
    ({"/metrics": (200, (DATA / "vllm_v1_dp2_metrics.txt").read_bytes())}, 6, "vllm", ["/metrics"]),
    ({"/metrics": (200, (DATA / "sglang_metrics.txt").read_bytes())}, 7, "sglang", ["/metrics"]),
    ({"/metrics": (200, (DATA / "llamacpp_busy_metrics.txt").read_bytes()),
      "/slots": (200, (DATA / "llamacpp_busy_slots.json").read_bytes())}, 3, "llamacpp", ["/metrics"]),
    # llama.cpp without --metrics: /metrics answers 501, /slots is read from then on
    ({"/metrics": (501, b'{"error":{"code":501,"message":"This server does not support metrics endpoint."}}'),
      "/slots": (200, (DATA / "llamacpp_one_busy_slots.json").read_bytes())}, 1, "llamacpp", ["/metrics", "/slots"]),
])
async def test_each_kind_read_at_the_origin_and_what_answered_remembered(eventually, answers, load, kind, paths):
    async with Server(**answers) as server:
        p = await poller()
        try:
            assert p.load(server.url) is None  # nothing read yet
            p.watch([server.url, server.url + "/other"])
            state = p.origins()[server.running.url]
            await eventually(lambda: state.reads >= 3)
            assert p.load(server.url) == load and p.load(server.url + "/other") == load
            assert state.kind == kind and state.path == paths[-1]
            assert server.seen[:len(paths) + 2] == paths + [paths[-1]] * 2  # one origin, one task: no other GET
            assert len(p.origins()) == 1
        finally:
            await p.close()


async def test_a_server_that_answers_garbage_or_nothing_costs_nothing(eventually):
    async with Server(**{"/metrics": (200, b"<html>hello</html>"), "/slots": (200, b"not json")}) as garbage, \
            Server() as missing:
        p = await poller()
        try:
            p.watch([garbage.url, missing.url])
            states = [p.origins()[s.running.url] for s in (garbage, missing)]
            await eventually(lambda: all(s.failures >= 3 for s in states))
            assert [p.load(garbage.url), p.load(missing.url)] == [None, None]
            assert [s.path for s in states] == [None, None]
            # tried less and less often: the waits double (0.05, 0.1, 0.2 s ...), not a GET every interval
            assert garbage.seen[:6] == ["/metrics", "/slots"] * 3
        finally:
            await p.close()


async def test_a_server_that_hangs_never_holds_load_up(eventually):
    async with Server(**{"/metrics": "hang", "/slots": "hang"}) as server:
        p = await poller(read_timeout=0.1)
        try:
            p.watch([server.url])
            state = p.origins()[server.running.url]
            await eventually(lambda: state.failures >= 2)
            assert server.hanging >= 4  # each read given up on after read_timeout
            started = time.perf_counter()
            for _ in range(1000):
                assert p.load(server.url) is None
            assert time.perf_counter() - started < 0.05  # a dict lookup, whatever the reads do
        finally:
            await p.close()


async def test_a_read_older_than_three_intervals_is_not_used_and_a_fresh_one_is(eventually):
    text = b"vllm:num_requests_running 4\nvllm:num_requests_waiting 1\n"
    async with Server(**{"/metrics": (200, text)}) as server:
        p = await poller(interval=0.1, read_timeout=0.1)
        try:
            p.watch([server.url])
            state = p.origins()[server.running.url]
            await eventually(lambda: p.load(server.url) == 5)
            server.answers["/metrics"] = "hang"  # it stops answering
            hung_after = state.reads
            await eventually(lambda: server.hanging >= 1)
            last_read = state.at
            await eventually(lambda: p.load(server.url) is None)
            assert time.monotonic() - last_read > 3 * 0.1  # not before
            assert state.reads == hung_after
            server.answers["/metrics"] = (200, b"vllm:num_requests_running 2\n")  # back
            await eventually(lambda: p.load(server.url) == 2, timeout=40)
        finally:
            await p.close()


async def test_a_body_too_long_says_nothing():
    line = b"vllm:num_requests_running 1\n"
    async with Server(**{"/metrics": (200, line * (MAX_BODY // len(line) + 1)), "/slots": (404, b"")}) as server:
        p = await poller()
        try:
            state_url = server.running.url
            p.watch([server.url])
            state = p.origins()[state_url]
            assert await p.read_once(state) is None
            server.answers["/metrics"] = (200, line * (MAX_BODY // len(line) - 1))
            assert await p.read_once(state) == MAX_BODY // len(line) - 1
        finally:
            await p.close()


async def test_watch_follows_the_upstreams_and_close_stops_everything(eventually):
    text = (200, b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 1\n")
    async with Server(**{"/metrics": text}) as a, Server(**{"/metrics": text}) as b:
        p = await poller()
        p.watch([a.url])
        first = p.origins()[a.running.url]
        await eventually(lambda: p.load(a.url) == 2)
        p.watch([a.url, b.url])
        assert p.origins()[a.running.url] is first  # the same task reads on
        await eventually(lambda: p.load(b.url) == 2)
        p.watch([b.url])
        assert list(p.origins()) == [b.running.url] and p.load(a.url) is None
        await eventually(lambda: first.task.done())
        seen = len(a.seen)
        await p.close()
        assert all(s.task.done() for s in [first]) and p.load(b.url) is None
        with pytest.raises(RuntimeError):
            p.watch([a.url])
        assert len(a.seen) == seen


@pytest.mark.parametrize("lie", [b"vllm:num_requests_running -3\n", b"vllm:num_requests_running NaN\n",
                                 b"sglang:num_running_reqs 1e12\n", b"llamacpp:requests_processing +Inf\n"])
async def test_a_server_that_lies_is_not_believed(eventually, lie):
    async with Server(**{"/metrics": (200, lie)}) as liar, \
            Server(**{"/metrics": (200, lie), "/slots": (200, (DATA / "llamacpp_busy_slots.json").read_bytes())}) as slots:
        p = await poller()
        try:
            p.watch([liar.url, slots.url])
            states = [p.origins()[s.running.url] for s in (liar, slots)]
            await eventually(lambda: states[0].failures >= 2 and states[1].reads >= 2)
            assert p.load(liar.url) is None
            assert p.load(slots.url) == 2 and states[1].path == "/slots"  # what it says at /slots is read instead
        finally:
            await p.close()


async def test_reads_carry_the_headers_given_for_the_upstream(eventually):
    async with Server(**{"/metrics": (200, b"vllm:num_requests_running 1\n")}) as server:
        p = await poller()
        try:
            p.watch([server.url], headers={server.url: {"Authorization": "Bearer sk-upstream"}})
            await eventually(lambda: p.load(server.url) == 1)
            assert set(server.headers) == {"Bearer sk-upstream"}
        finally:
            await p.close()
