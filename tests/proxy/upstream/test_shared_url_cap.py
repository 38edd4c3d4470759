"""An upstream URL's `max_in_flight` is the URL's, whichever model gives it (SPEC 12, issue 40): a model
that lists the URL without a cap before the model that gives it one does not turn the cap off."""

import aiohttp
import pytest

from kilnproxy.config import parse_config
from kilnproxy.mock_servers.mock_upstream import STATS
from kilnproxy.proxy.upstream.routes import routes_from
from kilnproxy.testing import MODEL

UNCAPPED = "uncapped-first"


def uncapped_listing_first(config):
    """A model listing the mock's URL as a plain string, before the test model that caps it at 1."""
    m = config["models"][0]
    url = m["upstreams"][0]
    m.update(upstreams=[{"url": url, "max_in_flight": 1}], queue_timeout=0)
    config["models"].insert(0, {"id": UNCAPPED, "upstreams": [url], "upstream_model": m["upstream_model"]})


async def test_the_cap_holds_when_an_uncapped_listing_comes_first(harness, eventually):
    async with harness(configure=uncapped_listing_first) as h:
        routes = h.gw.routes
        assert [r.id for r in routes.values()] == [UNCAPPED, MODEL]
        pool = routes[UNCAPPED].upstreams[0].slots
        assert pool is routes[MODEL].upstreams[0].slots and pool.limit == 1
        async with aiohttp.ClientSession() as s:
            # one request of the uncapped listing holds the URL's only slot (its answer is silent for an hour)
            holder = await s.post(f"{h.url}/v1/completions", headers=h.headers(), json={
                "model": UNCAPPED, "prompt": "hi", "stream": True, "max_tokens": 2, "mock": {"silence": 3600}})
            assert holder.status == 200
            await eventually(lambda: h.mock.app[STATS]["active"] == 1)
            for model in (UNCAPPED, MODEL):  # through either model, the URL is full
                async with s.post(f"{h.url}/v1/completions", headers=h.headers(),
                                  json={"model": model, "prompt": "hi", "max_tokens": 2}) as resp:
                    assert resp.status == 503
                    assert (await resp.json())["error"]["code"] == "upstream_busy"
            assert h.mock.app[STATS]["requests"] == 1
            holder.close()
        await eventually(lambda: pool.busy == 0)
        async with h.post("/v1/completions", {"model": UNCAPPED, "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200
        assert h.mock.app[STATS]["max_active"] == 1


def test_every_route_of_the_url_gets_the_cap_in_any_order():
    url = "http://gpu1:8000/v1"
    plain = {"id": "a", "upstreams": [url, "http://gpu2:8000/v1"]}
    capped = {"id": "b", "upstreams": [{"url": url, "max_in_flight": 3}]}
    for models in ([plain, capped], [capped, plain]):
        config = parse_config({"models": models})
        routes = routes_from(config.models, config.server)
        (a_pool, gpu2), (b_pool,) = ([u.slots for u in routes[i].upstreams] for i in ("a", "b"))
        assert a_pool is b_pool and a_pool.limit == 3 and gpu2.limit is None


def test_two_different_caps_for_one_url_are_refused_naming_both_models():
    url = "http://gpu1:8000/v1"
    with pytest.raises(Exception) as refused:
        parse_config({"models": [{"id": "a", "upstreams": [url]},
                                 {"id": "b", "upstreams": [{"url": url, "max_in_flight": 4}]},
                                 {"id": "c", "upstreams": [{"url": url, "max_in_flight": 2}]}]})
    assert str(refused.value) == (
        "<config>: models (c).upstreams: http://gpu1:8000/v1 has max_in_flight = 2 here but 4 in model 'b': an "
        "upstream's slots are shared by every model that lists it, so give it one value")
