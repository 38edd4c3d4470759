"""``EventRelay.feed_chunk`` (whole runs of unchanged events in one piece) gives exactly the bytes
and the record that parsing the same stream event by event gives, however the stream is cut."""

import orjson
import pytest

from kilnproxy.call import Call
from kilnproxy.config import ModelConfig, Pricing, ServerConfig
from kilnproxy.mock_upstream import _Generation
from kilnproxy.record import RequestRecord
from kilnproxy.relay import EventRelay, _plain_prefix
from kilnproxy.sse import SSEParser
from kilnproxy.upstream import Route

UPSTREAM_MODEL = "org/Test-Model-7B"


def relay_for(catalog_id: str, include_usage: bool, endpoint: str = "completions") -> EventRelay:
    route = Route(ModelConfig(catalog_id, ("http://127.0.0.1:1/v1",), UPSTREAM_MODEL,
                              pricing=Pricing(0.1, 0.3)), ServerConfig())
    call = Call("gen-test", "acme", "key", endpoint)
    call.model, call.stream, call.include_usage, call.pricing = catalog_id, True, include_usage, route.pricing
    return EventRelay(call, route, RequestRecord(call), ())


def run(relay: EventRelay, chunks: list[bytes], bulk: bool) -> tuple:
    parser = SSEParser()
    out = []
    for chunk in chunks:
        out.append(relay.feed_chunk(parser, chunk) if bulk else relay.feed(parser.feed(chunk)))
        if relay.ended:
            break
    else:
        out.append(relay.feed(parser.close()))
    out.append(relay.tail())
    rec = relay.record
    return (b"".join(out), rec.streamed_chunks, rec.finish_reason, rec.error_code, relay.ended, relay.clean_end,
            rec.usage)


def mock_stream(flavor: str, chat: bool, words: int = 40, **opts) -> bytes:
    body = {"model": UPSTREAM_MODEL, "prompt": "a b c", "stream": True, "stream_options": {"include_usage": True}}
    gen = _Generation(body, {"flavor": flavor, "delay": 0, "context_window": 4096, **opts}, chat, 3, words)
    frames = [b"data: " + orjson.dumps(f) + b"\n\n" for f in gen.frames()]
    return b"".join(frames) + b"data: [DONE]\n\n"


def cuts(stream: bytes) -> dict[str, list[bytes]]:
    return {
        "whole": [stream],
        "halves": [stream[:len(stream) // 2], stream[len(stream) // 2:]],
        "1500 bytes": [stream[i:i + 1500] for i in range(0, len(stream), 1500)],
        "1031 bytes": [stream[i:i + 1031] for i in range(0, len(stream), 1031)],
    }


def assert_same(stream: bytes, catalog_id: str, include_usage: bool, endpoint: str = "completions") -> None:
    for name, chunks in cuts(stream).items():
        bulk = run(relay_for(catalog_id, include_usage, endpoint), chunks, bulk=True)
        plain = run(relay_for(catalog_id, include_usage, endpoint), chunks, bulk=False)
        assert bulk == plain, name


@pytest.mark.parametrize("flavor", ["vllm", "vllm_old", "llamacpp", "ollama"])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("catalog_id", ["test-model", UPSTREAM_MODEL])
@pytest.mark.parametrize("include_usage", [False, True])
def test_mock_shapes_relay_the_same_in_bulk(flavor, chat, catalog_id, include_usage):
    stream = mock_stream(flavor, chat)
    assert_same(stream, catalog_id, include_usage, "chat/completions" if chat else "completions")


def test_a_vllm_stream_in_one_chunk_takes_the_bulk_path_up_to_its_finish_chunk():
    stream = mock_stream("vllm", False)
    end = _plain_prefix(stream)
    assert stream[end:].startswith(b'data: {"id"') and b'"finish_reason":"length"' in stream[end:].split(b"\n\n")[0]
    relay = relay_for("test-model", True)
    assert relay._unchanged(stream[:end], stream[:end].count(b"\n\n"))
    out = run(relay, [stream], bulk=True)
    assert out[0].count(b'"model":"test-model"') == 42 and UPSTREAM_MODEL.encode() not in out[0]
    assert out[1:3] == (41, "length")  # the 40 words and the finish chunk


def event(**fields) -> bytes:
    return b"data: " + orjson.dumps({"id": "x", "object": "text_completion", **fields}) + b"\n\n"


TEXT = {"choices": [{"index": 0, "text": " a", "finish_reason": None}]}
ODD_STREAMS = {
    "model twice in one event, none in the next":
        event(model=UPSTREAM_MODEL, extra={"model": UPSTREAM_MODEL}, **TEXT) + event(**TEXT) * 8,
    "catalog id already": event(model="test-model", **TEXT) * 8 + event(model=UPSTREAM_MODEL, **TEXT) * 8,
    "comment in between": event(model=UPSTREAM_MODEL, **TEXT) * 6 + b": ping\n\n" + event(model=UPSTREAM_MODEL, **TEXT) * 6,
    "two data lines": event(model=UPSTREAM_MODEL, **TEXT) * 6 + b"data: {\"a\":\ndata: 1}\n\n"
                      + event(model=UPSTREAM_MODEL, **TEXT) * 6,
    "no space after data:": (b"data:" + event(model=UPSTREAM_MODEL, **TEXT)[6:]) * 12,
    "CR line ends": event(model=UPSTREAM_MODEL, **TEXT).replace(b"\n", b"\r\n") * 12,
    "spaced finish_reason": (b'data: {"model": "org/Test-Model-7B", "choices": [{"text": " a", "finish_reason": null}]}\n\n'
                             * 10 + b'data: {"model": "org/Test-Model-7B", "choices": [{"text": "", '
                             b'"finish_reason": "stop"}]}\n\n'),
    "error mid-stream": event(model=UPSTREAM_MODEL, **TEXT) * 8 + b'data: {"error": {"message": "boom", "code": 500}}\n\n'
                        + event(model=UPSTREAM_MODEL, **TEXT) * 4,
    "event: and id: fields": (b"event: message\nid: 7\n" + event(model=UPSTREAM_MODEL, **TEXT)) * 10,
    "empty data": event(model=UPSTREAM_MODEL, **TEXT) * 8 + b"data: \n\n" + event(model=UPSTREAM_MODEL, **TEXT) * 8,
    "not JSON": event(model=UPSTREAM_MODEL, **TEXT) * 8 + b"data: hello\n\n" * 8,
}


@pytest.mark.parametrize("name", list(ODD_STREAMS))
@pytest.mark.parametrize("catalog_id", ["test-model", UPSTREAM_MODEL])
def test_odd_streams_relay_the_same_in_bulk(name, catalog_id):
    assert_same(ODD_STREAMS[name] + b"data: [DONE]\n\n", catalog_id, include_usage=True)
