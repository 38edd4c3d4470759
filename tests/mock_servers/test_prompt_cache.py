"""The mock upstream's prompt cache (issue 40): N slots holding their last prompt and answer, the longest prefix
reused, LRU eviction, requests waiting for a slot, a prefill time per uncached token, cached_tokens in answers
(the streamed usage chunk too) and vLLM's /metrics, all through real HTTP; and `kilnproxy mock-upstream`'s options."""

import asyncio
import sys
import time

import aiohttp
import pytest
from commands import start, stop

from kilnproxy.mock_servers.mock_generation import count_tokens
from kilnproxy.mock_servers.prompt_cache import PROMPT_CACHE, PromptCache, common_prefix, prompt_tokens_of
from kilnproxy.proxy.upstream.load_readers import LoadPoller, read_metrics, samples
from kilnproxy.testing import free_port
from kilnproxy.web.server import start_mock

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly."}  # 8 words
A1 = {"role": "user", "content": "Tell me about Paris and its river."}  # 7 words
ANSWER = {"role": "assistant", "content": "Paris is the capital of"}  # what max_tokens = 5 generates
A2 = {"role": "user", "content": "And its museums?"}
B1 = {"role": "user", "content": "What is the capital of France?"}  # 6 words
C1 = {"role": "user", "content": "Completely different."}


@pytest.mark.parametrize("body", [
    {"messages": [SYSTEM, A1, ANSWER, A2]}, {"messages": [{"role": "user", "content": [{"type": "text"}]}, "x"]},
    {"messages": []}, {"prompt": "one two  three\nfour"}, {"prompt": ["a b", "c"]}, {"prompt": [1, 2, 3]},
    {"prompt": [[1, 2], [3]]}, {"prompt": "x", "messages": [A1]}, {"prompt": ["x y"], "messages": [A1]}, {},
])
def test_a_prompts_tokens_are_as_many_as_the_mock_counts(body):
    assert len(prompt_tokens_of(body)) == count_tokens(body)


def test_common_prefix():
    assert [common_prefix("abcd", "abcf"), common_prefix("abc", "abc"), common_prefix("", "a"),
            common_prefix("xbc", "abc"), common_prefix(list("a" * 999 + "b"), list("a" * 1000))] == [3, 3, 0, 0, 999]
    with pytest.raises(ValueError):
        PromptCache(0)


async def chat(session, url, *messages, stream=False, **mock):
    body = {"model": "m", "messages": list(messages), "max_tokens": 5, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if mock:
        body["mock"] = mock
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        if not stream:
            answer = await resp.json()
            assert answer["choices"][0]["message"]["content"] == ANSWER["content"]
            return answer["usage"]
        frames = [f for f in (await resp.read()).split(b"\n\n") if f]
    assert frames[-1] == b"data: [DONE]"
    import json
    last = json.loads(frames[-2][len(b"data: "):])
    assert last["choices"] == []
    return last["usage"]


async def cache_state(session, url):
    async with session.get(f"{url}/mock/cache") as resp:
        return await resp.json()


async def test_turns_reuse_their_conversation_other_openings_share_what_they_share_and_lru_evicts():
    mock = await start_mock(prompt_cache_slots=2)
    try:
        async with aiohttp.ClientSession() as s:
            usage = await chat(s, mock.url, SYSTEM, A1)
            assert usage == {"prompt_tokens": 23, "total_tokens": 28, "completion_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
            # the next turn continues what slot 0 holds: the prompt and the answer as sent back (23 + 9)
            usage = await chat(s, mock.url, SYSTEM, A1, ANSWER, A2, stream=True)
            assert (usage["prompt_tokens"], usage["prompt_tokens_details"]) == (39, {"cached_tokens": 32})
            # another conversation with the same system message: its 12 tokens and "<|im_start|> user \n" reused,
            # in the empty slot
            usage = await chat(s, mock.url, SYSTEM, B1)
            assert (usage["prompt_tokens"], usage["prompt_tokens_details"]) == (22, {"cached_tokens": 15})
            assert [slot["tokens"] for slot in (await cache_state(s, mock.url))["slots"]] == [48, 31]
            # a third opening: no slot empty, the least recently used (conversation A's) evicted
            usage = await chat(s, mock.url, C1)
            assert usage["prompt_tokens_details"] == {"cached_tokens": 1}  # "<|im_start|>"
            state = await cache_state(s, mock.url)
            assert [slot["tokens"] for slot in state["slots"]] == [15, 31]
            # conversation A again: its turns are gone; B's system message is still there
            usage = await chat(s, mock.url, SYSTEM, A1, ANSWER, A2, ANSWER, {"role": "user", "content": "Thanks."})
            assert (usage["prompt_tokens"], usage["prompt_tokens_details"]) == (53, {"cached_tokens": 15})
            # a body's mock.cached_tokens still wins
            usage = await chat(s, mock.url, C1, cached_tokens=3)
            assert usage["prompt_tokens_details"] == {"cached_tokens": 3}
            state = await cache_state(s, mock.url)
            assert {k: state[k] for k in ("running", "waiting", "requests", "prompt_tokens", "queries", "hits")} == {
                "running": 0, "waiting": 0, "requests": 6, "prompt_tokens": 23 + 39 + 22 + 6 + 53 + 6,
                "queries": 149, "hits": 0 + 32 + 15 + 1 + 15 + 5}
            async with s.get(f"{mock.url}/metrics") as resp:
                assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
                text = await resp.text()
            assert samples(text, frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting",
                                            "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
                                            "vllm:prefix_cache_hits_total"})) == {
                "vllm:num_requests_running": [((("engine", "0"), ("model_name", "mock")), 0.0)],
                "vllm:num_requests_waiting": [((("engine", "0"), ("model_name", "mock")), 0.0)],
                "vllm:prompt_tokens_total": [((("engine", "0"), ("model_name", "mock")), 149.0)],
                "vllm:prefix_cache_queries_total": [((("engine", "0"), ("model_name", "mock")), 149.0)],
                "vllm:prefix_cache_hits_total": [((("engine", "0"), ("model_name", "mock")), 68.0)],
            }
    finally:
        await mock.stop()


