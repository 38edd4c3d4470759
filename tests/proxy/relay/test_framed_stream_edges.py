"""What SDK clients see of the Responses and Messages streams (framed: ``event:`` + ``data:``) when they end
otherwise than well, through a running gateway on a real port: an upstream cut short, timing out, failing in
OpenAI's form or losing its connection after the last event, a plugin failing mid-chunk, a client leaving.
Each: the bytes the client gets, what the official SDK raises, and the usage row.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import anthropic
import pytest
from framed_streams import CUT_TEXT, MESSAGE, MESSAGES_END, USAGE, claude, cost, event, failed_messages_stream, lone, messages_stream, response, responses_stream, serving
from raw_upstreams import raw_upstream
from rawhttp import raw_server, read_request

from kilnproxy import hookimpl
from kilnproxy.testing import MODEL


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
            raw, row, failed = await failed_messages_stream(h)
    translated = {"type": kind, "message": "engine died"}
    start = event("message_start", message={**MESSAGE, "model": MODEL})
    assert raw == start + b"".join(frames[1:]) + event("error", error=translated)
    assert failed.body == {"type": "error", "error": translated}
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


async def test_an_anthropic_error_event_without_its_event_line_gets_one(harness):
    """An upstream that writes Anthropic's error event as a bare ``data:`` frame: the Anthropic SDK only reads
    an error from a frame named ``error``, and skipped it (the stream then just ended, as if cut short with no
    error). The gateway names it, so the SDK raises it; the row keeps its type as the code."""
    error = b'data: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    async with raw_upstream(stream=b"".join(messages_stream("Hi")) + error) as url:
        async with harness(configure=serving(url, "messages")) as h:
            raw, row, failed = await failed_messages_stream(h)
    assert raw.endswith(b"\n\nevent: error\n" + error)
    assert failed.body == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert (row["status"], row["error_code"]) == (200, "overloaded_error")


async def test_a_zero_in_the_last_message_delta_does_not_erase_the_prompt_count(harness):
    """A server that fills every usage field of ``message_delta`` and has no count for the prompt there writes 0
    (as vLLM's converter does when a chunk carries no usage): a count reported before is kept, as zeros never
    replace counts on the completion endpoints. The client's ``cost`` is priced on the same counts."""
    end = [MESSAGES_END[0], event("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                                  usage={"input_tokens": 0, "output_tokens": 2}), MESSAGES_END[2]]
    async with raw_upstream(stream=b"".join(messages_stream("Hi", " there") + end)) as url:
        async with harness(configure=serving(url, "messages")) as h:
            async with claude(h).messages.stream(model=MODEL, max_tokens=9,
                                                  messages=[{"role": "user", "content": "hi"}]) as stream:
                deltas = [e for e in [e async for e in stream] if e.type == "message_delta"]
            row = (await h.rows())[0]
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (3, 2, cost(3, 2))
    assert deltas[0].usage.model_extra["cost"] == cost(3, 2)
