"""Leftovers of the Responses API, Anthropic Messages and embeddings, through a running gateway on a real
port, driven by the official SDKs or raw HTTP: what the client gets, byte for byte where it matters, and
the usage row.

- a lone surrogate escape (half an emoji: a server that cuts a code point between two tokens, or stops
  in the middle of one) is JSON like any other, streamed or not: read, ruled (model, usage, cost, errors)
  and written back with the escape as the upstream sent it, as on the completion endpoints;
"""

from __future__ import annotations

import array
import asyncio
import json
from contextlib import asynccontextmanager

import anthropic
import openai
import orjson
import pytest
from aiohttp import web
from rawhttp import raw_server, read_request
from test_json_odd_upstreams import answering, http
from test_streaming import raw_upstream

from kilnproxy import hookimpl
from kilnproxy.testing import MODEL

PROMPT, COMPLETION = 0.10 / 1e6, 0.30 / 1e6
HIGH, LOW = "\\ud83d", "\\ude00"  # the two halves of U+1F600, as a JSON escape each


def cost(prompt: int, completion: int) -> float:
    return round(prompt * PROMPT + completion * COMPLETION, 10)


def lone(data: bytes) -> bytes:
    """``data`` with each ``"HIGH"``/``"LOW"`` written as the escape of that lone surrogate."""
    return data.replace(b"<HIGH>", HIGH.encode()).replace(b"<LOW>", LOW.encode())


def event(kind: str, **data) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + lone(orjson.dumps({"type": kind, **data})) + b"\n\n"


def row_of(row: dict) -> tuple:
    return (row["endpoint"], row["status"], row["error_code"], row["finish_reason"], row["prompt_tokens"],
            row["completion_tokens"], row["cost"])


def serving(url: str, endpoint: str):
    return lambda config: config["models"][0].update(upstreams=[url], endpoints=[endpoint])


def claude(h) -> anthropic.AsyncAnthropic:
    client = anthropic.AsyncAnthropic(base_url=h.url, api_key=h.key, max_retries=0)
    h._clients.append(client)
    return client


# -- 1. a lone surrogate escape ------------------------------------------------------------------------------


