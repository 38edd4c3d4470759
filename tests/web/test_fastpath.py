"""The hot endpoints are answered by the server's own route table (kilnproxy.web.fastpath), not the
app's router; what the table does not take (a query string, an escaped path, an ``Expect``
header, another method) still reaches the same handler or the same JSON error through the app."""

import pytest
from aiohttp import web
from yarl import URL

from kilnproxy.testing import MODEL

GEN = "X-Neocloud-Generation-Id"
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}


def resolved_by(app: web.Application, monkeypatch) -> list[str]:
    """The paths ``app``'s router resolves from now on (the mock upstream's has a router too)."""
    seen = []
    resolve = web.UrlDispatcher.resolve

    async def counting(self, request):
        if self is app.router:
            seen.append(request.path)
        return await resolve(self, request)

    monkeypatch.setattr(web.UrlDispatcher, "resolve", counting)
    return seen


@pytest.fixture
def resolves(gw, monkeypatch):
    """The paths the gateway app's router has resolved."""
    return resolved_by(gw.gateway.app, monkeypatch)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_hot_endpoints_do_not_go_through_the_router(gw, resolves, path):
    body = BODY if path == "/v1/completions" else {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    for stream in (False, True):
        async with gw.session.post(f"{gw.url}{path}", json={**body, "stream": stream}, headers=gw.headers()) as resp:
            assert resp.status == 200
            await resp.read()
            assert (await gw.row(resp.headers[GEN]))["status"] == 200
    async with gw.session.post(f"{gw.url}{path}", json=body) as resp:  # no key: the app's JSON error rules
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    async with gw.session.get(f"{gw.url}/v1/models", headers=gw.headers()) as resp:
        assert resp.status == 200
    assert resolves == ["/v1/models"], resolves


@pytest.mark.parametrize("url, headers", [
    ("/v1/completions?trace=1", {}),
    ("/v1/%63ompletions", {}),
    ("/v1/completions", {"Expect": "100-continue"}),
])
async def test_what_the_table_does_not_take_goes_to_the_same_handler_through_the_app(gw, resolves, url, headers):
    target = URL(f"{gw.url}{url}", encoded=True)  # sent as written, escape included
    async with gw.session.post(target, json=BODY, headers={**gw.headers(), **headers}) as resp:
        assert resp.status == 200
        assert (await resp.json())["model"] == MODEL
        assert (await gw.row(resp.headers[GEN]))["status"] == 200
    assert resolves == ["/v1/completions"]


async def test_other_methods_on_a_hot_path_get_the_apps_json_405(gw, resolves):
    async with gw.session.put(f"{gw.url}/v1/chat/completions", json=BODY, headers=gw.headers()) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
    assert resolves == ["/v1/chat/completions"]


@pytest.fixture
def every_api(harness):
    """A gateway whose model serves every endpoint."""
    def configure(config):
        config["models"][0]["endpoints"] = ["completions", "chat/completions", "embeddings", "responses", "messages"]
    return harness(configure=configure)


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/embeddings", {"model": MODEL, "input": "Hi"}),
])
async def test_the_other_apis_do_not_go_through_the_router_either(every_api, monkeypatch, path, body):
    """Embeddings, the Responses API and Messages are hot too: the same rules, streamed and not (embeddings
    never stream), the no-key errors in each format's own form, and the router only for what the table
    does not take."""
    async with every_api as h:
        seen = resolved_by(h.gateway.app, monkeypatch)
        for stream in ((False, True) if path != "/v1/embeddings" else (False,)):
            async with h.post(path, {**body, "stream": stream} if stream else body) as resp:
                assert resp.status == 200
                raw = await resp.read()
                assert (b"event: " in raw) is stream
                assert (await h.row(resp.headers[GEN]))["status"] == 200
        async with h.session.post(f"{h.url}{path}", json=body) as resp:  # no key: the app's error rules
            assert resp.status == 401
            error = (await resp.json())["error"]
            assert error["type" if path == "/v1/messages" else "code"] == \
                ("authentication_error" if path == "/v1/messages" else "invalid_api_key")
        async with h.post(f"{path}?trace=1", body) as resp:  # a query string: the router, the same handler
            assert resp.status == 200
        assert seen == [path], seen
