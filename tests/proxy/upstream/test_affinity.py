"""`cache_aware` routing's rules (SPEC 13, issue 40's "Done when"): the affinity key of each API, the order of the
upstreams per key (rendezvous hashing: the same in every process), the bounded load, failover along the order."""

import math
import os
import subprocess
import sys
from collections import Counter

import pytest

from kilnproxy.proxy.upstream.affinity import Rendezvous, affinity_key, bound, choose, effective_load

URLS = ["http://gpu1:8080/v1", "http://gpu2:8080/v1", "http://gpu3:8080/v1"]
SIXTEEN = [f"http://10.0.0.{i}:8000/v1" for i in range(16)]
SYSTEM = {"role": "system", "content": "You are terse."}
HI = {"role": "user", "content": "Hi"}


def chat(*messages, **extra):
    return affinity_key("chat/completions", {"model": "m", "messages": list(messages), **extra})


def conv(i: int) -> int:
    return affinity_key("chat/completions", {"prompt_cache_key": f"conv-{i}"})


# Pinned: every replica, and every version that runs beside another in a rolling upgrade, must agree.
FIXED = [
    (("chat/completions", {"prompt_cache_key": "conv-1"}), 2075038734, (1, 0, 2)),
    (("chat/completions", {"prompt_cache_key": "conv-2"}), 3802645940, (1, 0, 2)),
    (("chat/completions", {"messages": [SYSTEM, HI]}), 1687023206, (1, 0, 2)),
    (("completions", {"prompt": "Once upon a time"}), 3847282996, (1, 0, 2)),
    (("messages", {"system": "Be kind.", "messages": [{"role": "user", "content": "Hello"}]}), 4291096285, (2, 1, 0)),
    (("responses", {"instructions": "Be brief.", "input": "What is 2+2?"}), 581969877, (2, 0, 1)),
]


def test_exact_keys_and_orders_for_fixed_requests():
    r = Rendezvous(URLS)
    assert [(affinity_key(*request), r.order(affinity_key(*request))) for request, _, _ in FIXED] == [
        (key, order) for _, key, order in FIXED]
    assert Rendezvous(SIXTEEN).order(FIXED[0][1]) == (8, 11, 5, 4, 9, 6, 7, 15, 14, 1, 12, 0, 3, 13, 2, 10)


def test_the_same_orders_in_another_process():
    code = (
        "import json, sys\n"
        "from kilnproxy.proxy.upstream.affinity import Rendezvous, affinity_key\n"
        "requests = json.loads(sys.argv[1])\n"
        "r = Rendezvous(json.loads(sys.argv[2]))\n"
        "print(json.dumps([[affinity_key(e, b), list(r.order(affinity_key(e, b)))] for e, b in requests]))\n")
    import json
    requests = [list(request) for request, _, _ in FIXED] + [
        ["chat/completions", {"prompt_cache_key": f"conv-{i}"}] for i in range(200)]
    for seed in ("1", "2"):  # Python's own hash() differs with the seed; the orders must not
        out = subprocess.run([sys.executable, "-c", code, json.dumps(requests), json.dumps(SIXTEEN)],
                             env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True)
        r = Rendezvous(SIXTEEN)
        assert json.loads(out.stdout) == [[affinity_key(e, b), list(r.order(affinity_key(e, b)))] for e, b in requests]


def test_prompt_cache_key_wins_when_it_is_a_string():
    first, later = [SYSTEM, HI], [SYSTEM, {"role": "user", "content": "Something else"}]
    assert chat(*first, prompt_cache_key="c1") == chat(*later, prompt_cache_key="c1")
    assert chat(*first, prompt_cache_key="c1") != chat(*first, prompt_cache_key="c2")
    assert chat(*first, prompt_cache_key=17) == chat(*first) == chat(*first, prompt_cache_key=None)
    assert affinity_key("completions", {"prompt": "x", "prompt_cache_key": "c1"}) == chat(HI, prompt_cache_key="c1")


