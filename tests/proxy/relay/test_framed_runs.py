"""The framed relay's runs (Responses API, Anthropic Messages): frames that hold nothing the gateway reads go
out as the upstream's bytes, found a chunk at a time with a few bytes operations; the frames that hold a marker
(the model, usage, an error, the end) are read. What must hold whatever the chunk boundaries: a marker or a
delta cut across two chunks, an error frame among plain ones, extra blank lines, the event count that an error
event of ours continues.
"""

from __future__ import annotations

import json

import orjson
import pytest
from framed_streams import MESSAGES_END, claude, event, messages_stream, responses_stream, serving
from raw_upstreams import raw_upstream

from kilnproxy.config import Pricing
from kilnproxy.call import Call
from kilnproxy.proxy.relay.framed_relay import FramedRelay
from kilnproxy.proxy.request_record import RequestRecord
from kilnproxy.testing import MODEL


def sse_events(raw: bytes) -> list[tuple[str | None, dict]]:
    """``raw`` as an SSE client reads it: each dispatched event's name and its data as JSON (a blank line with
    no data before it dispatches nothing and forgets the name)."""
    events, name, data = [], None, []
    for line in raw.split(b"\n"):
        if not line:
            if data:
                events.append((name, json.loads(b"\n".join(data))))  # json: a lone surrogate is JSON too
            name, data = None, []
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
    return events


async def test_a_frame_the_gateway_reads_keeps_its_event_name_when_an_extra_blank_line_follows_it(harness):
    """Some servers end each event with two blank lines. A frame the gateway rewrites (here ``message_start``,
    ``message_delta`` and ``message_stop``) at the end of a chunk then came with a newline after its data:
    it was written back with a blank line between its ``event:`` and ``data:`` lines, which an SSE client
    reads as a nameless event, and the Anthropic SDK skips (it never saw ``message_stop``)."""
    frames = messages_stream("Hi", " there") + MESSAGES_END
    async with raw_upstream(stream=b"\n".join(frames) + b"\n") as url:
        async with harness(configure=serving(url, "messages")) as h:
            body = {"model": MODEL, "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with h.post("/v1/messages", body) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
            async with claude(h).messages.stream(model=MODEL, max_tokens=9,
                                                  messages=[{"role": "user", "content": "hi"}]) as stream:
                seen = [e.type async for e in stream]
    names = ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
             "content_block_stop", "message_delta", "message_stop"]
    assert [(name, data["type"]) for name, data in sse_events(raw)] == [(n, n) for n in names]
    assert sse_events(raw)[0][1]["message"]["model"] == MODEL and "cost" in sse_events(raw)[5][1]["usage"]
    assert seen[0] == "message_start" and seen[-1] == "message_stop"
    assert (row["status"], row["error_code"], row["prompt_tokens"], row["completion_tokens"]) == (200, None, 3, 3)


