"""The relay of the streams that keep their ``event:`` framing (Responses API, Anthropic Messages):
the same bytes and the same usage whatever the chunk boundaries, text deltas passed as they came."""

import asyncio

import orjson
import pytest

from kilnproxy.config import Pricing
from kilnproxy.call import Call
from kilnproxy.plugins.manager import Impl
from kilnproxy.proxy.relay.framed_relay import FramedRelay
from kilnproxy.proxy.request_record import RequestRecord
from kilnproxy.proxy.relay.errors import StreamPluginError


def frame(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


RESPONSE = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "org/Up-7B", "usage": None}
DONE = {**RESPONSE, "status": "completed",
        "usage": {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8,
                  "input_tokens_details": {"cached_tokens": 0}}}
DELTAS = [frame("response.output_text.delta", {"item_id": "msg_1", "delta": word, "sequence_number": i + 2})
          for i, word in enumerate(["Paris", " is", ' "the error" usage model'])]  # markers inside text: escaped
RESPONSES = (frame("response.created", {"response": RESPONSE, "sequence_number": 0})
             + b": a comment\n\n"
             + frame("response.in_progress", {"response": RESPONSE, "sequence_number": 1})
             + b"".join(DELTAS)
             + frame("response.completed", {"response": DONE, "sequence_number": 5}))


def relay() -> tuple[FramedRelay, RequestRecord]:
    call = Call("gen-1", "acme", "key-1", "responses", lambda name: {}, model="catalog-model",
                pricing=Pricing(0.10, 0.30, None))
    record = RequestRecord(call)
    return FramedRelay(call, record, ()), record


def test_deltas_pass_as_they_came_and_the_rest_is_renamed_and_priced():
    r, record = relay()
    out = r.feed_chunk(RESPONSES) + r.close()
    for delta in DELTAS:
        assert delta in out  # byte for byte
    assert b'"model":"org/Up-7B"' not in out and out.count(b'"model":"catalog-model"') == 3
    assert b": a comment\n\n" in out and b"[DONE]" not in out
    completed = orjson.loads(out.rsplit(b"data: ", 1)[1])
    assert completed["response"]["usage"]["cost"] == pytest.approx((5 * 0.10 + 3 * 0.30) / 1e6)
    assert (record.usage.prompt_tokens, record.usage.completion_tokens) == (5, 3)
    assert record.streamed_chunks == 3 and r.finished and record.finish_reason == "completed"


def test_every_chunk_boundary_gives_the_same_bytes_and_counts():
    whole, whole_record = relay()
    expected = whole.feed_chunk(RESPONSES) + whole.close()
    for cut in range(1, len(RESPONSES)):
        r, record = relay()
        got = r.feed_chunk(RESPONSES[:cut]) + r.feed_chunk(RESPONSES[cut:]) + r.close()
        assert got == expected, cut
        assert (record.streamed_chunks, record.usage.prompt_tokens, record.usage.completion_tokens,
                r.sequence) == (whole_record.streamed_chunks, 5, 3, whole.sequence), cut


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError])
def test_a_plugin_raising_a_base_exception_is_its_stream_error(exc):
    def transform_event(event):
        raise exc("boom")

    call = Call("gen-1", "acme", "key-1", "responses", lambda name: {}, model="catalog-model",
                pricing=Pricing(0.10, 0.30, None))
    r = FramedRelay(call, RequestRecord(call), (Impl("boomer", "transform_event", transform_event, ("event",)),))
    with pytest.raises(StreamPluginError) as err:
        r.feed_chunk(RESPONSES)
    assert err.value.error.message == f"Plugin 'boomer' raised in transform_event: {exc.__name__}: boom"
