"""The request rules (docs/reference.md): what the gateway does to a request, rule by rule, in order."""

import orjson
import pytest

from kilnproxy.testing import KEY, MODEL, OTHER_KEY, UPSTREAM_MODEL

GEN = "X-Neocloud-Generation-Id"


async def error_of(resp):
    body = await resp.read()
    assert resp.headers["Content-Type"].startswith("application/json"), body
    return orjson.loads(body)["error"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-nope"}, {"Authorization": "Basic abc"},
                                     {"Authorization": "Bearer "}])
async def test_missing_or_unknown_key_is_401_without_generation_id(gw, headers):
    async with gw.session.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                               headers=headers) as resp:
        assert resp.status == 401
        assert (await error_of(resp))["code"] == "invalid_api_key"
        assert GEN not in resp.headers
    assert await gw.rows() == []  # no org to charge
    assert await gw.mock_requests() == []


async def test_disabled_key_is_403_and_recorded(harness):
    keys = [{"key": KEY, "org": "acme", "id": "acme-key", "disabled": True}]
    async with harness(overrides={"keys": keys}) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x"}) as resp:
            assert resp.status == 403
            assert (await error_of(resp))["code"] == "forbidden"
            gen = resp.headers[GEN]
        assert (await h.row(gen))["status"] == 403


async def test_no_credits_is_402_before_upstream(harness):
    async with harness(overrides={"orgs": [{"id": "acme", "credits": 0.0}, {"id": "globex", "credits": 1.0}]}) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x"}) as resp:
            assert resp.status == 402
            assert (await error_of(resp))["code"] == "insufficient_credits"
        assert await h.mock_requests() == []


async def test_maintenance_is_503_with_retry_after(harness):
    when = "Tue, 01 Dec 2026 06:00:00 GMT"
    async with harness(overrides={"maintenance": {"enabled": True, "retry_after": when}}) as h:
        async with h.post("/v1/chat/completions", {"model": MODEL, "messages": []}) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == when
            assert (await error_of(resp))["code"] == "maintenance"
            assert GEN in resp.headers


async def test_maintenance_comes_after_auth(harness):
    async with harness(overrides={"maintenance": {"enabled": True}}) as h:
        async with h.post("/v1/completions", {"model": MODEL}, key="sk-wrong") as resp:
            assert resp.status == 401


async def test_body_over_limit_is_413(harness):
    async with harness(overrides={"server": {"max_request_bytes": 1000}}) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x" * 2000}) as resp:
            assert resp.status == 413
            assert (await error_of(resp))["code"] == "request_too_large"
        # chunked upload, no Content-Length: still counted
        async def gen():
            yield b'{"model": "test-model", "prompt": "'
            for _ in range(10):
                yield b"y" * 200
            yield b'"}'
        async with h.post("/v1/completions", data=gen(), headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 413
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "fits", "max_tokens": 1}) as resp:
            assert resp.status == 200
        assert len(await h.rows()) == 3


@pytest.mark.parametrize("raw, param", [
    (b"not json", None),
    (b"[1, 2]", None),
    (b'"model"', None),
    (b"{}", "model"),
    (b'{"prompt": "x"}', "model"),
    (b'{"model": 7, "prompt": "x"}', "model"),
    (b'{"model": "test-model", "prompt": "x"', None),
])
async def test_bad_body_is_400_invalid_request(gw, raw, param):
    async with gw.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        error = await error_of(resp)
        assert error["code"] == "invalid_request"
        assert error["param"] == param
        assert GEN in resp.headers
    assert await gw.mock_requests() == []


