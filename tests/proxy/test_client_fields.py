"""What real clients send, through a running gateway on a real port: the fields the openai SDK (its
``extra_body`` included), LangChain's ChatOpenAI and raw HTTP clients put in a body pass upstream untouched;
``n`` and ``best_of``, which the hold counts, are refused with a 400 naming them when they are not a number
of choices."""

from __future__ import annotations

import pytest

from kilnproxy.testing import MODEL, UPSTREAM_MODEL, completion_body

MESSAGES = [{"role": "user", "content": "hi"}]
STRICT_TOOL = {"type": "function", "function": {"name": "weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
PASSED_THROUGH = {
    "logit_bias": {"50256": -100, "15": 5},
    "tools": [STRICT_TOOL], "tool_choice": "auto", "parallel_tool_calls": False,
    "stop": [f"stop-{i}" for i in range(2000)],
    "user": "user-42", "metadata": {"team": "ml"}, "store": False, "seed": 2**63 - 1,
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {}}},
    "logprobs": True, "top_logprobs": 2, "reasoning_effort": "low", "service_tier": "auto",
    "chat_template_kwargs": {"enable_thinking": False}, "top_k": 20,  # vLLM's, through extra_body
    "n": 1, "temperature": 0.7,  # LangChain's ChatOpenAI
}


async def test_what_clients_send_goes_upstream_untouched(harness):
    async with harness(configure=lambda c: c["models"][0].update(reject_chat_params=[])) as h:
        client = h.openai()
        extra = {k: PASSED_THROUGH[k] for k in ("chat_template_kwargs", "top_k")}
        sdk = {k: v for k, v in PASSED_THROUGH.items() if k not in extra}
        out = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=2,
                                                   extra_body=extra, **sdk)
        seen = (await h.mock_requests())[-1]["body"]
    assert out.choices[0].message.content == "Paris is"
    assert seen == {"model": UPSTREAM_MODEL, "messages": MESSAGES, "max_completion_tokens": 2, **PASSED_THROUGH}


async def test_langchain_style_streaming_keeps_its_stream_options(harness):
    """ChatOpenAI streams with ``stream_options: {"include_usage": true}``; vLLM's ``continuous_usage_stats``
    passes too."""
    async with harness() as h:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True, "n": 1, "temperature": 0.7,
                "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
        async with h.post("/v1/chat/completions", body) as resp:
            assert resp.status == 200
            raw = await resp.read()
        seen = (await h.mock_requests())[-1]["body"]
    assert seen == {**body, "model": UPSTREAM_MODEL}
    assert raw.count(b'"usage":{') == 1 and raw.endswith(b"data: [DONE]\n\n")


BAD_CHOICES = [("n", "2"), ("n", 0), ("n", True), ("n", 2.5), ("n", -1), ("n", 1025), ("n", 2**64 - 1), ("n", 1e300),
               ("best_of", "3"), ("best_of", [2]), ("best_of", {"n": 2})]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value", BAD_CHOICES)
async def test_a_number_of_choices_that_is_not_one_is_a_400_naming_it(harness, store, path, field, value):
    """vLLM would read ``"2"`` as two choices the hold counted as one; a count beyond 64 bits of tokens
    failed the PostgreSQL store's admission with a 500."""
    body = completion_body(**{field: value})
    if path.endswith("chat/completions"):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value}
    async with harness(overrides=store) as h:
        async with h.post(path, body) as resp:
            assert resp.status == 400, await resp.text()
            error = (await resp.json())["error"]
            gen = resp.headers["X-Neocloud-Generation-Id"]
        row = await h.row(gen)
        assert (await h.mock_requests()) == []
    assert (error["code"], error["param"], error["type"]) == ("invalid_request", field, "invalid_request_error")
    assert error["message"].startswith(f"`{field}` must be an integer from 1 to 1024, not ")
    assert (row["status"], row["error_code"]) == (400, "invalid_request")


@pytest.mark.parametrize("value", [None, 1, 2, 2.0])
async def test_a_number_of_choices_passes_as_sent(harness, value):
    async with harness() as h:
        async with h.post("/v1/completions", completion_body(n=value, best_of=value)) as resp:
            assert resp.status == 200
        seen = (await h.mock_requests())[-1]["body"]
    assert (seen["n"], seen["best_of"]) == (value, value) and type(seen["n"]) is type(value)