def response(status: str, text: str | None, usage: dict | None) -> dict:
    output = [] if text is None else [{"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                                       "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": status, "model": "org/Up-7B",
            "output": output, "usage": usage}


USAGE = {"input_tokens": 2, "output_tokens": 2, "total_tokens": 4}
CUT_TEXT = "Hi <HIGH>"  # max_output_tokens stopped the answer in the middle of an emoji


def responses_stream(final: dict) -> list[bytes]:
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    return [event("response.created", sequence_number=0, response=response("in_progress", None, None)),
            event("response.output_item.added", sequence_number=1, output_index=0, item=item),
            event("response.output_text.delta", sequence_number=2, item_id="msg_1", output_index=0, content_index=0,
                  delta="Hi "),
            event("response.output_text.delta", sequence_number=3, item_id="msg_1", output_index=0, content_index=0,
                  delta="<HIGH>"),
            event("response.output_text.done", sequence_number=4, item_id="msg_1", output_index=0, content_index=0,
                  text=CUT_TEXT),
            event("response.completed", sequence_number=5, response=final)]


async def test_a_responses_stream_cut_in_the_middle_of_an_emoji_ends_as_the_upstream_ended_it(harness):
    """``response.completed`` holds the text with its lone surrogate, the model and the usage: it is read (usage,
    status), renamed, priced, and the stream ends there, as the SDK expects, with no error of the gateway's."""
    frames = responses_stream(response("completed", CUT_TEXT, USAGE))
    async with raw_upstream(stream=b"".join(frames)) as url:
        async with harness(configure=serving(url, "responses")) as h:
            async with h.post("/v1/responses", {"model": MODEL, "input": "hi", "stream": True}) as resp:
                assert resp.status == 200
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
            stream = await h.openai().responses.create(model=MODEL, input="hi", stream=True)
            events = [e async for e in stream]
    final = {**response("completed", CUT_TEXT, {**USAGE, "cost": cost(2, 2)}), "model": MODEL}
    renamed = {**response("in_progress", None, None), "model": MODEL}
    head, completed = raw.rsplit(b"data: ", 1)
    assert head + b"data: " == b"".join([event("response.created", sequence_number=0, response=renamed), *frames[1:5],
                                         b"event: response.completed\ndata: "])
    assert json.loads(completed) == json.loads(lone(orjson.dumps({"type": "response.completed", "sequence_number": 5,
                                                                   "response": final})))
    assert completed.count(HIGH.encode()) == 1 and completed.endswith(b"}\n\n")
    assert row_of(row) == ("responses", 200, None, "completed", 2, 2, cost(2, 2))
    assert [e.type for e in events][-1] == "response.completed"
    assert events[-1].response.output_text == "Hi \ud83d"
    assert events[-1].response.usage.model_extra["cost"] == cost(2, 2)


MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "org/Up-7B", "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}


def messages_stream(*texts: str) -> list[bytes]:
    return [event("message_start", message=MESSAGE),
            event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            *[event("content_block_delta", index=0, delta={"type": "text_delta", "text": t}) for t in texts]]


MESSAGES_END = [event("content_block_stop", index=0),
                event("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                      usage={"output_tokens": 3}),
                event("message_stop")]


async def test_an_anthropic_error_event_with_a_lone_surrogate_ends_the_stream_as_the_upstreams_error(harness):
    """The upstream's error names the half character it choked on: it is the stream's end, with its own type as
    the row's error code, and no second error of the gateway's after it."""
    error = event("error", error={"type": "overloaded_error", "message": "cannot decode <LOW>"})
    frames = messages_stream("Hi", "<HIGH>") + [error]
    async with raw_upstream(stream=b"".join(frames)) as url:
        async with harness(configure=serving(url, "messages")) as h:
            body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with h.post("/v1/messages", body) as resp:
                assert resp.status == 200
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
            with pytest.raises(anthropic.APIStatusError) as caught:
                async with claude(h).messages.stream(model=MODEL, max_tokens=9,
                                                      messages=[{"role": "user", "content": "hi"}]) as stream:
                    async for _ in stream:
                        pass
    start = event("message_start", message={**MESSAGE, "model": MODEL})
    assert raw == start + b"".join(frames[1:])
    assert (row["status"], row["error_code"], row["prompt_tokens"], row["completion_tokens"]) == \
        (200, "overloaded_error", 3, 2)
    assert caught.value.body["error"] == {"type": "overloaded_error", "message": "cannot decode \ude00"}


SEEN: list = []


class SeesTexts:
    @hookimpl
    def transform_event(self, event):
        delta = event.get("delta")
        if event.get("type") == "content_block_delta":
            SEEN.append(delta["text"])


async def test_a_plugin_sees_the_messages_events_with_a_lone_surrogate(harness):
    SEEN.clear()
    frames = messages_stream("Hi", "<HIGH>", "<LOW>") + MESSAGES_END
    async with raw_upstream(stream=b"".join(frames)) as url:
        async with harness(configure=serving(url, "messages"), plugins=[SeesTexts()]) as h:
            async with claude(h).messages.stream(model=MODEL, max_tokens=9,
                                                  messages=[{"role": "user", "content": "hi"}]) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            row = (await h.rows())[0]
    assert SEEN == ["Hi", "\ud83d", "\ude00"]
    assert text == "Hi\ud83d\ude00" and final.usage.output_tokens == 3
    assert row_of(row) == ("messages", 200, None, "end_turn", 3, 3, cost(3, 3))


JSON_ANSWERS = {
    "messages": ({**MESSAGE, "content": [{"type": "text", "text": CUT_TEXT}], "stop_reason": "max_tokens",
                  "usage": {"input_tokens": 3, "output_tokens": 2}},
                 {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, ("max_tokens", 3, 2)),
    "responses": (response("completed", CUT_TEXT, USAGE), {"input": "hi"}, ("completed", 2, 2)),
    "completions": ({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "org/Up-7B",
                     "choices": [{"index": 0, "text": CUT_TEXT, "logprobs": None, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}},
                    {"prompt": "hi"}, ("length", 2, 2)),
}


class Tags:
    @hookimpl
    def transform_response(self, body):
        body["x_tagged"] = True


@pytest.mark.parametrize("plugins", [[], [Tags()]], ids=["no plugin", "a transform_response plugin"])
@pytest.mark.parametrize("endpoint", list(JSON_ANSWERS))
async def test_a_json_answer_with_a_lone_surrogate_is_relayed_and_metered(harness, endpoint, plugins):
    answer, body, (finish, prompt, completion) = JSON_ANSWERS[endpoint]
    async with answering(http(lone(orjson.dumps(answer)))) as url:
        async with harness(configure=serving(url, endpoint), plugins=plugins) as h:
            async with h.post(f"/v1/{endpoint}", {"model": MODEL, **body}) as resp:
                assert resp.status == 200, await resp.text()
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    expected = {**answer, "model": MODEL, "usage": {**answer["usage"], "cost": cost(prompt, completion)},
                **({"x_tagged": True} if plugins else {})}
    assert json.loads(raw) == json.loads(lone(orjson.dumps(expected)))  # floats as the json module writes them
    assert raw.count(HIGH.encode()) == 1 and "\ufffd".encode() not in raw  # the escape as the upstream sent it
    assert row_of(row) == (endpoint, 200, None, finish, prompt, completion, cost(prompt, completion))


async def test_an_upstream_event_too_deep_to_write_back_ends_the_stream_blaming_no_plugin(harness):
    """orjson reads 1,024 levels and writes 254: a ``message_delta`` whose usage holds a vendor object nested 300
    deep cannot be written back. The stream ends with the upstream's fault, not a plugin's (none is loaded)."""
    deep = b'{"x":' * 300 + b"1" + b"}" * 300
    delta = event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 1, "x_vendor": 0})
    frames = messages_stream("Hi") + [delta.replace(b'"x_vendor":0', b'"x_vendor":' + deep), event("message_stop")]
    async with raw_upstream(stream=b"".join(frames)) as url:
        async with harness(configure=serving(url, "messages")) as h:
            body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with h.post("/v1/messages", body) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert raw == event("message_start", message={**MESSAGE, "model": MODEL}) + b"".join(frames[1:3]) + event(
        "error", error={"type": "api_error", "message": "The upstream sent an event nested deeper than the gateway "
                                                        "can write JSON back (254 levels)."})
    assert (row["status"], row["error_code"]) == (200, "upstream_bad_response")


# -- 2. embeddings: a batch's hold, and inputs that are not embeddings' -----------------------------------------


@asynccontextmanager
async def held_upstream(answer: dict):
    """An upstream that answers ``answer`` once ``release`` is set: (its URL, a queue of the bodies it got, release)."""
    entered: asyncio.Queue = asyncio.Queue()
    release = asyncio.Event()

    async def answer_it(request: web.Request) -> web.Response:
        entered.put_nowait(await request.json())
        await release.wait()
        return web.json_response(answer)
    app = web.Application()
    app.router.add_post("/v1/embeddings", answer_it)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1", entered, release
    finally:
        release.set()
        await runner.cleanup()


BATCH = ["a b c d e f g h"] * 64  # 8 tokens each: 512 in all, 32 times the context window of 16
EMBEDDED = {"object": "list", "model": "org/Up-7B", "usage": {"prompt_tokens": 512, "total_tokens": 512},
            "data": [{"object": "embedding", "index": i, "embedding": [0.5]} for i in range(64)]}


async def test_a_batch_of_inputs_is_held_for_each_input_up_to_the_context_window(harness):
    """A model's context window bounds each input, not the batch: 64 inputs of 8 tokens under a window of 16 may
    cost 512 prompt tokens. While such a batch is at the upstream, its hold (each input's bound, at most the
    window: 64 x 16 tokens) leaves an org with credits for 600 tokens nothing for a second request (402), which
    a hold of one window (16 tokens) let through; the batch is then charged the upstream's count."""
    async with held_upstream(EMBEDDED) as (url, entered, release):
        def configure(config):
            config["models"][0].update(upstreams=[url], endpoints=["embeddings"], context_window=16)
            config["orgs"][0]["credits"] = 600 * PROMPT
        async with harness(configure=configure) as h:
            client = h.openai()
            batch = asyncio.create_task(client.embeddings.create(model=MODEL, input=BATCH, encoding_format="float"))
            await entered.get()
            second = asyncio.create_task(client.embeddings.create(model=MODEL, input="x", encoding_format="float"))
            reached = asyncio.create_task(entered.get())
            done, _ = await asyncio.wait({second, reached}, return_when=asyncio.FIRST_COMPLETED)
            release.set()
            assert second in done, "the second request reached the upstream"
            with pytest.raises(openai.APIStatusError) as caught:
                await second
            reached.cancel()
            assert caught.value.status_code == 402 and caught.value.body["code"] == "insufficient_credits"
            out = await batch
            assert len(out.data) == 64 and out.usage.prompt_tokens == 512
            rows = await h.rows()
    assert sorted((r["status"], r["prompt_tokens"], r["cost"]) for r in rows) == [(200, 512, cost(512, 0)),
                                                                                (402, 0, 0)]


BAD_INPUTS = [
    ("missing", None, "`input` is required: a string, a list of strings, a list of token ids, or a list of lists "
                      "of token ids."),
    ("a number", 5, "`input` must be a string, a list of strings, a list of token ids, or a list of lists of token "
                    "ids."),
    ("an empty string", "", "`input` must not be an empty string."),
    ("an empty list", [], "`input` must not be an empty list."),
    ("an empty string in a list", ["a", ""], "`input[1]` must not be an empty string."),
    ("an empty token list", [[1, 2], []], "`input[1]` must not be an empty list."),
    ("nested lists", [[["a"]]], "`input[0][0]` must be a token id (an integer from 0), not [\"a\"]."),
    ("an object in a list", [{"text": "a"}], "`input[0]` must be a string or a list of token ids."),
    ("token lists and strings mixed", [[1], "a"], "`input[1]` must be a list of token ids, as `input[0]` is."),
    ("strings and token ids mixed", ["a", 5], "`input[1]` must be a string, as `input[0]` is."),
    ("a float token", [1, 2.5], "`input[1]` must be a token id (an integer from 0), not 2.5."),
    ("a negative token", [[1], [3, -1]], "`input[1][1]` must be a token id (an integer from 0), not -1."),
    ("a boolean token", [True], "`input[0]` must be a token id (an integer from 0), not true."),
    ("a string among token ids", [[1, "2"]], "`input[0][1]` must be a token id (an integer from 0), not \"2\"."),
    ("null in a list", ["a", None], "`input[1]` must be a string, as `input[0]` is."),
]


@pytest.mark.parametrize("value, message", [(v, m) for _, v, m in BAD_INPUTS], ids=[i for i, _, _ in BAD_INPUTS])
async def test_inputs_that_are_not_embeddings_inputs_are_a_clear_400(harness, value, message):
    """OpenAI's rules for ``input``, checked by the gateway (model servers answer some with a 500, or embed an
    empty text): the SDK's BadRequestError in OpenAI's error form naming ``input``, one row, nothing upstream."""
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["embeddings"])) as h:
        with pytest.raises(openai.BadRequestError) as caught:
            await h.openai().embeddings.create(model=MODEL, input=value, encoding_format="float")
        assert caught.value.status_code == 400
        assert caught.value.body == {"message": message, "type": "invalid_request_error", "param": "input",
                                     "code": "invalid_request"}
        assert await h.mock_requests() == []
        assert [(r["endpoint"], r["status"], r["error_code"], r["cost"]) for r in await h.rows()] == [
            ("embeddings", 400, "invalid_request", 0)]


