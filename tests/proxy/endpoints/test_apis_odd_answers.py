"""Odd answers on the Responses API and Anthropic Messages, through a running gateway on a real port in front of
an upstream that sends the exact bytes, driven by the official SDKs or raw HTTP: what the client gets, byte for
byte where it matters, and the usage row.

- a lone surrogate escape (half an emoji: a server that cuts a code point between two tokens, or stops in the
  middle of one) is JSON like any other, streamed or not: read, ruled (model, usage, cost, errors) and written
  back with the escape as the upstream sent it, as on the completion endpoints; an event too deep to write back
  ends the stream blaming no plugin;
- a Responses follow-up (``previous_response_id``) reaches the upstream that holds its previous response, and is
  held for a whole context window of prompt;
- a failed Responses answer records its error code, streamed or not; a background response is a clear 400;
- a token count is answered while every generation slot is busy.

The frames and the SDK helpers are tests/framed_streams.py's, the raw upstreams tests/raw_upstreams.py's.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import openai
import orjson
import pytest
from aiohttp import web
from framed_streams import CUT_TEXT, HIGH, MESSAGE, MESSAGES_END, PROMPT, USAGE, claude, cost, event, failed_messages_stream, lone, messages_stream, response, responses_stream, serving
from raw_upstreams import answering, http, raw_upstream

from kilnproxy import hookimpl
from kilnproxy.testing import MODEL


def row_of(row: dict) -> tuple:
    return (row["endpoint"], row["status"], row["error_code"], row["finish_reason"], row["prompt_tokens"],
            row["completion_tokens"], row["cost"])


# -- 1. a lone surrogate escape ------------------------------------------------------------------------------


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


async def test_an_anthropic_error_event_with_a_lone_surrogate_ends_the_stream_as_the_upstreams_error(harness):
    """The upstream's error names the half character it choked on: it is the stream's end, with its own type as
    the row's error code, and no second error of the gateway's after it."""
    error = event("error", error={"type": "overloaded_error", "message": "cannot decode <LOW>"})
    frames = messages_stream("Hi", "<HIGH>") + [error]
    async with raw_upstream(stream=b"".join(frames)) as url:
        async with harness(configure=serving(url, "messages")) as h:
            raw, row, failed = await failed_messages_stream(h)
    start = event("message_start", message={**MESSAGE, "model": MODEL})
    assert raw == start + b"".join(frames[1:])
    assert (row["status"], row["error_code"], row["prompt_tokens"], row["completion_tokens"]) == \
        (200, "overloaded_error", 3, 2)
    assert failed.body["error"] == {"type": "overloaded_error", "message": "cannot decode \ude00"}


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


# -- 2. the Responses API's stored conversations ------------------------------------------------------------------


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


async def test_a_follow_up_is_held_for_a_whole_context_window_of_prompt(harness):
    """A follow-up's prompt is the stored conversation the server prepends, up to the context window, not the
    few words it sends: with the first follow-up at the upstream (held: a window of 100 prompt tokens and 5 of
    output), an org with credits for 100 tokens has none left for a second request (402), which a hold of the
    body's own bound (68 tokens) let through."""
    entered: asyncio.Queue = asyncio.Queue()
    release = asyncio.Event()

    async def respond(request: web.Request) -> web.Response:
        entered.put_nowait(None)
        await release.wait()
        return web.json_response(response("completed", "ok", {"input_tokens": 90, "output_tokens": 5,
                                                               "total_tokens": 95}))
    app = web.Application()
    app.router.add_post("/v1/responses", respond)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"

    def configure(config):
        config["models"][0].update(upstreams=[url], endpoints=["responses"], context_window=100)
        config["orgs"][0]["credits"] = 100 * PROMPT
    try:
        async with harness(configure=configure) as h:
            client = h.openai()
            first = asyncio.create_task(client.responses.create(model=MODEL, input="more", max_output_tokens=5,
                                                                previous_response_id="resp_a"))
            await entered.get()
            second = asyncio.create_task(client.responses.create(model=MODEL, input="hi", max_output_tokens=5))
            reached = asyncio.create_task(entered.get())
            done, _ = await asyncio.wait({second, reached}, return_when=asyncio.FIRST_COMPLETED)
            release.set()
            assert second in done, "the second request reached the upstream"
            reached.cancel()
            with pytest.raises(openai.APIStatusError) as caught:
                await second
            assert caught.value.status_code == 402
            assert (await first).usage.input_tokens == 90
    finally:
        release.set()
        await runner.cleanup()


async def test_a_background_response_is_refused_as_a_clear_400(harness):
    """``background: true`` answers at once (``queued``, no usage) and leaves the model generating for a client that
    would fetch the result from ``GET /v1/responses/{id}``, which the gateway does not serve: the answer could never
    be read through it, nor metered. Refused before the upstream, in OpenAI's form; ``false`` is the default."""
    async with harness(configure=lambda c: c["models"][0].update(endpoints=["responses"])) as h:
        client = h.openai()
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="hi", max_output_tokens=3, background=True)
        assert caught.value.body == {
            "message": "`background` responses are not supported: the gateway does not serve GET "
                       "/v1/responses/{id}, where their answer is read.",
            "type": "invalid_request_error", "param": "background", "code": "unsupported_parameter"}
        out = await client.responses.create(model=MODEL, input="hi", max_output_tokens=3, background=False)
        assert out.output_text == "Paris is the"
        assert [(r["status"], r["error_code"]) for r in await h.rows()] == [(400, "unsupported_parameter"),
                                                                            (200, None)]
        assert len(await h.mock_requests()) == 1


async def test_a_token_count_is_answered_while_every_generation_slot_is_busy(harness):
    """``max_in_flight`` counts a server's generation slots (llama.cpp's ``--parallel``); counting tokens takes
    none. A coding agent asks for counts while its answer streams: with the upstream's one slot busy, the count is
    still forwarded and answered (it was a 503 ``overloaded_error`` at once), and the stream is not disturbed."""
    def configure(config):
        model = config["models"][0]
        model.update(endpoints=["messages"], upstreams=[{"url": model["upstreams"][0], "max_in_flight": 1}])
    async with harness(configure=configure) as h:
        client = claude(h)
        messages = [{"role": "user", "content": "a b c"}]
        async with client.messages.stream(model=MODEL, max_tokens=6, messages=messages,
                                          extra_body={"mock": {"delay": 0.05}}) as stream:
            texts = []
            async for text in stream.text_stream:
                if not texts:
                    counted = await client.messages.count_tokens(model=MODEL, messages=messages)
                texts.append(text)
        assert counted.input_tokens == 3 and len(texts) == 6
        rows = await h.rows()
    assert [(r["endpoint"], r["status"], r["error_code"]) for r in rows] == [("messages", 200, None)]
