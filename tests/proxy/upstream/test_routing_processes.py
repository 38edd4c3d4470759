"""cache_aware across replicas (SPEC 13): two real gateway processes on one config, three mock servers with
prompt caches; a conversation whose turns alternate between the two gateways lands on one server, and its
later turns are served from that server's cache. (least_busy or round_robin: each process turns the
conversations over the servers on its own, and the turns scatter.)"""

import aiohttp
import pytest
from processes import GatewayProcess, gateway_config

from kilnproxy.testing import KEY, MODEL
from kilnproxy.web.server import start_mock

pytestmark = pytest.mark.asyncio

OPENING = "Here is a long document to discuss. " * 20


async def test_one_conversation_through_two_gateway_processes_lands_on_one_server(tmp_path):
    servers = [await start_mock(prompt_cache_slots=2) for _ in range(3)]
    gateways = []
    try:
        config = gateway_config([f"{m.url}/v1" for m in servers])
        config["models"][0].update(routing="cache_aware")
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
            gateways.append(await GatewayProcess(tmp_path / name, config).start())
        cached: dict[int, list[int]] = {}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
            for conversation in range(6):
                messages = [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": f"Conversation {conversation}. {OPENING}"}]
                for turn in range(4):
                    gateway = gateways[turn % 2]  # the turns alternate between the replicas
                    async with session.post(f"{gateway.url}/v1/chat/completions", json={
                            "model": MODEL, "messages": messages, "max_tokens": 4}) as resp:
                        assert resp.status == 200, await resp.text()
                        answer = await resp.json()
                    cached.setdefault(conversation, []).append(
                        answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
                    messages = messages + [answer["choices"][0]["message"],
                                           {"role": "user", "content": f"and then {turn}?"}]
            placed: dict[int, set[int]] = {}
            for i, m in enumerate(servers):
                async with session.get(f"{m.url}/mock/requests") as resp:
                    for r in await resp.json():
                        if r["path"].endswith("/chat/completions"):
                            opening = r["body"]["messages"][1]["content"]
                            placed.setdefault(int(opening.split(".", 1)[0].split()[1]), set()).add(i)
            caches = []
            for m in servers:
                async with session.get(f"{m.url}/mock/cache") as resp:
                    caches.append(await resp.json())
        assert sorted(placed) == list(range(6))
        assert all(len(where) == 1 for where in placed.values()), placed
        assert len({next(iter(w)) for w in placed.values()}) >= 2  # and the conversations spread
        for conversation, hits in cached.items():  # each later turn found its conversation in the cache
            assert all(later > hits[0] + 100 for later in hits[1:]), (conversation, hits)
        assert sum(c["requests"] for c in caches) == 24
        for gateway in gateways:  # each row names the server, as written in upstreams
            assert {r["upstream"] for r in gateway.rows()} <= {f"{m.url}/v1" for m in servers}
    finally:
        for gateway in gateways:
            await gateway.stop()
        for m in servers:
            await m.stop()