GOOD_INPUTS = {"a string": ("a b", 2), "strings": (["a b", "c"], 3), "token ids": ([1, 2, 3], 3),
               "lists of token ids": ([[1, 2], [3]], 3)}


@pytest.mark.parametrize("value, tokens", list(GOOD_INPUTS.values()), ids=list(GOOD_INPUTS))
async def test_every_form_of_input_is_embedded(harness, value, tokens):
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["embeddings"])) as h:
        out = await h.openai().embeddings.create(model=MODEL, input=value, encoding_format="float")
        assert len(out.data) == (len(value) if isinstance(value, list) and not isinstance(value[0], int) else 1)
        assert out.usage.prompt_tokens == tokens


@pytest.mark.parametrize("field, value, message", [
    ("encoding_format", "int8", '`encoding_format` must be "float" or "base64".'),
    ("dimensions", 0, "`dimensions` must be an integer from 1."),
    ("dimensions", "8", "`dimensions` must be an integer from 1."),
])
async def test_an_encoding_or_dimensions_openai_refuses_is_a_clear_400(harness, field, value, message):
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["embeddings"])) as h:
        with pytest.raises(openai.BadRequestError) as caught:
            await h.openai().embeddings.create(model=MODEL, input="a", **{field: value})
        assert caught.value.body == {"message": message, "type": "invalid_request_error", "param": field,
                                     "code": "invalid_request"}
        assert await h.mock_requests() == []


