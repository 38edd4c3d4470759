"""The endpoints (docs/reference.md): the catalog, liveness, and JSON errors for unknown routes."""

import pytest

from kilnproxy.testing import KEY, MODEL


async def test_models_list_in_openai_form_with_window_and_pricing(gw):
    client = gw.openai()
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with gw.session.get(f"{gw.url}/v1/models", headers=gw.headers()) as resp:
        body = await resp.json()
    card = body["data"][0]
    assert body["object"] == "list"
    assert card["object"] == "model" and card["context_window"] == 4096
    assert card["pricing"] == {"prompt": 0.10, "completion": 0.30, "cached_prompt": 0.05}


async def test_model_by_id_and_404(gw):
    client = gw.openai()
    assert (await client.models.retrieve(MODEL)).id == MODEL
    async with gw.session.get(f"{gw.url}/v1/models/nope", headers=gw.headers()) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_models_follow_the_keys_allow_list(harness):
    def configure(c):
        c["models"].append({"id": "hidden", "upstreams": ["http://127.0.0.1:9/v1"]})
        c["keys"][0]["models"] = [MODEL]
    async with harness(configure=configure) as h:
        async with h.session.get(f"{h.url}/v1/models", headers=h.headers()) as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
        async with h.session.get(f"{h.url}/v1/models/hidden", headers=h.headers()) as resp:
            assert resp.status == 404


@pytest.mark.parametrize("path", ["/v1/models", f"/v1/models/{MODEL}", "/v1/credits", "/v1/generations/gen-x"])
async def test_every_endpoint_but_healthz_needs_a_key(gw, path):
    async with gw.session.get(f"{gw.url}{path}") as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_api_key"


async def test_healthz_needs_no_key(gw):
    async with gw.session.get(f"{gw.url}/healthz") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ok", "store": "up"}


async def test_unknown_route_and_wrong_method_are_json(gw):
    async with gw.session.get(f"{gw.url}/v1/nothing", headers=gw.headers()) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"
    async with gw.session.get(f"{gw.url}/v1/completions", headers=gw.headers()) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/messages/nothing"):  # Anthropic's form there
        async with gw.session.get(f"{gw.url}{path}", headers=gw.headers()) as resp:
            assert resp.status == (404 if path.endswith("nothing") else 405)
            assert resp.headers.get("Allow") == (None if path.endswith("nothing") else "POST")
            assert await resp.json() == {"type": "error", "error": {
                "type": "not_found_error" if path.endswith("nothing") else "invalid_request_error",
                "message": "Not Found" if path.endswith("nothing") else "Method Not Allowed"}}


async def test_credits_of_the_callers_org(gw):
    async with gw.session.get(f"{gw.url}/v1/credits", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert await resp.json() == {"org": "acme", "granted": 100.0, "spent": 0.0, "remaining": 100.0}
