"""Streams of upstreams that bend the format, through a running gateway: what the client gets, byte for
byte, and the usage row. Each upstream sends its whole answer in one write (``raw_upstream``), so the
relay takes its events together, as it does from a fast server."""

import orjson
import pytest
from raw_upstreams import WHOLE_MESSAGES_STREAM, raw_upstream
from relays import DONE, END, HELLO, WORLD, frame, relayed, renamed, text_chunk, usage

from kilnproxy import DROP, hookimpl
from kilnproxy.proxy.relay.framed_relay import FramedRelay
from kilnproxy.proxy.relay.plain_relay import EventRelay
from kilnproxy.testing import MODEL, UPSTREAM_MODEL


TEXT = frame(HELLO) + frame(WORLD) + frame(END)


async def test_choices_that_are_not_a_list_beside_usage_are_relayed(harness):
    odd = {"id": "x", "model": UPSTREAM_MODEL, "choices": {"a": 1}, "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    raw, row = await relayed(harness, frame(HELLO) + frame(odd) + frame(END) + frame(usage(5, 3)) + DONE)
    assert raw == renamed(HELLO) + frame({**odd, "model": MODEL, "usage": None}) + renamed(END) + DONE
    assert (row["status"], row["error_code"], row["finish_reason"], row["prompt_tokens"],
            row["completion_tokens"]) == (200, None, "stop", 5, 3)


async def test_a_fault_of_the_relay_ends_the_stream_with_an_internal_error_event(harness, monkeypatch, caplog):
    def broken(self, chunk):
        raise RuntimeError("a bug")
    monkeypatch.setattr(EventRelay, "feed_chunk", broken)
    raw, row = await relayed(harness, TEXT + frame(usage(5, 3)) + DONE)
    assert raw == frame({"error": {"message": "The gateway failed unexpectedly; see its log.", "type": "server_error",
                                   "param": None, "code": "internal_error"}}) + DONE
    assert (row["status"], row["error_code"]) == (200, "internal_error")
    assert "unexpected error relaying the stream" in caplog.text and "RuntimeError: a bug" in caplog.text


async def test_an_event_of_several_data_lines_goes_out_as_several_data_lines(harness):
    first = orjson.dumps(HELLO)
    cut = first.index(b'"model"')
    raw, row = await relayed(harness, b"data: " + first[:cut] + b"\ndata: " + first[cut:] + b"\n\n"
                             + frame(END) + frame(usage(5, 3)) + DONE)
    renamed_first = orjson.dumps({**HELLO, "model": MODEL})
    assert raw == b"data: " + renamed_first[:cut] + b"\ndata: " + renamed_first[cut:] + b"\n\n" + renamed(END) + DONE
    assert (row["error_code"], row["finish_reason"], row["completion_tokens"]) == (None, "stop", 3)


async def test_an_event_cut_off_by_the_end_of_the_body_is_not_sent(harness):
    raw, row = await relayed(harness, frame(HELLO) + frame(WORLD) + b'data: {"id":"cmpl-1","obj')
    assert raw == renamed(HELLO) + renamed(WORLD) + frame(
        {"error": {"message": "The upstream closed the stream before it finished.", "type": "upstream_error",
                   "param": None, "code": "upstream_error"}}) + DONE
    assert (row["error_code"], row["completion_tokens"]) == ("upstream_error", 2)


@pytest.mark.parametrize("last", [b"data: [DONE]", b"data: [DONE]\n", orjson.dumps(usage(5, 3)).join((b"data: ", b"\n"))])
async def test_a_whole_last_event_without_its_blank_line_still_counts(harness, last):
    raw, row = await relayed(harness, TEXT + (frame(usage(5, 3)) if b"DONE" in last else b"") + last)
    assert raw == renamed(HELLO) + renamed(WORLD) + renamed(END) + DONE
    assert (row["error_code"], row["finish_reason"], row["prompt_tokens"], row["completion_tokens"]) == \
        (None, "stop", 5, 3)


def chat_chunk(delta: dict, finish: str | None = None) -> bytes:
    return frame({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": UPSTREAM_MODEL,
                  "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})


@pytest.mark.parametrize("role_chunk", [True, False])
async def test_a_chat_delta_that_names_the_role_and_carries_text_is_a_token(harness, role_chunk):
    """Ollama names the role in every delta: each is a token of the estimate (the upstream sent no usage);
    only a delta with the role and no text (vLLM's and llama.cpp's first) is not."""
    stream = chat_chunk({"role": "assistant", "content": ""}) if role_chunk else b""
    stream += b"".join(chat_chunk({"role": "assistant", "content": c}) for c in "ABC")
    stream += chat_chunk({"role": "assistant", "content": "D"}, "stop") + DONE
    raw, row = await relayed(harness, stream, path="/v1/chat/completions")
    assert raw.count(b"data: ") == 4 + role_chunk + 1
    assert row["completion_tokens"] == 4 and row["prompt_tokens"] > 0 and row["cost"] > 0


async def test_a_finish_reason_beside_another_choices_null_is_recorded(harness):
    """Two choices (``n``: 2) from an upstream that ends its body without ``[DONE]`` (llama.cpp): each
    finish chunk also names the other choice, unfinished."""
    def two(first: tuple, second: tuple) -> dict:
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": UPSTREAM_MODEL,
                "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": f} for i, t, f in (first, second)]}
    stream = frame(two((0, "a", None), (1, "b", None))) + frame(two((1, "c", "length"), (0, "d", None))) \
        + frame(two((0, "e", "stop"), (1, "", None)))
    raw, row = await relayed(harness, stream, {"n": 2})
    assert raw.endswith(frame({**two((0, "e", "stop"), (1, "", None)), "model": MODEL}) + DONE)
    assert (row["error_code"], row["finish_reason"]) == (None, "stop")