# -- 3. SDK-visible edges of the framed streams -------------------------------------------------------------------


GATEWAY_CLOSED = {"type": "api_error", "message": "The upstream closed the stream before it finished."}


@pytest.mark.parametrize("cut", [b"", b"event: content_block_delta\n",
                                 b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"del'],
                         ids=["at a frame's end", "after an event line", "in the middle of the JSON"])
async def test_a_messages_stream_cut_short_ends_with_the_error_event_alone(harness, cut):
    """The upstream's body ends before ``message_stop``, perhaps in the middle of an event: what was cut off is
    not sent (the SDK would fail on it with a JSONDecodeError of its own, never reaching the error event), and
    the stream ends with the gateway's error event, which the SDK raises as an APIStatusError."""
    frames = messages_stream("Hi", " there")
    async with raw_upstream(stream=b"".join(frames) + cut) as url:
        async with harness(configure=serving(url, "messages")) as h:
            body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with h.post("/v1/messages", body) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
            texts = []
            with pytest.raises(anthropic.APIStatusError) as caught:
                async with claude(h).messages.stream(model=MODEL, max_tokens=9,
                                                      messages=[{"role": "user", "content": "hi"}]) as stream:
                    async for text in stream.text_stream:
                        texts.append(text)
    start = event("message_start", message={**MESSAGE, "model": MODEL})
    assert raw == start + b"".join(frames[1:]) + event("error", error=GATEWAY_CLOSED)
    assert (row["status"], row["error_code"], row["prompt_tokens"], row["completion_tokens"]) == \
        (200, "upstream_error", 3, 2)
    assert texts == ["Hi", " there"] and caught.value.body == {"type": "error", "error": GATEWAY_CLOSED}


async def test_a_timeout_on_messages_is_anthropics_timeout_error_before_and_during_the_stream(harness):
    """Anthropic names a 504 ``timeout_error`` (its SDK's GatewayTimeoutError body); the gateway's
    ``request_timeout`` passing before the answer and mid-stream says so in both places."""
    def configure(config):
        config["models"][0].update(endpoints=["messages"], request_timeout=0.3)
    async with harness(configure=configure) as h:
        client = claude(h)
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(anthropic.APIStatusError) as caught:
            await client.messages.create(model=MODEL, max_tokens=5, messages=messages,
                                         extra_body={"mock": {"fail": "hang"}})
        assert caught.value.status_code == 504
        assert caught.value.body == {"type": "error", "error": {
            "type": "timeout_error", "message": "Model `test-model`: the request took longer than request_timeout "
                                                "(0.3 s)."}}
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with client.messages.stream(model=MODEL, max_tokens=500, messages=messages,
                                              extra_body={"mock": {"delay": 0.02}}) as stream:
                async for _ in stream:
                    pass
        assert caught.value.body == {"type": "error", "error": {
            "type": "timeout_error", "message": "The request took longer than the model's request_timeout."}}
        assert [(r["status"], r["error_code"]) for r in await h.rows()] == [(504, "upstream_timeout"),
                                                                            (200, "upstream_timeout")]


async def test_the_sdks_default_base64_embeddings_come_back_as_the_same_vectors(harness):
    """The openai SDK asks for base64 unless told otherwise, and decodes it: the mock answers as the model
    servers do, and the gateway relays the strings untouched (float32: the floats as float32 rounds them)."""
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["embeddings"])) as h:
        client = h.openai()
        floats = await client.embeddings.create(model=MODEL, input=["a b", "c"], encoding_format="float")
        raw = await client.embeddings.create(model=MODEL, input=["a b", "c"], encoding_format="base64")
        decoded = await client.embeddings.create(model=MODEL, input=["a b", "c"])
    assert all(isinstance(d.embedding, str) for d in raw.data)
    assert [d.embedding for d in decoded.data] == [array.array("f", e.embedding).tolist() for e in floats.data]
    assert decoded.usage.prompt_tokens == 3 and decoded.usage.model_extra["cost"] == cost(3, 0)