async def test_requests_wait_for_a_slot_and_metrics_say_so(eventually):
    mock = await start_mock(prompt_cache_slots=1, served_models=("served/name",))
    cache = mock.app[PROMPT_CACHE]
    try:
        async with aiohttp.ClientSession() as s:
            holder = await s.post(f"{mock.url}/v1/chat/completions", json={
                "model": "served/name", "messages": [A1], "max_tokens": 2, "stream": True,
                "mock": {"silence": 3600}})
            assert holder.status == 200
            waiting = asyncio.create_task(s.post(f"{mock.url}/v1/chat/completions", json={
                "model": "served/name", "messages": [B1], "max_tokens": 2}))
            await eventually(lambda: cache.waiting == 1)

            async def metrics():
                async with s.get(f"{mock.url}/metrics") as resp:
                    return await resp.text()
            text = await metrics()
            assert read_metrics(text) == ("vllm", 2)
            assert 'vllm:num_requests_running{engine="0",model_name="served/name"} 1.0' in text.splitlines()
            assert 'vllm:num_requests_waiting{engine="0",model_name="served/name"} 1.0' in text.splitlines()
            holder.close()  # its client leaves: the slot goes to the request waiting
            async with await waiting as resp:
                assert resp.status == 200
                assert (await resp.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
            assert read_metrics(await metrics()) == ("vllm", 0)
    finally:
        await mock.stop()


async def test_each_uncached_token_costs_the_prefill_time():
    mock = await start_mock(prompt_cache_slots=1, prefill_per_token=0.05)
    try:
        async with aiohttp.ClientSession() as s:
            started = time.monotonic()
            await chat(s, mock.url, SYSTEM, A1)  # 23 tokens computed
            first = time.monotonic() - started
            started = time.monotonic()
            usage = await chat(s, mock.url, SYSTEM, A1, ANSWER, A2)  # 39 - 32 = 7
            second = time.monotonic() - started
            assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
            assert first >= 23 * 0.05 and second >= 7 * 0.05 and second < first
    finally:
        await mock.stop()


async def test_without_a_cache_nothing_changes_and_metrics_count_the_requests_answered(eventually):
    mock = await start_mock()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{mock.url}/v1/chat/completions", json={
                    "model": "m", "messages": [A1], "max_tokens": 2}) as resp:
                assert (await resp.json())["usage"] == {"prompt_tokens": 11, "total_tokens": 13,
                                                        "completion_tokens": 2}
            assert await cache_state(s, mock.url) is None
            holder = await s.post(f"{mock.url}/v1/completions", json={
                "model": "m", "prompt": "hi", "max_tokens": 2, "stream": True, "mock": {"silence": 3600}})
            async with s.get(f"{mock.url}/metrics") as resp:
                assert read_metrics(await resp.text()) == ("vllm", 1)
            holder.close()
    finally:
        await mock.stop()


async def test_the_mock_upstream_command_takes_the_cache_options(tmp_path):
    port = free_port()
    proc, _ = await start(["mock-upstream", "--port", str(port), "--prompt-cache-slots", "2",
                           "--prefill-seconds-per-token", "0.001"], tmp_path, b"mock upstream")
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            assert (await chat(s, url, SYSTEM, A1))["prompt_tokens_details"] == {"cached_tokens": 0}
            assert (await chat(s, url, SYSTEM, A1, ANSWER, A2))["prompt_tokens_details"] == {"cached_tokens": 32}
            assert len((await cache_state(s, url))["slots"]) == 2
    finally:
        await stop(proc)
    for args, message in ((["--prefill-seconds-per-token", "1"], "only applies with --prompt-cache-slots N"),
                          (["--prompt-cache-slots", "-1"], "must be 0 or more")):
        run = await asyncio.create_subprocess_exec(sys.executable, "-m", "kilnproxy", "mock-upstream", *args,
                                                   stderr=asyncio.subprocess.PIPE)
        _, err = await run.communicate()
        assert run.returncode == 2 and message in err.decode()


async def test_the_load_poller_reads_the_mocks_requests_from_elsewhere(eventually):
    """Requests sent straight to the mock (not through this poller's gateway) are its load: running and waiting."""
    mock = await start_mock(prompt_cache_slots=2)
    poller = LoadPoller(0.05, read_timeout=1)
    try:
        poller.watch([f"{mock.url}/v1"])
        await eventually(lambda: poller.load(f"{mock.url}/v1") == 0)
        async with aiohttp.ClientSession() as s:
            held = [await s.post(f"{mock.url}/v1/completions", json={
                "model": "m", "prompt": f"hold {i}", "max_tokens": 2, "stream": True, "mock": {"silence": 3600}})
                for i in range(2)]
            third = asyncio.create_task(s.post(f"{mock.url}/v1/completions", json={
                "model": "m", "prompt": "third", "max_tokens": 2}))
            await eventually(lambda: poller.load(f"{mock.url}/v1") == 3)  # 2 running + 1 waiting
            assert poller.origins()[mock.url].kind == "vllm"
            for resp in held:
                resp.close()
            async with await third as resp:
                assert resp.status == 200
        await eventually(lambda: poller.load(f"{mock.url}/v1") == 0)
    finally:
        await poller.close()
        await mock.stop()