def test_chat_opening_is_the_messages_up_to_the_first_user_message():
    turn1 = [SYSTEM, HI]
    turn3 = [SYSTEM, HI, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}]
    assert chat(*turn1) == chat(*turn3)  # the turns of one conversation
    assert chat(*turn1) != chat(SYSTEM, {"role": "user", "content": "Ho"})  # another opening
    assert chat(*turn1) != chat(HI)  # the system message is part of it
    assert chat(*turn1) != chat(SYSTEM, {"role": "developer", "content": "x"}, HI)
    assert chat({"content": "You are terse.", "role": "system"}, {"content": "Hi", "role": "user"}) == chat(*turn1)
    assert chat(SYSTEM) == chat(SYSTEM)  # no user message: all of them
    assert chat(SYSTEM) != chat(*turn1)
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url",
                                                                       "image_url": {"url": "data:x"}}]}
    assert chat(parts, {"role": "assistant", "content": "a"}) == chat(parts)
    assert chat(parts) != chat(HI)


def test_messages_responses_and_completions_openings():
    def messages(system, *msgs):
        body = {"messages": list(msgs)}
        if system is not None:
            body["system"] = system
        return affinity_key("messages", body)
    hello, again = {"role": "user", "content": "Hello"}, {"role": "user", "content": "again"}
    assert messages("Be kind.", hello) == messages("Be kind.", hello, {"role": "assistant", "content": "Hi"}, again)
    assert messages("Be kind.", hello) != messages("Be rude.", hello) != messages(None, hello)
    assert messages([{"type": "text", "text": "Be kind."}], hello) != messages("Be kind.", hello)

    def responses(instructions, given):
        body = {"input": given} if instructions is None else {"instructions": instructions, "input": given}
        return affinity_key("responses", body)
    item = {"role": "user", "content": "What is 2+2?"}
    assert responses("Be brief.", [item]) == responses("Be brief.", [item, {"role": "assistant", "content": "4"}])
    assert responses("Be brief.", [item]) != responses("Be long.", [item]) != responses(None, [item])
    assert responses("Be brief.", "What is 2+2?") != responses("Be brief.", "What is 3+3?")

    def completion(prompt):
        return affinity_key("completions", {"prompt": prompt})
    long = "x" * 2000
    assert completion(long + "a") == completion(long + "b")  # the first 2,000 characters
    assert completion("a" + long) != completion("b" + long)
    assert completion(["Once", "Twice"]) == completion("Once") != completion(["Twice", "Once"])
    assert completion(list(range(2000)) + [1]) == completion(list(range(2000)) + [2])  # token ids: the first 2,000
    assert completion([[1, 2, 3], [4]]) == completion([1, 2, 3])
    assert completion([1, 2, 3]) != completion([1, 2, 4])


@pytest.mark.parametrize("endpoint, body", [
    ("embeddings", {"input": "hello"}), ("messages/count_tokens", {"messages": [HI]}), ("completions", {}),
    ("completions", {"prompt": ""}), ("completions", {"prompt": []}), ("completions", {"prompt": 5}),
    ("chat/completions", {}), ("chat/completions", {"messages": []}), ("chat/completions", {"messages": "hi"}),
    ("messages", {"system": "x"}), ("messages", {"messages": {}}), ("responses", {"input": []}),
    ("responses", {"instructions": "x"}), ("responses", {"input": 5}),
])
def test_no_key_routes_least_busy(endpoint, body):
    assert affinity_key(endpoint, body) is None


def test_bodies_orjson_cannot_write_still_have_a_stable_key():
    big = {"role": "user", "content": "x", "seed": 2 ** 70}
    lone = {"role": "user", "content": "half an emoji \ud83d"}
    assert chat(big) == chat(dict(big)) != chat({**big, "seed": 2 ** 71})
    assert chat(lone) == chat(dict(lone)) != chat(HI)