@asynccontextmanager
async def stalling_upstream(frames: bytes):
    """An upstream that streams ``frames`` and then nothing more, its body unfinished, until the gateway hangs
    up (``hung_up`` is then set): its URL and that event."""
    hung_up = asyncio.Event()

    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n" % len(frames) + frames + b"\r\n")
        await writer.drain()
        await reader.read()  # until the gateway closes its end
        hung_up.set()
        writer.close()
    async with raw_server(serve) as url:
        yield url, hung_up


class Recorded:
    """Each committed row, as ``record_usage`` sees it (awaited, not polled)."""

    def __init__(self):
        self.rows: asyncio.Queue = asyncio.Queue()

    @hookimpl
    def record_usage(self, usage):
        self.rows.put_nowait(dict(usage))


def reasoning_stream() -> bytes:
    item = {"id": "rs_1", "type": "reasoning", "summary": [], "content": []}
    call = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "pick", "arguments": ""}
    deltas = [("response.reasoning_text.delta", {"item_id": "rs_1", "output_index": 0, "content_index": 0,
                                                 "delta": d}) for d in ("Let", " me", " think")]
    deltas += [("response.function_call_arguments.delta", {"item_id": "fc_1", "output_index": 1, "delta": d})
               for d in ('{"a"', ": 1}")]
    deltas += [("response.output_text.delta", {"item_id": "msg_1", "output_index": 2, "content_index": 0,
                                               "delta": "Done"})]
    frames = [event("response.created", sequence_number=0, response=response("in_progress", None, None)),
              event("response.output_item.added", sequence_number=1, output_index=0, item=item)]
    frames += [event(kind, sequence_number=2 + i, **data) for i, (kind, data) in enumerate(deltas[:3])]
    frames += [event("response.output_item.added", sequence_number=5, output_index=1, item=call)]
    frames += [event(kind, sequence_number=6 + i, **data) for i, (kind, data) in enumerate(deltas[3:])]
    return b"".join(frames)


