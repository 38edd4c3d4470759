"""The read endpoints take the key as Anthropic's clients send it (``x-api-key``, with ``anthropic-version``),
as ``/v1/messages`` does: the official anthropic SDK lists and retrieves models, and raw HTTP gets the same
answers and the same error codes as with a bearer."""

from __future__ import annotations

import anthropic
import pytest

from kilnproxy.testing import KEY, MODEL, completion_body

ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


def claude(h, key: str) -> anthropic.AsyncAnthropic:
    """The anthropic SDK sending its key as Anthropic's API asks for it, in ``x-api-key`` (this SDK's release
    sends ``api_key`` as a bearer; earlier ones, and most clients of Anthropic's API, send ``x-api-key``)."""
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key=None, default_headers={"x-api-key": key},
                                      max_retries=0)
    h._clients.append(client)
    return client


@pytest.mark.parametrize("as_bearer", [False, True], ids=["x-api-key", "bearer"])
async def test_the_anthropic_sdk_lists_and_retrieves_the_models(harness, monkeypatch, as_bearer):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    async with harness() as h:
        if as_bearer:
            client = anthropic.AsyncAnthropic(base_url=h.url, api_key=h.key, max_retries=0)
            wrong = anthropic.AsyncAnthropic(base_url=h.url, api_key="sk-nope", max_retries=0)
            h._clients += [client, wrong]
        else:
            client, wrong = claude(h, h.key), claude(h, "sk-nope")
        page = await client.models.list()
        one = await client.models.retrieve(MODEL)
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.models.retrieve("nope")
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await wrong.models.list()
    assert [m.id for m in page.data] == [MODEL] and one.id == MODEL
    assert missing.value.body["error"]["code"] == "model_not_found"
    assert refused.value.body["error"]["code"] == "invalid_api_key"


async def read(h, path: str, headers: dict) -> tuple[int, dict]:
    async with h.session.get(f"{h.url}{path}", headers=headers) as resp:
        return resp.status, await resp.json()


def with_a_disabled_key(config: dict) -> None:
    config["keys"].append({"key": "sk-off", "org": "acme", "id": "off-key", "disabled": True})


async def test_every_read_endpoint_takes_x_api_key_and_answers_as_with_a_bearer(harness):
    async with harness(configure=with_a_disabled_key) as h:
        async with h.post("/v1/completions", completion_body()) as resp:
            gen = resp.headers["X-Neocloud-Generation-Id"]
        paths = ["/v1/models", f"/v1/models/{MODEL}", "/v1/credits", "/v1/key", f"/v1/generations/{gen}"]
        for path in paths:
            bearer = await read(h, path, {"Authorization": f"Bearer {KEY}"})
            assert bearer[0] == 200
            assert await read(h, path, {"x-api-key": KEY, **ANTHROPIC_HEADERS}) == bearer, path
            for headers, status, code in [({"x-api-key": "sk-nope"}, 401, "invalid_api_key"),
                                          ({"x-api-key": ""}, 401, "invalid_api_key"),
                                          ({"x-api-key": "sk-off"}, 403, "forbidden"),
                                          # a bearer, when there is one, is the key, as on /v1/messages
                                          ({"Authorization": "Bearer sk-nope", "x-api-key": KEY}, 401,
                                           "invalid_api_key")]:
                status_got, body = await read(h, path, {**headers, **ANTHROPIC_HEADERS})
                assert (status_got, body["error"]["code"]) == (status, code), (path, headers)