async def test_unknown_model_is_404_with_exact_message(gw):
    async with gw.post("/v1/completions", {"model": "not-a-model", "prompt": "x"}) as resp:
        assert resp.status == 404
        assert await error_of(resp) == {
            "message": "The model `not-a-model` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }


async def test_model_outside_allow_list_is_403(harness):
    def configure(config):
        config["models"].append({"id": "other-model", "upstreams": ["http://127.0.0.1:9/v1"]})
        config["keys"] = [{"key": KEY, "org": "acme", "models": ["other-model"]}]
    async with harness(configure=configure) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x"}) as resp:
            assert resp.status == 403
            assert (await error_of(resp))["code"] == "forbidden"


@pytest.mark.parametrize("value, expected", [
    (True, True), ("true", True), (1, True),
    (False, False), ("false", False), (0, False), (None, False), ("absent", False),
])
async def test_stream_coercion_sends_a_real_boolean_upstream(gw, value, expected):
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
    if value != "absent":
        body["stream"] = value
    async with gw.post("/v1/completions", body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream" if expected else "application/json")
        await resp.read()
    sent = (await gw.mock_requests())[-1]["body"]
    if value == "absent":
        assert "stream" not in sent
    else:
        assert sent["stream"] is expected


@pytest.mark.parametrize("value", ["yes", 2, 1.0, [], {}, "True"])
async def test_other_stream_values_are_400(gw, value):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "x", "stream": value}) as resp:
        assert resp.status == 400
        error = await error_of(resp)
        assert (error["code"], error["param"]) == ("invalid_request", "stream")


@pytest.mark.parametrize("stream", [False, "false", 0, None, "absent"])
async def test_stream_options_without_true_stream_is_400(gw, stream):
    body = {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}
    if stream != "absent":
        body["stream"] = stream
    async with gw.post("/v1/completions", body) as resp:
        assert resp.status == 400
        assert (await error_of(resp))["param"] == "stream_options"
    assert await gw.mock_requests() == []


async def test_reject_chat_params_only_on_chat(gw):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "max_tokens": 2}
    async with gw.post("/v1/chat/completions", chat) as resp:
        assert resp.status == 400
        error = await error_of(resp)
        assert (error["code"], error["param"]) == ("unsupported_parameter", "ignore_eos")
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "x", "ignore_eos": True,
                                           "max_tokens": 2}) as resp:
        assert resp.status == 200
    assert (await gw.mock_requests())[-1]["body"]["ignore_eos"] is True


async def test_upstream_gets_forced_include_usage_upstream_model_and_untouched_fields(gw):
    body = {"model": MODEL, "prompt": [[1, 2, 3], "odd ünïcode \u2028"], "max_tokens": 2, "stream": "true",
            "stream_options": {"continuous_usage_stats": False}, "vendor_field": {"nested": [1, None, 2.5]},
            "temperature": 0.5}
    async with gw.post("/v1/completions", body) as resp:
        assert resp.status == 200
        await resp.read()
    sent = (await gw.mock_requests())[-1]
    assert sent["body"] == {**body, "model": UPSTREAM_MODEL, "stream": True,
                            "stream_options": {"continuous_usage_stats": False, "include_usage": True}}


async def test_client_key_never_goes_upstream(gw):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}) as resp:
        await resp.read()
    headers = (await gw.mock_requests())[-1]["headers"]
    assert "Authorization" not in headers
    assert KEY not in orjson.dumps(headers).decode()


async def test_upstream_bearer_comes_from_env(harness, monkeypatch):
    monkeypatch.setenv("TEST_UPSTREAM_TOKEN", "upstream-secret")
    async with harness(configure=lambda c: c["models"][0].update(upstream_api_key_env="TEST_UPSTREAM_TOKEN")) as h:
        async with h.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}) as resp:
            await resp.read()
        assert (await h.mock_requests())[-1]["headers"]["Authorization"] == "Bearer upstream-secret"


async def test_rules_apply_in_order_first_failure_answers(harness):
    # maintenance (step 2) wins over a bad body (step 3) and an unknown model (step 4)
    async with harness(overrides={"maintenance": {"enabled": True}}) as h:
        async with h.post("/v1/completions", data=b"garbage") as resp:
            assert resp.status == 503
    # the body (step 3) is judged before the model (step 4), the model before stream (step 6)
    async with harness() as h:
        async with h.post("/v1/completions", {"model": "nope", "stream": "maybe"}) as resp:
            assert resp.status == 404
        async with h.post("/v1/completions", {"model": MODEL, "stream": "maybe", "ignore_eos": 1}) as resp:
            assert resp.status == 400


async def test_other_org_key_works_too(gw):
    async with gw.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}, key=OTHER_KEY) as r:
        assert r.status == 200
        gen = r.headers[GEN]
    assert (await gw.row(gen))["org"] == "globex"