async def test_a_client_leaving_a_responses_stream_pays_for_reasoning_and_tool_call_deltas_too(harness):
    """No ``response.completed`` reached the gateway: the output is counted from the deltas the client got, each a
    token, whatever the output (reasoning, a function call's arguments, text), as a Messages stream counts its
    thinking and tool input deltas. One row, disconnected, and the upstream hung up on."""
    stream = reasoning_stream()
    recorded = Recorded()
    async with stalling_upstream(stream) as (url, hung_up):
        async with harness(configure=serving(url, "responses"), plugins=[recorded]) as h:
            async with h.post("/v1/responses", {"model": MODEL, "input": "a b c d", "stream": True}) as resp:
                got = b""
                while not got.endswith(b'"delta":"Done"}\n\n'):
                    got += await resp.content.readany()
            await hung_up.wait()
            row = await recorded.rows.get()
    assert got.replace(b'"model":"test-model"', b'"model":"org/Up-7B"') == stream
    assert (row["status"], row["disconnected"], row["prompt_tokens"], row["completion_tokens"]) == (200, 1, 2, 6)


OPENAI_ERROR = b'data: {"error":{"message":"engine died","type":"server_error","param":null,"code":"engine_dead"}}\n\n'
OLD_VLLM_ERROR = b'data: {"object":"error","message":"engine died","type":"InternalServerError","code":503}\n\n'


@pytest.mark.parametrize("error, code, kind", [(OPENAI_ERROR, "engine_dead", "api_error"),
                                               (OLD_VLLM_ERROR, "upstream_error", "overloaded_error")],
                         ids=["OpenAI's error object", "vLLM's older flat error"])