async def test_a_usage_chunk_sent_twice_is_counted_once(harness):
    raw, row = await relayed(harness, TEXT + frame(usage(5, 3)) + frame(usage(5, 3)) + DONE,
                             {"stream_options": {"include_usage": True}})
    assert orjson.loads(raw.split(b"\n\n")[-3][6:])["usage"]["completion_tokens"] == 3
    assert (row["prompt_tokens"], row["completion_tokens"], row["total_tokens"]) == (5, 3, 8)


async def test_error_null_on_every_chunk_is_no_error(harness):
    chunks = [{**c, "error": None} for c in (HELLO, WORLD, END)]
    raw, row = await relayed(harness, b"".join(map(frame, chunks)) + frame(usage(5, 3)) + DONE)
    assert raw == b"".join(renamed(c) for c in chunks) + DONE
    assert (row["error_code"], row["finish_reason"], row["completion_tokens"]) == (None, "stop", 3)


async def test_an_error_that_is_only_a_message_goes_out_in_openais_form(harness):
    raw, row = await relayed(harness, frame(HELLO) + frame({"error": "boom"}) + DONE)
    assert raw == renamed(HELLO) + frame({"error": {"message": "boom", "type": "upstream_error", "param": None,
                                                    "code": "upstream_error"}}) + DONE
    assert row["error_code"] == "upstream_error"


async def test_a_usage_that_is_not_an_object_never_reaches_the_client(harness):
    odd = {"model": UPSTREAM_MODEL, "choices": [], "usage": [5, 3]}
    raw, row = await relayed(harness, TEXT + frame(odd) + frame(usage(5, 3)) + DONE)
    assert raw == renamed(HELLO) + renamed(WORLD) + renamed(END) + DONE
    assert (row["prompt_tokens"], row["completion_tokens"]) == (5, 3)


async def test_done_with_a_trailing_space_ends_the_stream(harness):
    raw, row = await relayed(harness, TEXT + frame(usage(5, 3)) + b"data: [DONE] \n\n")
    assert raw == renamed(HELLO) + renamed(WORLD) + renamed(END) + DONE
    assert (row["error_code"], row["finish_reason"]) == (None, "stop")


class RaisesOnWorld:
    @hookimpl
    def transform_event(self, event):
        if event["choices"] and event["choices"][0]["text"] == " world":
            raise RuntimeError("boom")


async def test_events_a_plugin_let_through_go_out_before_its_error(harness):
    raw, row = await relayed(harness, TEXT + frame(usage(5, 3)) + DONE, plugins=[RaisesOnWorld()])
    events = raw.split(b"\n\n")
    assert events[0] + b"\n\n" == renamed(HELLO)
    assert orjson.loads(events[1][6:])["error"]["code"] == "plugin_error" and events[2:] == [b"data: [DONE]", b""]
    assert (row["error_code"], row["completion_tokens"]) == ("plugin_error", 2)  # the chunks the upstream sent so far


class DropsTheFinish:
    @hookimpl
    def transform_event(self, event):
        if event["choices"] and event["choices"][0]["finish_reason"]:
            return DROP


async def test_a_finish_chunk_a_plugin_dropped_still_ends_the_stream_normally(harness):
    """The upstream finished (its body ends without ``[DONE]``, as llama.cpp's does); the client does not
    see the finish chunk, and the stream is no upstream error."""
    raw, row = await relayed(harness, TEXT + frame(usage(5, 3)), plugins=[DropsTheFinish()])
    assert raw == renamed(HELLO) + renamed(WORLD) + DONE
    assert (row["error_code"], row["finish_reason"], row["completion_tokens"]) == (None, None, 3)


async def test_a_fault_of_the_messages_relay_ends_the_stream_with_its_error_event(harness, monkeypatch, caplog):
    def broken(self, chunk):
        raise RuntimeError("a bug")
    monkeypatch.setattr(FramedRelay, "feed_chunk", broken)
    async with raw_upstream(stream=WHOLE_MESSAGES_STREAM) as url:
        configure = lambda c: c["models"][0].update(upstreams=[url], endpoints=["completions", "messages"])  # noqa: E731
        async with harness(configure=configure) as h:
            body = {"model": MODEL, "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
            async with h.post("/v1/messages", body) as resp:
                assert resp.status == 200
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert raw == b'event: error\ndata: {"type":"error","error":{"type":"api_error",' \
                  b'"message":"The gateway failed unexpectedly; see its log."}}\n\n'
    assert (row["status"], row["error_code"]) == (200, "internal_error")
    assert "RuntimeError: a bug" in caplog.text


async def test_events_carry_the_catalog_id_when_it_is_the_upstream_model_too(harness):
    """A model whose catalog id is also the name sent upstream (the default, and every discovered model),
    served by a server that names its model otherwise (llama.cpp names its alias): every event is renamed."""
    chunks = [text_chunk(t, f, model="served-alias") for t, f in (("Hello", None), (" world", None), ("!", "stop"))] * 3
    stream = b"".join(map(frame, chunks)) + frame({**usage(5, 3), "model": "served-alias"}) + DONE
    async with raw_upstream(stream=stream) as url:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url], upstream_model=MODEL)) as h:
            async with h.post("/v1/completions", {"model": MODEL, "stream": True, "prompt": "hi"}) as resp:
                raw = await resp.read()
    assert raw == b"".join(renamed(c) for c in chunks) + DONE
