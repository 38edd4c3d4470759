"""Request bodies that escape a lone surrogate, through a running gateway on a real port.

A model server that stops in the middle of an emoji answers half of it (``"\\ud83d"``); the gateway relays
that escape as sent, a Python client reads it, and the json module writes it back in the chat's next turn.
The gateway reads such a body as the json module does (orjson first, the json module only where orjson
refuses), rules and meters it as any other, and sends the escape upstream as the client sent it. What is
not JSON stays a 400.
"""

from __future__ import annotations

import json

import orjson
import pytest
from openai import AsyncStream
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kilnproxy.proxy.relay import event_json
from kilnproxy.testing import MODEL, UPSTREAM_MODEL

HALF = "\ud83d"  # the high half of U+1F600, alone
ESCAPE = b"\\ud83d"  # how JSON writes it
PROMPT, COMPLETION = 0.10 / 1e6, 0.30 / 1e6


def cost(prompt: int, completion: int) -> float:
    return round(prompt * PROMPT + completion * COMPLETION, 10)


def as_python_writes(body: dict) -> bytes:
    """``body`` as ``json.dumps`` writes it by default (requests, aiohttp and most Python clients): ASCII,
    each lone surrogate as its escape."""
    return json.dumps(body).encode()


def post_raw(h, path: str, raw: bytes, **headers: str):
    return h.session.post(f"{h.url}{path}", data=raw, headers={**h.headers(), "Content-Type": "application/json",
                                                                 **headers})


@pytest.mark.parametrize("stream", [False, True], ids=["not streamed", "streamed"])
async def test_a_chat_goes_on_after_an_answer_cut_in_the_middle_of_an_emoji(harness, stream):
    """Turn one (the openai SDK) ends in half an emoji; turn two sends that answer back. The SDK's
    ``create`` cannot write a lone surrogate itself (it encodes strict UTF-8), so turn two goes through the
    SDK's ``post`` with the body as the json module writes it."""
    async with harness() as h:
        client = h.openai()
        asked = [{"role": "user", "content": "Say hi"}]
        first = await client.chat.completions.create(model=MODEL, messages=asked, max_tokens=3,
                                                     extra_body={"mock": {"cut_emoji": True}})
        said = first.choices[0].message.content
        assert said == "Paris is " + HALF
        turn_two = {"model": MODEL, "max_tokens": 2, "stream": stream,
                    "messages": [*asked, {"role": "assistant", "content": said}, {"role": "user", "content": "Go on"}]}
        if stream:
            turn_two["stream_options"] = {"include_usage": True}
            events = await client.post("/chat/completions", content=as_python_writes(turn_two), stream=True,
                                       cast_to=ChatCompletion, stream_cls=AsyncStream[ChatCompletionChunk],
                                       options={"headers": {"Content-Type": "application/json"}})
            chunks = [c async for c in events]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].usage.completion_tokens == 2
        else:
            second = await client.post("/chat/completions", content=as_python_writes(turn_two),
                                       cast_to=ChatCompletion, options={"headers": {"Content-Type": "application/json"}})
            text = second.choices[0].message.content.strip()
            assert second.model == MODEL and second.usage.model_extra["cost"] == cost(19, 2)
        assert text.strip() == "Paris is"
        seen = (await h.mock_requests())[-1]["body"]
        rows = await h.rows()
    assert seen["messages"][1] == {"role": "assistant", "content": "Paris is " + HALF}  # the escape, intact
    assert seen["model"] == UPSTREAM_MODEL
    # the mock counts 4 tokens a message plus its words: 6 + 7 + 6
    assert [(r["status"], r["error_code"], r["prompt_tokens"], r["completion_tokens"], r["cost"]) for r in rows] == [
        (200, None, 6, 3, cost(6, 3)), (200, None, 19, 2, cost(19, 2))]