async def test_an_openai_shaped_error_mid_messages_stream_is_anthropics_error_event(harness, error, code, kind):
    """A server (or a proxy before it) that fails mid-stream in OpenAI's form, in a frame with no ``event:``
    line: the Anthropic SDK skips such a frame, so the client is told in Anthropic's own error event (its type
    by the upstream's numeric code, as for a status), the stream ends there, and the row keeps the code."""
    frames = messages_stream("Hi")
    async with raw_upstream(stream=b"".join(frames) + error + MESSAGES_END[-1]) as url:
        async with harness(configure=serving(url, "messages")) as h:
            body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with h.post("/v1/messages", body) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
            with pytest.raises(anthropic.APIStatusError) as caught:
                async with claude(h).messages.stream(model=MODEL, max_tokens=9,
                                                      messages=[{"role": "user", "content": "hi"}]) as stream:
                    async for _ in stream:
                        pass
    translated = {"type": kind, "message": "engine died"}
    start = event("message_start", message={**MESSAGE, "model": MODEL})
    assert raw == start + b"".join(frames[1:]) + event("error", error=translated)
    assert caught.value.body == {"type": "error", "error": translated}
    assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, code, 1)


async def test_an_openai_shaped_error_mid_responses_stream_is_the_responses_error_event(harness):
    frames = responses_stream(response("completed", CUT_TEXT, USAGE))[:3]
    async with raw_upstream(stream=b"".join(frames) + OPENAI_ERROR + frames[-1]) as url:
        async with harness(configure=serving(url, "responses")) as h:
            async with h.post("/v1/responses", {"model": MODEL, "input": "hi", "stream": True}) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
            events = [e async for e in await h.openai().responses.create(model=MODEL, input="hi", stream=True)]
    renamed = {**response("in_progress", None, None), "model": MODEL}
    assert raw == event("response.created", sequence_number=0, response=renamed) + b"".join(frames[1:]) + event(
        "error", code="engine_dead", message="engine died", param=None, sequence_number=3)
    assert [e.type for e in events][-1] == "error" and (events[-1].code, events[-1].message) == \
        ("engine_dead", "engine died")
    assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, "engine_dead", 1)


# -- 4. the Responses API's stored conversations ------------------------------------------------------------------


@asynccontextmanager
async def holding(answers: dict[str, int]):
    """A vLLM-like Responses server keeping the responses named in ``answers`` (id -> tokens of its follow-up's
    answer); a follow-up to any other id gets vLLM's 404. Yields its URL and the ids it was asked about."""
    asked: list = []

    async def respond(request: web.Request) -> web.Response:
        body = await request.json()
        previous = body.get("previous_response_id")
        asked.append(previous)
        if previous is not None and previous not in answers:
            return web.json_response({"error": {"message": f"Response with id '{previous}' not found.",
                                                "type": "invalid_request_error", "param": "response_id",
                                                "code": 404}}, status=404)
        return web.json_response({**response("completed", "ok", USAGE), "id": f"resp_after_{previous}"})
    app = web.Application()
    app.router.add_post("/v1/responses", respond)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1", asked
    finally:
        await runner.cleanup()


async def test_a_follow_up_reaches_the_upstream_that_holds_its_previous_response(harness):
    """A model served by two upstreams, each keeping its own responses: a follow-up (``previous_response_id``)
    that the balancing sends to the other one gets its 404 and is sent on to the next upstream, as a 429 or 5xx
    would be, until one holds it; one row. A follow-up nobody holds ends as an upstream 404 does (502)."""
    async with holding({"resp_a": 2}) as (url_a, asked_a), holding({}) as (url_b, asked_b):
        def configure(config):
            config["models"][0].update(upstreams=[url_a, url_b], endpoints=["responses"])
        async with harness(configure=configure) as h:
            client = h.openai()
            ids = [(await client.responses.create(model=MODEL, input="more", previous_response_id="resp_a")).id
                   for _ in range(4)]  # the balancing takes each upstream first in turn
            with pytest.raises(openai.InternalServerError):
                await client.responses.create(model=MODEL, input="more", previous_response_id="resp_gone")
            fresh = await client.responses.create(model=MODEL, input="new")  # none to follow: answered at once
            rows = await h.rows()
    assert ids == ["resp_after_resp_a"] * 4 and fresh.id == "resp_after_None"
    assert asked_a.count("resp_a") == 4 and asked_b.count("resp_a") == 2
    assert asked_a.count("resp_gone") == asked_b.count("resp_gone") == 1
    assert asked_a.count(None) + asked_b.count(None) == 1
    assert [(r["status"], r["error_code"]) for r in rows] == [(200, None)] * 4 + [(502, "upstream_error"), (200, None)]


