"""Cache-aware routing against three real llama.cpp servers (SPEC 13, issue 40).

Two gateway replicas (one config, a SQLite file each) with ``routing = "cache_aware"`` in front of three
llama.cpp servers, each turn of a conversation sent through the other replica: its later turns (the whole
conversation resent) land on the server of its first turn, and that server's own
``prompt_tokens_details.cached_tokens``, as the usage rows record them, show its prompt cache serving them.

Which server answered is read from the servers themselves (the one whose ``llamacpp:tokens_predicted_total``
grew: the turns are sent one at a time) and, when the rows have it, from the row's ``upstream``, which must
agree. ``KILN_E2E_ROUTING=least_busy`` runs the same test on another policy: it must fail (the later turns
move to other servers, which compute the whole prompt again).
"""

from __future__ import annotations

import os
import random

import pytest

from kilnproxy.testing import usage_rows

from .stack import LLAMA_ALIAS, GatewayProcess, LlamaServer
from .support import GENERATION_HEADER, KEY, MODEL, gateway_toml, llama_metric, model_toml, row

ROUTING = os.environ.get("KILN_E2E_ROUTING", "cache_aware")
SERVERS = 3
CONVERSATIONS = 4  # not a multiple of SERVERS: a rotation in turn would bring a conversation back by accident
TURNS = 3
ANSWER = 8  # tokens an answer has (ignore_eos): the counter that tells which server answered grows by this
WORDS = ("river garden window bread stone paper music market letter field island horse winter summer forest "
         "engine doctor village ocean bridge mountain kitchen table").split()


class Replica:
    """One gateway process and its SQLite file (what ``support.row`` reads)."""

    def __init__(self, gateway: GatewayProcess, db):
        self.gateway, self.db, self.url = gateway, db, gateway.url


class Fleet:
    def __init__(self, servers: list[LlamaServer], replicas: list[Replica]):
        self.servers, self.replicas = servers, replicas


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("routing")
    servers: list[LlamaServer] = []
    replicas: list[Replica] = []
    try:
        for i in range(SERVERS):
            servers.append(LlamaServer(workdir, name=f"llama-server-{i}"))
        upstreams = ", ".join(f'"{s.url}/v1"' for s in servers)
        for r in range(2):  # two replicas of one config, a database each: no state shared but the config
            db = workdir / f"usage-{r}.db"
            config = workdir / f"kilnproxy-{r}.toml"
            config.write_text(gateway_toml("", db, models=model_toml(
                MODEL, upstreams, LLAMA_ALIAS, ["chat/completions"], extra=f'routing = "{ROUTING}"')))
            replicas.append(Replica(GatewayProcess(workdir, ["--config", str(config)], name=f"kilnproxy-{r}"), db))
        yield Fleet(servers, replicas)
    finally:
        for replica in replicas:
            replica.gateway.stop()
        for server in servers:
            server.stop()


async def predicted(http, fleet: Fleet) -> list[float]:
    return [await llama_metric(http, s, "tokens_predicted_total") for s in fleet.servers]


async def test_a_conversations_later_turns_land_on_its_first_server_and_hit_its_cache(fleet, http):
    rng = random.Random(40)
    conversations = [[{"role": "system", "content": "You answer in one short sentence."},
                      {"role": "user", "content": f"Notes {c}: " + " ".join(rng.choice(WORDS) for _ in range(80))
                       + ". What are these notes about?"}] for c in range(CONVERSATIONS)]
    served: dict[int, list[int]] = {c: [] for c in range(CONVERSATIONS)}
    cached: dict[int, list[int]] = {c: [] for c in range(CONVERSATIONS)}
    prompts: dict[int, list[int]] = {c: [] for c in range(CONVERSATIONS)}
    for turn in range(TURNS):
        order = list(range(CONVERSATIONS))
        rng.shuffle(order)
        for c in order:  # one at a time: the server that answered is the one whose counter grew
            messages = conversations[c]
            replica = fleet.replicas[(c + turn) % 2]  # each turn through the other replica
            before = await predicted(http, fleet)
            body = {"model": MODEL, "messages": messages, "max_tokens": ANSWER, "ignore_eos": True, "temperature": 0}
            async with http.post(f"{replica.url}/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
                generation_id = resp.headers[GENERATION_HEADER]
            after = await predicted(http, fleet)
            grew = [i for i, (a, b) in enumerate(zip(after, before)) if a > b]
            assert len(grew) == 1, (before, after)
            served[c].append(grew[0])
            r = row(replica, generation_id)
            if "upstream" in r:
                assert r["upstream"] == f"{fleet.servers[grew[0]].url}/v1", r
            usage = answer["usage"]
            assert r["cached_tokens"] == (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), (r, usage)
            cached[c].append(r["cached_tokens"])
            prompts[c].append(r["prompt_tokens"])
            conversations[c] = [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                                {"role": "user", "content": f"And what about the {rng.choice(WORDS)}?"}]
    report = {c: {"servers": served[c], "prompt": prompts[c], "cached": cached[c]} for c in served}
    for c in served:
        assert served[c] == [served[c][0]] * TURNS, f"{ROUTING}: a conversation moved between servers: {report}"
        # more than the opening every conversation shares (the system line): the server holds this conversation
        assert all(cached[c][t] > prompts[c][t - 1] // 2 for t in range(1, TURNS)), (
            f"{ROUTING}: later turns not served from the server's prompt cache: {report}")
    assert sum(len(usage_rows(r.db)) for r in fleet.replicas) == CONVERSATIONS * TURNS