ENDPOINTS = {  # endpoint: (body, the mock's prompt tokens, completion tokens)
    "completions": ({"prompt": f"Paris is {HALF}", "max_tokens": 2}, 3, 2),
    "chat/completions": ({"messages": [{"role": "user", "content": f"Paris {HALF}"}], "max_tokens": 2}, 6, 2),
    "embeddings": ({"input": [f"Paris {HALF}", "ok"]}, 3, 0),
    "responses": ({"input": f"Paris {HALF}", "max_output_tokens": 2}, 2, 2),
    "messages": ({"messages": [{"role": "user", "content": f"Paris {HALF}"}], "max_tokens": 2}, 2, 2),
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_every_endpoint_reads_a_lone_surrogate_and_sends_it_on_intact(harness, store, endpoint):
    body, prompt, completion = ENDPOINTS[endpoint]
    sent = {"model": MODEL, **body, f"x_{HALF}": HALF}  # in a key too: forwarded untouched
    async with harness(overrides=store, configure=serving_every_endpoint) as h:
        async with post_raw(h, f"/v1/{endpoint}", as_python_writes(sent)) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            gen = resp.headers["X-Neocloud-Generation-Id"]
        seen = (await h.mock_requests())[-1]["body"]
        row = await h.row(gen)
    assert seen == {**sent, "model": UPSTREAM_MODEL}
    assert (row["endpoint"], row["status"], row["error_code"], row["prompt_tokens"], row["completion_tokens"],
            row["cost"]) == (endpoint, 200, None, prompt, completion, cost(prompt, completion))


async def test_a_token_count_reads_a_lone_surrogate(harness):
    sent = {"model": MODEL, "messages": [{"role": "user", "content": f"Paris is {HALF}"}]}
    async with harness(configure=serving_every_endpoint) as h:
        async with post_raw(h, "/v1/messages/count_tokens", as_python_writes(sent), **{"x-api-key": h.key}) as resp:
            assert resp.status == 200, await resp.text()
            assert await resp.json() == {"input_tokens": 3}
        seen = (await h.mock_requests())[-1]["body"]
        assert await h.rows() == []
    assert seen == {**sent, "model": UPSTREAM_MODEL}


def serving_every_endpoint(config: dict) -> None:
    config["models"][0]["endpoints"] = ["completions", "chat/completions", "embeddings", "responses", "messages"]


async def test_the_capture_and_the_access_log_keep_the_escape(harness, capsys):
    sent = {"model": MODEL, "prompt": f"Paris is {HALF}", "max_tokens": 2}
    async with harness(overrides={"inspector": {"capture": True}, "log": {"bodies": True}}) as h:
        async with post_raw(h, "/v1/completions", as_python_writes(sent)) as resp:
            assert resp.status == 200
            gen = resp.headers["X-Neocloud-Generation-Id"]
        async with h.session.get(f"{h.url}/ui/api/requests/{gen}") as resp:
            assert resp.status == 200
            capture = (await resp.json())["capture"]
        async with h.session.get(f"{h.url}/ui/api/requests/{gen}/fixture") as resp:
            assert resp.status == 200, await resp.text()
            fixture = await resp.read()
    assert json.loads(capture["client_body"]) == sent
    assert capture["upstream_body"].encode().count(ESCAPE) == 1
    assert json.loads(capture["upstream_body"]) == {**sent, "model": UPSTREAM_MODEL}
    assert json.loads(fixture)["request"]["body"]["prompt"] == f"Paris is {HALF}"
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if gen in line]
    assert line["body"]["prompt"] == f"Paris is {HALF}" and line["status"] == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
async def test_a_model_named_with_a_lone_surrogate_is_not_found(harness, store, path):
    """The error names the model with its escape; the row keeps U+FFFD in its place (neither store's text
    can hold a lone surrogate)."""
    sent = {"model": f"gpt{HALF}", "prompt": "hi", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    async with harness(overrides=store) as h:
        async with post_raw(h, path, as_python_writes(sent)) as resp:
            assert resp.status == 404
            raw = await resp.read()
            gen = resp.headers["X-Neocloud-Generation-Id"]
        row = await h.row(gen)
    message = f"The model `gpt{HALF}` does not exist or you do not have access to it."
    if path == "/v1/messages":
        assert json.loads(raw) == {"type": "error", "error": {"type": "not_found_error", "message": message}}
    else:
        assert json.loads(raw)["error"] == {"message": message, "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}
    assert raw.count(ESCAPE) == 1
    assert (row["status"], row["error_code"], row["model"]) == (404, "model_not_found", "gpt\ufffd")


NOT_JSON = [
    b'{"model": "test-model", "prompt": "\\ud83d",}',  # a trailing comma
    b'{"model": "test-model", "prompt": "\\ud83d", "max_tokens": NaN}',
    b'{"model": "test-model", "prompt": "\\ud83d", "max_tokens": 1e400}',
    b'{"model": "test-model", "prompt": "\\ud83d"',  # cut short
    b'{"model": "test-model", "prompt": "\\ud83d\xff"}',  # not UTF-8
    b'{"model": "test-model", "prompt": "\\ud83d\x01"}',  # a control character in a string
    b'{"model": "test-model", "prompt": "\\ud8"}',  # half an escape
]


@pytest.mark.parametrize("raw", NOT_JSON)
async def test_what_is_not_json_stays_a_400(harness, raw):
    async with harness() as h:
        async with post_raw(h, "/v1/completions", raw) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            gen = resp.headers["X-Neocloud-Generation-Id"]
        row = await h.row(gen)
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        expected = f"The request body is not valid JSON: {exc}"
    assert error == {"message": expected, "type": "invalid_request_error", "param": None, "code": "invalid_request"}
    assert (row["status"], row["error_code"]) == (400, "invalid_request")


async def test_a_body_orjson_reads_never_reaches_the_json_module(harness, monkeypatch):
    """The hot path stays orjson's: reading and writing a usual body calls neither fallback."""
    class Refused:
        def __getattr__(self, name):
            raise AssertionError(f"json.{name} was used")

    monkeypatch.setattr(event_json, "json", Refused())  # what the gateway's fallbacks read and write with
    async with harness(overrides={"inspector": {"capture": True}}) as h:
        for stream in (False, True):
            async with h.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "stream": stream,
                                                       "messages": [{"role": "user", "content": "hi 😀"}]}) as resp:
                assert resp.status == 200
                await resp.read()
        assert [r["status"] for r in await h.rows()] == [200, 200]