def test_a_thousand_keys_spread_over_sixteen_upstreams():
    r = Rendezvous(SIXTEEN)
    firsts = Counter(r.order(conv(i))[0] for i in range(1000))
    assert sorted(firsts) == list(range(16))
    assert 32 <= min(firsts.values()) and max(firsts.values()) <= 93  # 62.5 each, ±4 standard deviations
    # placed one after another and all kept in flight: the bound holds every upstream near the mean
    loads, up = [0] * 16, [True] * 16
    for i in range(1000):
        choice = choose(r.order(conv(i)), up, loads, 0.25)[0]
        assert loads[choice] < bound(loads, 0.25)
        loads[choice] += 1
    assert max(loads) <= math.ceil(1.25 * 1000 / 16) + 1 and sum(loads) == 1000


def test_a_hot_opening_spills_by_the_bound_along_its_order():
    r = Rendezvous(URLS + ["http://gpu4:8080/v1"])
    order = r.order(conv(1))
    loads, up, placed = [0, 0, 0, 0], [True] * 4, []
    for _ in range(12):
        choice = choose(order, up, loads, 0.25)[0]
        placed.append(order.index(choice))
        loads[choice] += 1
    # bound ⌈1.25 × (L + 1) / 4⌉ + 1 (2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5 as L grows): its first takes what
    # the bound allows, then the next in its order; the last is never needed
    assert placed == [0, 0, 1, 0, 1, 1, 0, 1, 2, 0, 1, 2]
    assert [loads[i] for i in order] == [5, 5, 2, 0]
    assert bound([0, 0, 0, 0], 0.25) == 2 and bound([2, 0, 0, 0], 0.25) == 2
    assert bound([10, 10], 0.0) == 12 and bound([10, 10], 1.0) == 22  # ⌈21 / 2⌉ + 1, ⌈2 × 21 / 2⌉ + 1
    assert bound([7], 0.25) == 11  # a lone upstream is always below its own bound


def test_failover_goes_along_the_same_order():
    order = Rendezvous(URLS).order(conv(1))  # (1, 0, 2)
    assert choose(order, [True] * 3, [0, 0, 0], 0.25) == [1, 0, 2]
    assert choose(order, [True, False, True], [0, 0, 0], 0.25) == [0, 2]
    assert choose(order, [True] * 3, [0, 5, 0], 0.25) == [0, 2, 1]  # over the bound: tried last
    assert choose(order, [False] * 3, [0, 0, 0], 0.25) == []


def test_an_upstream_marked_down_moves_only_its_keys_and_they_return():
    r = Rendezvous(SIXTEEN[:8])
    loads = [0] * 8
    keys = [conv(i) for i in range(1000)]
    before = [choose(r.order(k), [True] * 8, loads, 0.25)[0] for k in keys]
    up = [True] * 8
    up[3] = False
    during = [choose(r.order(k), up, loads, 0.25)[0] for k in keys]
    moved = [i for i in range(1000) if before[i] != during[i]]
    assert moved == [i for i in range(1000) if before[i] == 3] and len(moved) > 80
    assert all(during[i] == r.order(keys[i])[1] for i in moved)  # to the next in their own order
    assert Counter(during[i] for i in moved).keys() != {during[moved[0]]}  # spread, not all to one
    after = [choose(r.order(k), [True] * 8, loads, 0.25)[0] for k in keys]
    assert after == before


def test_orders_depend_on_the_urls_not_their_positions():
    r, turned = Rendezvous(URLS), Rendezvous(URLS[::-1])
    for i in range(50):
        assert [URLS[j] for j in r.order(conv(i))] == [URLS[::-1][j] for j in turned.order(conv(i))]
    # an upstream added takes keys only for itself: every other key keeps its first
    four = Rendezvous(URLS + ["http://gpu4:8080/v1"])
    for i in range(300):
        first = URLS[r.order(conv(i))[0]]
        assert four.urls[four.order(conv(i))[0]] in (first, "http://gpu4:8080/v1")


def test_the_cache_of_orders_is_bounded():
    r = Rendezvous(URLS, cached=10)
    orders = [r.order(conv(i)) for i in range(25)]
    assert len(r._orders) == 5 and [r.order(conv(i)) for i in range(25)] == orders


def test_effective_load_is_the_larger_count():
    assert [effective_load(2, None), effective_load(2, 0), effective_load(2, 7), effective_load(0, 0)] == [2, 2, 7, 0]
