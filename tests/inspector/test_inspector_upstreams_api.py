"""The inspector's upstreams view (``GET /ui/api/upstreams``, SPEC 13): each model's upstreams with the prompt
and cached tokens they reported, their hit rate and their load, through a real gateway in front of two mock
servers with prompt caches; the same counts as /metrics; an upstream a reload removed; the access rule."""

import asyncio

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kilnproxy.ops.admin import RELOADER
from kilnproxy.config import parse_config
from kilnproxy.testing import Harness, MODEL
from kilnproxy.web.server import start_mock

pytestmark = pytest.mark.asyncio

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OPENING = "Here is a long document to discuss. " * 10


async def upstreams(h: Harness, headers=AUTH) -> tuple[int, bytes]:
    async with h.session.get(f"{h.url}/ui/api/upstreams", headers=headers) as resp:
        return resp.status, await resp.read()


async def view(h: Harness) -> dict:
    status, body = await upstreams(h)
    assert status == 200, body
    return orjson.loads(body)


async def turn(h: Harness, messages: list, **extra) -> dict:
    async with h.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3, **extra}) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        return {"id": r.headers["X-Neocloud-Generation-Id"], "message": answer["choices"][0]["message"],
                "prompt": answer["usage"]["prompt_tokens"],
                "cached": answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)}


async def metrics(h: Harness) -> dict:
    async with h.session.get(f"{h.url}/metrics") as resp:
        assert resp.status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(await resp.text()) for s in family.samples}


def entry(url, prompt, cached, *, load=0, up=True, routing="cache_aware"):
    return {"model": MODEL, "routing": routing, "upstream": url, "up": up, "load": load, "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None}


async def test_hit_rate_and_load_by_upstream(tmp_path):
    a, b = await start_mock(prompt_cache_slots=2), await start_mock(prompt_cache_slots=2)
    try:
        host_b = b.url.split("://", 1)[1]
        urls = [f"{a.url}/v1", f"http://user:pw@{host_b}/v1"]
        shown = [urls[0], f"http://{host_b}/v1"]  # userinfo removed, as in the usage rows

        def configure(config):
            config["models"][0].update(upstreams=urls, routing="cache_aware", load_poll=0)
            config["inspector"] = {"token": TOKEN}

        async with Harness(tmp_path, configure=configure) as h:
            assert await view(h) == {"data": [entry(shown[0], 0, 0), entry(shown[1], 0, 0)]}

            # conversations of three turns each: each lands on one server, its later turns from that server's cache
            turns = []
            for conversation in range(4):
                messages = [{"role": "user", "content": f"Conversation {conversation}. {OPENING}"}]
                for n in range(3):
                    t = await turn(h, messages)
                    turns.append(t)
                    messages = [*messages, t["message"], {"role": "user", "content": f"And then {n}?"}]
            await h.usage_recorded()
            rows = {r["id"]: r for r in await h.rows()}
            by_upstream = {url: [0, 0] for url in shown}
            for t in turns:
                by_upstream[rows[t["id"]]["upstream"]][0] += t["prompt"]
                by_upstream[rows[t["id"]]["upstream"]][1] += t["cached"]
            assert sum(t["cached"] for t in turns) > 0  # the servers' caches served the later turns
            expected = [entry(url, *by_upstream[url]) for url in shown]
            assert await view(h) == {"data": expected}

            m = await metrics(h)  # the same counts as /metrics
            for url in shown:
                labels = (("model", MODEL), ("upstream", url))
                # (no series for an upstream that served nothing: all four conversations may land on one)
                assert [m.get(("kilnproxy_upstream_prompt_tokens_total", labels), 0),
                        m.get(("kilnproxy_upstream_cached_tokens_total", labels), 0)] == by_upstream[url]

            # a stream in flight through the gateway: its upstream's load is 1 while it lasts
            held = await h.post("/v1/chat/completions", {
                "model": MODEL, "stream": True, "max_tokens": 3, "mock": {"silence": 60},
                "messages": [{"role": "user", "content": "held"}]})
            assert held.status == 200
            during = await view(h)
            held_id = held.headers["X-Neocloud-Generation-Id"]
            ended = asyncio.get_running_loop().create_future()

            def listener(rows):  # the held request's row is committed once the gateway saw the client go
                if not ended.done() and any(row["id"] == held_id for row, _ in rows):
                    ended.set_result(None)

            h.gw.commit_listeners.append(listener)
            held.close()
            async with asyncio.timeout(30):
                await ended
            h.gw.commit_listeners.remove(listener)
            held_row = await h.row(held_id)
            assert [u["load"] for u in during["data"]] == [int(url == held_row["upstream"]) for url in shown]
            after = [e for e in (await view(h))["data"]]
            assert [e["load"] for e in after] == [0, 0]

            # a reload without the second server: its counts stay, listed after the configured ones
            raw = {**h.config, "models": [{**h.config["models"][0], "upstreams": urls[:1]}]}
            h.app[RELOADER].apply(parse_config(raw, source="<test>"))
            tokens = {e["upstream"]: (e["prompt_tokens"], e["cached_tokens"]) for e in after}
            assert await view(h) == {"data": [
                entry(shown[0], *tokens[shown[0]]),
                entry(shown[1], *tokens[shown[1]], load=None, up=None, routing=None)]}

            # the inspector's access rule: its token, or nothing
            status, body = await upstreams(h, headers={})
            assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_token"
    finally:
        await a.stop()
        await b.stop()