class FailsOnBoom:
    @hookimpl
    def transform_event(self, event):
        delta = event.get("delta")
        if isinstance(delta, dict) and delta.get("text") == " boom":
            raise RuntimeError("boom")


async def test_a_plugin_failing_mid_chunk_lets_the_events_it_passed_before_it_through(harness):
    """The whole stream arrives in one chunk; the plugin fails on its third delta: the events before it, which
    the plugins let through, reach the client before the error event, as on the completion endpoints; the row
    counts the deltas the client got."""
    frames = messages_stream("Hi", " there", " boom", " after") + MESSAGES_END
    async with raw_upstream(stream=b"".join(frames)) as url:
        async with harness(configure=serving(url, "messages"), plugins=[FailsOnBoom()]) as h:
            body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with h.post("/v1/messages", body) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    start = event("message_start", message={**MESSAGE, "model": MODEL})
    error = {"type": "api_error", "message": "Plugin 'FailsOnBoom' raised in transform_event: RuntimeError: boom"}
    assert raw == start + b"".join(frames[1:4]) + event("error", error=error)
    assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, "plugin_error", 2)


@asynccontextmanager
async def closing_early(frames: bytes):
    """An upstream that streams ``frames`` in a chunked body, then closes its connection without the chunk that
    ends the body (a server that crashed, or a proxy that dropped the connection, once the answer was sent)."""
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n" % len(frames) + frames + b"\r\n")
        await writer.drain()
        writer.close()
    async with raw_server(serve) as url:
        yield url


@pytest.mark.parametrize("endpoint", ["messages", "responses"])
async def test_a_connection_lost_after_the_last_event_ends_the_stream_as_finished(harness, endpoint):
    """The answer was whole (``message_stop``, ``response.completed``) when the upstream's connection was lost:
    the client gets it as it is, without an error event after the end (which an SDK raises, and a client
    retries, paying twice), and the row has no error."""
    if endpoint == "messages":
        frames = b"".join(messages_stream("Hi") + MESSAGES_END)
        body = {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
    else:
        frames = b"".join(responses_stream(response("completed", CUT_TEXT, USAGE)))
        body = {"input": "hi"}
    async with closing_early(frames) as url:
        async with harness(configure=serving(url, endpoint)) as h:
            async with h.post(f"/v1/{endpoint}", {"model": MODEL, "stream": True, **body}) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert b"event: error" not in raw and raw.count(b"\n\n") == frames.count(b"\n\n")
    assert (row["status"], row["error_code"]) == (200, None)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_a_failed_response_records_its_error_code_streamed_or_not(harness, stream):
    """A Responses answer whose ``status`` is ``failed`` carries its error in ``response.error``: the row takes its
    code (else ``upstream_error``) whether it came as the JSON answer or as ``response.failed``."""
    failed = {**response("failed", None, USAGE), "error": {"code": "server_error", "message": "the engine died"}}
    if stream:
        upstream = raw_upstream(stream=event("response.created", sequence_number=0, response=response(
            "in_progress", None, None)) + event("response.failed", sequence_number=1, response=failed))
    else:
        upstream = answering(http(orjson.dumps(failed)))
    async with upstream as url:
        async with harness(configure=serving(url, "responses")) as h:
            async with h.post("/v1/responses", {"model": MODEL, "input": "hi", "stream": stream}) as resp:
                assert resp.status == 200
                await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert (row["status"], row["error_code"], row["finish_reason"], row["prompt_tokens"]) == \
        (200, "server_error", "failed", 2)


async def test_an_openai_shaped_error_with_a_lone_surrogate_is_translated_too(harness):
    error = lone(b'data: {"error":{"message":"cannot decode <HIGH>","type":"server_error","code":"bad_token"}}\n\n')
    async with raw_upstream(stream=b"".join(messages_stream("Hi")) + error) as url:
        async with harness(configure=serving(url, "messages")) as h:
            body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with h.post("/v1/messages", body) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert raw.endswith(b"\n\n" + event("error", error={"type": "api_error", "message": "cannot decode <HIGH>"}))
    assert (row["status"], row["error_code"]) == (200, "bad_token")