async def test_a_responses_stream_whose_last_event_names_no_model_nor_usage_ends_there(harness):
    """The Responses API's end is read from the event's ``response`` object, whatever it holds: a
    ``response.completed`` without ``model`` and ``usage`` (an upstream that reports neither) ended the
    answer, and the gateway added its "closed before it finished" error after it."""
    final = {"id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "output": []}
    frames = responses_stream(final)
    async with raw_upstream(stream=b"".join(frames)) as url:
        async with harness(configure=serving(url, "responses")) as h:
            body = {"model": MODEL, "input": "hi", "stream": True}
            async with h.post("/v1/responses", body) as resp:
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert raw.endswith(frames[-1]) and [name for name, _ in sse_events(raw)][-1] == "response.completed"
    assert (row["status"], row["error_code"], row["finish_reason"], row["completion_tokens"]) == \
        (200, None, "completed", 2)


# -- the relay alone, at every chunk boundary ------------------------------------------------------------------


def relay(endpoint: str) -> tuple[FramedRelay, RequestRecord]:
    call = Call("gen-1", "acme", "key-1", endpoint, lambda name: {}, model="catalog-model",
                pricing=Pricing(0.10, 0.30, None))
    record = RequestRecord(call)
    return FramedRelay(call, record, ()), record


def response(status: str, usage: dict | None) -> dict:
    return {"id": "resp_1", "object": "response", "status": status, "model": "org/Up-7B", "usage": usage}


def delta(i: int, text: str) -> bytes:
    return event("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0, delta=text,
                 sequence_number=i)


DELTAS = [delta(1 + i, t) for i, t in enumerate(["Paris", " is", " the", " capital"])]
USAGE = {"input_tokens": 5, "output_tokens": 4, "total_tokens": 9}


def through(endpoint: str, chunks: list[bytes]) -> tuple[bytes, FramedRelay, RequestRecord]:
    r, record = relay(endpoint)
    out = []
    for chunk in chunks:
        out.append(r.feed_chunk(chunk))
        if r.ended:
            break
    out.append(r.close())
    return b"".join(out), r, record


def every_cut(stream: bytes):
    """``stream`` whole, then cut in two at every byte, then in three around each byte."""
    yield [stream]
    for cut in range(1, len(stream)):
        yield [stream[:cut], stream[cut:]]
    for cut in range(1, len(stream) - 1):
        yield [stream[:cut], stream[cut:cut + 1], stream[cut + 1:]]


def test_a_marker_and_a_delta_cut_across_chunks_read_and_count_as_whole():
    """The final frame's ``"usage"`` and ``"model"``, and every delta's ``.delta"``, may be cut by a chunk's
    edge: each is found in the chunk that completes its frame, so the bytes, the usage and the count are the
    same at every cut (a search run over each chunk as it came would miss them)."""
    stream = (event("response.created", response=response("in_progress", None), sequence_number=0)
              + b"".join(DELTAS)
              + event("response.completed", response=response("completed", USAGE), sequence_number=5))
    expected, _, _ = through("responses", [stream])
    assert expected.count(b'"model":"catalog-model"') == 2 and b'"cost":' in expected
    for chunks in every_cut(stream):
        out, r, record = through("responses", chunks)
        assert out == expected, chunks
        assert (record.streamed_chunks, record.usage.completion_tokens, record.finish_reason, r.sequence) == \
            (4, 4, "completed", 6), chunks


def test_the_deltas_a_client_got_are_counted_at_every_cut_before_the_final_count():
    """No final usage: the row bills what was streamed, each delta once whatever chunk it came in, with the
    prompt counts of ``message_start`` (Messages)."""
    stream = b"".join(messages_stream("Hi", " there", " you"))
    for chunks in every_cut(stream):
        out, r, record = through("messages", chunks)
        assert (record.streamed_chunks, record.usage.prompt_tokens, record.usage.completion_tokens) == (3, 3, 3)
        assert not r.finished and out.count(b"event: content_block_delta\n") == 3, chunks


@pytest.mark.parametrize("error", [
    b'data: {"error": {"message": "engine died", "code": "engine_dead"}}\n\n',
    b'event: response.output_text.delta\ndata: {"object": "error", "message": "engine died", "code": "engine_dead"}\n\n',
], ids=["OpenAI's form", "vLLM's flat object"])
def test_an_error_frame_among_plain_frames_ends_the_stream_where_it_stands(error):
    """Among plain frames in one chunk, the upstream's error in OpenAI's form is the format's own error event,
    numbered after the events before it; the frames before it go out, the ones after it do not, and only the
    deltas before it count."""
    stream = (event("response.created", response=response("in_progress", None), sequence_number=0)
              + b"".join(DELTAS[:2]) + error + b"".join(DELTAS[2:]))
    told = event("error", code="engine_dead", message="engine died", param=None, sequence_number=3)
    renamed = event("response.created", response={**response("in_progress", None), "model": "catalog-model"},
                    sequence_number=0)
    for chunks in every_cut(stream):
        out, r, record = through("responses", chunks)
        if not r.ended:  # cut inside the error frame: it is not whole until the next chunk
            continue
        assert out == renamed + b"".join(DELTAS[:2]) + told, chunks
        assert (record.error_code, record.streamed_chunks, r.finished) == ("engine_dead", 2, True), chunks


@pytest.mark.parametrize("per_event", [False, True], ids=["one chunk", "a chunk per event"])
@pytest.mark.parametrize("finished", [False, True], ids=["cut short", "after the last event"])
def test_an_error_event_of_ours_continues_the_upstreams_count(per_event, finished):
    """The events passed as they came are counted (``sequence``) however they came, a long run of them too,
    and the chunk that ends the answer's (counted only when the number is asked): the gateway's error event
    after them carries the next number."""
    frames = [event("response.created", response=response("in_progress", None), sequence_number=0),
              b": a comment\n\n", *[delta(1 + i, " word") for i in range(40)]]
    if finished:
        frames.append(event("response.completed", response=response("completed", USAGE), sequence_number=41))
    r, record = relay("responses")
    for chunk in (frames if per_event else [b"".join(frames)]):
        r.feed_chunk(chunk)
    told = orjson.loads(r.error_frame("The upstream closed the stream before it finished.", "upstream_error")
                        .split(b"data: ", 1)[1])
    events = 42 if finished else 41
    assert told["sequence_number"] == events and r.sequence == events and record.streamed_chunks == 40
    assert r.finished is finished


@pytest.mark.parametrize("endpoint,foreign", [("responses", b'"message_stop"'), ("responses", b'"model"'),
                                              ("responses", b'"usage"'), ("messages", b'"response.incomplete"')])
def test_what_a_formats_rules_do_not_read_goes_out_as_it_came(endpoint, foreign):
    """Each format's frames are read for what its own rules read: a frame holding only the other format's end
    (``message_stop`` on the Responses API, ``response.incomplete`` on Messages), or on the Responses API a
    ``model`` or ``usage`` outside a ``response`` object, goes out byte for byte (not written back by orjson)."""
    odd = b'event: odd\ndata: {"type": "odd", "note": ' + foreign + b'}\n\n'
    out, r, _ = through(endpoint, [odd])
    assert out == odd and not r.finished
