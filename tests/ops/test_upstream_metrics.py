"""/metrics by upstream (SPEC 13): ``kilnproxy_upstream_prompt_tokens_total`` and
``kilnproxy_upstream_cached_tokens_total{model,upstream}`` as each upstream reported them, and
``kilnproxy_upstream_load{upstream}``, the load routing reads (this replica's requests or the server's own count)."""

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kilnproxy.testing import Harness
from kilnproxy.web.server import start_mock

pytestmark = pytest.mark.asyncio


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def scrape(h: Harness) -> dict:
    async with h.session.get(f"{h.url}/metrics") as resp:
        assert resp.status == 200
        return samples(await resp.text())


async def test_tokens_by_upstream_and_the_load(tmp_path):
    a, b = await start_mock(), await start_mock()
    try:
        host_b = b.url.split("://", 1)[1]
        urls = [f"{a.url}/v1", f"http://user:pw@{host_b}/v1"]

        def configure(config):
            config["models"][0].update(upstreams=urls, routing="round_robin", load_poll=0.05)

        async with Harness(tmp_path, configure=configure) as h:
            for cached in (0, 3, 1, 2):  # in turn: a, b, a, b (or b, a, b, a)
                async with h.post("/v1/chat/completions", {
                        "model": "test-model", "max_tokens": 2, "mock": {"cached_tokens": cached},
                        "messages": [{"role": "user", "content": "one two three four"}]}) as resp:
                    assert resp.status == 200
                    body = await resp.json()
            prompt = body["usage"]["prompt_tokens"]
            m = await scrape(h)
            shown = {urls[0]: urls[0], urls[1]: f"http://{host_b}/v1"}  # userinfo removed
            rows = await h.rows()
            for url in urls:
                mine = [r for r in rows if r["upstream"] == shown[url]]
                assert len(mine) == 2
                labels = (("model", "test-model"), ("upstream", shown[url]))
                assert m[("kilnproxy_upstream_prompt_tokens_total", labels)] == 2 * prompt
                assert m[("kilnproxy_upstream_cached_tokens_total", labels)] == sum(r["cached_tokens"] for r in mine)
            assert sorted(m[("kilnproxy_upstream_cached_tokens_total", (("model", "test-model"),
                                                                        ("upstream", shown[u])))] for u in urls) \
                in ([2, 4], [3, 3], [1, 5])
            for url in urls:
                assert m[("kilnproxy_upstream_load", (("upstream", shown[url]),))] == 0
                for name in ("kilnproxy_upstream_up", "kilnproxy_upstream_in_flight_requests"):  # every label alike
                    assert (name, (("model", "test-model"), ("upstream", shown[url]))) in m
                assert ("kilnproxy_upstream_slots_busy", (("upstream", shown[url]),)) in m
            async with h.session.get(f"{h.url}/metrics") as resp:
                assert "pw@" not in await resp.text()  # the upstream's password is no label

            # two streams held on the mock a by a client that bypasses the gateway: its /metrics says 2
            held = []
            for _ in range(2):
                resp = await h.session.post(f"{a.url}/v1/chat/completions", json={
                    "model": "m", "stream": True, "mock": {"silence": 60},
                    "messages": [{"role": "user", "content": "elsewhere"}]})
                assert resp.status == 200
                held.append(resp)
            try:
                deadline = time.monotonic() + 10
                while (await scrape(h)).get(("kilnproxy_upstream_load", (("upstream", urls[0]),))) != 2:
                    assert time.monotonic() < deadline, "the load read never reached /metrics"
                    await asyncio.sleep(0.02)
            finally:
                for resp in held:
                    resp.close()
    finally:
        await a.stop()
        await b.stop()
