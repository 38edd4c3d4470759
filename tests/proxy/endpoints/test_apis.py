"""/v1/embeddings, /v1/responses and /v1/messages (docs/reference.md, "The other endpoints"): official SDKs
against the gateway in front of the mock, each request's row checked against what the SDK saw."""

import asyncio

import anthropic
import orjson
import pytest

from kilnproxy.testing import Harness

ALL = ["completions", "chat/completions", "embeddings", "responses", "messages"]
PROMPT, COMPLETION = 0.10 / 1e6, 0.30 / 1e6


def serving(*endpoints, flavor=None):
    def configure(config):
        config["models"][0]["endpoints"] = list(endpoints or ALL)
    return configure


def cost(prompt, completion):
    return round(prompt * PROMPT + completion * COMPLETION, 10)


def columns(row):
    return {k: row[k] for k in ("model", "endpoint", "stream", "status", "error_code", "prompt_tokens",
                                "completion_tokens", "cached_tokens", "cost", "finish_reason", "disconnected")}


def claude(h, **kwargs):
    kwargs.setdefault("api_key", h.key)
    client = anthropic.AsyncAnthropic(base_url=h.url, max_retries=0, **kwargs)
    h._clients.append(client)
    return client


async def test_embeddings_with_the_openai_sdk(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        raw = await h.openai().embeddings.with_raw_response.create(model=h.model, input=["a b c", "d"],
                                                                 encoding_format="float")
        out = raw.parse()
        assert [d.index for d in out.data] == [0, 1]
        assert out.data[1].embedding == [round(2 / (d + 1), 4) for d in range(8)]
        assert out.model == h.model
        assert out.usage.prompt_tokens == 4
        assert out.usage.model_extra["cost"] == cost(4, 0)
        row = await h.row(raw.headers["X-Neocloud-Generation-Id"])
        assert columns(row) == {"model": h.model, "endpoint": "embeddings", "stream": 0, "status": 200,
                                "error_code": None, "prompt_tokens": 4, "completion_tokens": 0, "cached_tokens": 0,
                                "cost": cost(4, 0), "finish_reason": None, "disconnected": 0}
        assert (await h.mock_requests())[-1]["body"]["model"] == "org/Test-Model-7B"


async def test_responses_with_the_openai_sdk_streamed_and_not(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        client = h.openai()
        out = await client.responses.create(model=h.model, input="hello there", max_output_tokens=3)
        assert out.output_text == "Paris is the"
        assert out.model == h.model
        assert (out.usage.input_tokens, out.usage.output_tokens) == (2, 3)
        assert out.usage.model_extra["cost"] == cost(2, 3)
        stream = await client.responses.create(model=h.model, input="hello there", max_output_tokens=3, stream=True)
        events = [event async for event in stream]
        assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Paris is the"
        done = events[-1]
        assert done.type == "response.completed"
        assert done.response.model == h.model
        assert done.response.usage.model_extra["cost"] == cost(2, 3)
        rows = await h.rows()
        assert [columns(r) for r in rows] == [
            {"model": h.model, "endpoint": "responses", "stream": stream, "status": 200, "error_code": None,
             "prompt_tokens": 2, "completion_tokens": 3, "cached_tokens": 0, "cost": cost(2, 3),
             "finish_reason": "completed", "disconnected": 0} for stream in (0, 1)]
        sent = (await h.mock_requests())[-1]["body"]
        assert "stream_options" not in sent  # only the completion endpoints are told to report usage


async def test_a_responses_stream_keeps_its_event_lines_and_gets_no_done(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        body = {"model": h.model, "input": "hi", "max_output_tokens": 2, "stream": True,
                "mock": {"id": "resp_1", "created": 7}}
        async with h.post("/v1/responses", body) as resp:
            assert resp.status == 200
            raw = await resp.read()
        frames = raw.split(b"\n\n")
        assert frames[-1] == b""
        assert frames[2].startswith(b'event: response.output_item.added\ndata: {"type":"response.output_item.added"')
        assert frames[4] == (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                             + frames[4].split(b'"response.output_text.delta",', 1)[1])
        assert b"[DONE]" not in raw
        assert frames[-2].startswith(b"event: response.completed\ndata: ")
        assert b'"model":"test-model"' in frames[0] and b"org/Test-Model-7B" not in raw


async def test_messages_with_the_anthropic_sdk_create_and_stream(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        client = claude(h, default_headers={"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-04-04"})
        raw = await client.messages.with_raw_response.create(
            model=h.model, max_tokens=3, messages=[{"role": "user", "content": "hi you"}])
        message = await raw.parse()
        assert message.content[0].text == "Paris is the"
        assert message.model == h.model
        assert (message.usage.input_tokens, message.usage.output_tokens) == (2, 3)
        assert message.usage.model_extra["cost"] == cost(2, 3)
        sent = await h.mock_requests()
        assert sent[-1]["headers"]["anthropic-version"] == "2023-06-01"
        assert sent[-1]["headers"]["anthropic-beta"] == "tools-2024-04-04"
        assert "x-api-key" not in {k.lower() for k in sent[-1]["headers"]}
        async with client.messages.stream(model=h.model, max_tokens=4,
                                          messages=[{"role": "user", "content": "hi you"}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Paris is the capital"
        assert final.model == h.model
        assert (final.usage.input_tokens, final.usage.output_tokens) == (2, 4)
        rows = await h.rows()
        assert [columns(r) for r in rows] == [
            {"model": h.model, "endpoint": "messages", "stream": 0, "status": 200, "error_code": None,
             "prompt_tokens": 2, "completion_tokens": 3, "cached_tokens": 0, "cost": cost(2, 3),
             "finish_reason": "max_tokens", "disconnected": 0},
            {"model": h.model, "endpoint": "messages", "stream": 1, "status": 200, "error_code": None,
             "prompt_tokens": 2, "completion_tokens": 4, "cached_tokens": 0, "cost": cost(2, 4),
             "finish_reason": "max_tokens", "disconnected": 0}]
        assert rows[0]["id"] == raw.headers["X-Neocloud-Generation-Id"]


async def test_llamacpp_message_delta_without_prompt_counts_and_cache_reads(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        body = {"model": h.model, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "a b c"}],
                "mock": {"flavor": "llamacpp", "cached_tokens": 2}}
        async with h.post("/v1/messages", body) as resp:
            raw = await resp.read()
        delta = [f for f in raw.split(b"\n\n") if f.startswith(b"event: message_delta")][0]
        row = (await h.rows())[0]
        # prompt = input 1 + cache reads 2, from message_start; the cached part priced at cached_prompt
        assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == (3, 2, 2)
        assert row["cost"] == round((1 * 0.10 + 2 * 0.05 + 2 * 0.30) / 1e6, 10)
        assert orjson.loads(delta.split(b"data: ", 1)[1])["usage"] == {"output_tokens": 2, "cost": row["cost"]}


async def test_anthropic_errors_keep_their_status_in_anthropics_form(tmp_path):
    def configure(config):
        serving()(config)
        config["orgs"].append({"id": "broke", "credits": 0.0})
        config["keys"].append({"key": "sk-broke", "org": "broke"})
        config["keys"].append({"key": "sk-off", "org": "acme", "disabled": True})
    async with Harness(tmp_path, configure=configure) as h:
        messages = [{"role": "user", "content": "hi"}]
        cases = [(claude(h, api_key="sk-nope"), h.model, {}, anthropic.AuthenticationError, 401, "authentication_error"),
                 (claude(h, api_key="sk-broke"), h.model, {}, anthropic.APIStatusError, 402, "billing_error"),
                 (claude(h, api_key="sk-off"), h.model, {}, anthropic.PermissionDeniedError, 403, "permission_error"),
                 (claude(h), "nope", {}, anthropic.NotFoundError, 404, "not_found_error"),
                 (claude(h), h.model, {"mock": {"fail": "500"}}, anthropic.InternalServerError, 502, "api_error")]
        for client, model, extra, kind, status, error_type in cases:
            with pytest.raises(kind) as caught:
                await client.messages.create(model=model, max_tokens=2, messages=messages, extra_body=extra)
            assert caught.value.status_code == status
            assert caught.value.body["type"] == "error"
            assert caught.value.body["error"]["type"] == error_type
        # a bearer works too (ANTHROPIC_AUTH_TOKEN)
        out = await claude(h, api_key=None, auth_token=h.key).messages.create(model=h.model, max_tokens=1,
                                                                             messages=messages)
        assert out.content[0].text == "Paris"
        statuses = [(r["status"], r["error_code"]) for r in await h.rows()]
        assert statuses == [(402, "insufficient_credits"), (403, "forbidden"), (404, "model_not_found"),
                            (502, "upstream_error"), (200, None)]


async def test_an_error_mid_stream_is_the_formats_own_event(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        for path, body in (("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/responses", {"max_output_tokens": 5, "input": "x"})):
            for fail in ("error_event", "drop"):
                async with h.post(path, {**body, "model": h.model, "stream": True,
                                         "mock": {"fail": fail, "after": 4}}) as resp:
                    raw = await resp.read()
                last = raw.split(b"\n\n")[-2]
                assert last.startswith(b"event: error\ndata: {\"type\":\"error\"")
                assert b"[DONE]" not in raw
        rows = await h.rows()
        assert [(r["endpoint"], r["status"], r["error_code"], r["completion_tokens"]) for r in rows] == [
            ("messages", 200, "api_error", 1), ("messages", 200, "upstream_error", 1),
            ("responses", 200, "server_error", 0), ("responses", 200, "upstream_error", 0)]


async def test_a_client_that_leaves_an_anthropic_stream_is_billed_once_and_upstream_closed(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        client = claude(h)
        async with client.messages.stream(model=h.model, max_tokens=50, messages=[{"role": "user", "content": "x"}],
                                          extra_body={"mock": {"delay": 0.05}}) as stream:
            async for text in stream.text_stream:
                if text.strip() == "the":
                    break
        await h.mock_wait(hangups=1)
        for _ in range(50):
            rows = await h.rows()
            if rows:
                break
            await asyncio.sleep(0.02)
        assert len(rows) == 1
        row = rows[0]
        assert (row["endpoint"], row["disconnected"], row["prompt_tokens"]) == ("messages", 1, 1)
        assert row["completion_tokens"] >= 3


async def test_an_endpoint_the_model_does_not_list_is_model_not_found(tmp_path):
    async with Harness(tmp_path) as h:  # the default: completions and chat/completions
        async with h.post("/v1/embeddings", {"model": h.model, "input": "x"}) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"] == {
                "message": f"The model `{h.model}` does not exist or you do not have access to it.",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        async with h.session.get(f"{h.url}/v1/models", headers=h.headers()) as resp:
            assert (await resp.json())["data"][0]["endpoints"] == ["completions", "chat/completions"]
    async with Harness(tmp_path / "2", configure=serving("embeddings")) as h:
        async with h.post("/v1/completions", {"model": h.model, "prompt": "x"}) as resp:
            assert resp.status == 404
        assert [(r["endpoint"], r["status"]) for r in await h.rows()] == [("completions", 404)]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses", "/v1/messages"])
async def test_a_body_that_is_not_json_or_has_no_model_is_400(tmp_path, path):
    async with Harness(tmp_path, configure=serving()) as h:
        async with h.post(path, data=b"{nope", headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            first = await resp.json()
        async with h.post(path, {"input": "x"}) as resp:
            assert resp.status == 400
            second = await resp.json()
        if path == "/v1/messages":
            assert first["error"]["type"] == second["error"]["type"] == "invalid_request_error"
            assert second == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "The request body has no `model`."}}
        else:
            assert (first["error"]["code"], second["error"]["code"]) == ("invalid_request", "invalid_request")
        assert [r["status"] for r in await h.rows()] == [400, 400]


async def test_bad_input_is_forwarded_or_refused_never_500(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        async with h.post("/v1/embeddings", {"model": h.model, "input": ["w"] * 10_000}) as resp:
            assert resp.status == 200
            assert len((await resp.json())["data"]) == 10_000
        async with h.post("/v1/messages", {"model": h.model, "messages": [{"role": "user", "content": "x"}]}) as resp:
            assert resp.status == 400  # the upstream's own answer, passed through
            assert await resp.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                                     "message": "max_tokens: Field required"}}
        async with h.post("/v1/responses", {"model": h.model, "input": "x", "mock": {"fail": "404"}}) as resp:
            assert resp.status == 502
        rows = await h.rows()
        assert [(r["endpoint"], r["status"], r["prompt_tokens"]) for r in rows] == [
            ("embeddings", 200, 10_000), ("messages", 400, 0), ("responses", 502, 0)]
        assert rows[1]["error_code"] == "invalid_request_error"


async def test_count_tokens_is_forwarded_and_not_metered(tmp_path):
    async with Harness(tmp_path, configure=serving()) as h:
        out = await claude(h).messages.count_tokens(model=h.model, messages=[{"role": "user", "content": "a b c"}])
        assert out.input_tokens == 3
        assert await h.rows() == []


async def test_plugins_are_told_the_endpoint(tmp_path):
    seen = []

    class Plugin:
        from kilnproxy import hookimpl

        @hookimpl
        def transform_event(self, call, event):
            seen.append((call.endpoint, event.get("type")))
            if event.get("type") == "ping":
                from kilnproxy import DROP
                return DROP

        @hookimpl
        def transform_response(self, call, body):
            seen.append((call.endpoint, "body"))
    async with Harness(tmp_path, plugins=[Plugin()], configure=serving()) as h:
        await h.openai().embeddings.create(model=h.model, input="x")
        async with h.post("/v1/messages", {"model": h.model, "max_tokens": 1, "stream": True,
                                           "messages": [{"role": "user", "content": "x"}]}) as resp:
            raw = await resp.read()
        assert b"event: ping" not in raw
    assert seen == [("embeddings", "body"), ("messages", "message_start"), ("messages", "content_block_start"),
                    ("messages", "ping"), ("messages", "content_block_delta"), ("messages", "content_block_stop"),
                    ("messages", "message_delta"), ("messages", "message_stop")]


BODIES = {"/v1/embeddings": {"input": "x"}, "/v1/responses": {"max_output_tokens": 5, "input": "x"},
          "/v1/messages": {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("fail, code", [("reset", "upstream_unreachable"), ("garbage", "upstream_bad_response")])
async def test_the_mocks_failures_before_the_head_reach_every_api(tmp_path, path, fail, code):
    """The mock upstream's ``fail`` modes steer the other endpoints as they steer completions."""
    async with Harness(tmp_path, configure=serving()) as h:
        async with h.post(path, {**BODIES[path], "model": h.model, "mock": {"fail": fail}}) as resp:
            assert resp.status == 502
        assert [(r["status"], r["error_code"]) for r in await h.rows()] == [(502, code)]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_the_mocks_stream_that_just_ends_is_an_upstream_error(tmp_path, path):
    async with Harness(tmp_path, configure=serving()) as h:
        async with h.post(path, {**BODIES[path], "model": h.model, "stream": True,
                                 "mock": {"fail": "eof", "after": 3}}) as resp:
            raw = await resp.read()
        assert raw.split(b"\n\n")[-2].startswith(b"event: error\n")
        assert [(r["status"], r["error_code"]) for r in await h.rows()] == [(200, "upstream_error")]
