"""The streamed relay, each case through a running gateway on a real port, in front of a raw
upstream that sends the exact bytes: what the client gets, byte for byte, and the usage row.

- the model's name is replaced only at the event's top level, never in an object nested inside it, however
  the upstream orders its keys;
- an event orjson refuses that is still JSON (a lone surrogate escape: half an emoji) is read, ruled
  (usage, model, finish reason, errors) and written back like any other;
- a ``transform_event`` plugin that leaves the event no longer JSON is named alone, and an upstream event
  the gateway cannot write back blames no plugin.
"""

import asyncio
import logging
from contextlib import asynccontextmanager

import orjson
import pytest
from raw_upstreams import raw_upstream
from rawhttp import raw_server, read_request
from relays import DONE, END, HELLO, PLUGINS, WORLD, assert_same, cost, frame, relay_for, relayed as odd_relayed, renamed, run, text_chunk, usage

from kilnproxy import hookimpl
from kilnproxy.proxy.relay.plain_relay import EventRelay
from kilnproxy.testing import MODEL, UPSTREAM_MODEL


@asynccontextmanager
async def paced_upstream(stream: bytes):
    """An upstream that sends ``stream`` an event a write, a moment apart, as a model server streams."""
    async def serve(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
                     % len(stream))
        for i, event in enumerate(stream.split(b"\n\n")[:-1]):
            if i:
                await asyncio.sleep(0.01)
            writer.write(event + b"\n\n")
            await writer.drain()
        writer.close()
    async with raw_server(serve) as url:
        yield url


UPSTREAMS = {"in one write": raw_upstream, "an event a write": paced_upstream}


async def relayed(harness, stream: bytes, *, upstream: str = "in one write", body: dict | None = None,
                  path: str = "/v1/completions", plugins=(), model: dict | None = None) -> tuple[bytes, dict]:
    """``test_relay_odd_upstreams.relayed`` from one of ``UPSTREAMS``."""
    return await odd_relayed(harness, stream, body, path, plugins, upstream=UPSTREAMS[upstream], model=model)


def row_of(row: dict) -> tuple:
    return row["status"], row["error_code"], row["finish_reason"], row["prompt_tokens"], row["completion_tokens"]


# -- 1. the model's name, at the top level only ------------------------------------------------------------


def nested_first(text: str, finish: str | None = None, top: str = UPSTREAM_MODEL, nested: str = UPSTREAM_MODEL) -> dict:
    """A vendor's object naming a model before the event's own ``model``."""
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "x_meta": {"model": nested}, "model": top,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


NESTED_FIRST = [nested_first("Hello"), nested_first(" world"), nested_first(" again"), nested_first("!", "stop")]


@pytest.mark.parametrize("upstream", list(UPSTREAMS))
async def test_a_model_nested_before_the_events_own_is_left_as_the_upstream_sent_it(harness, upstream):
    raw, row = await relayed(harness, b"".join(map(frame, NESTED_FIRST)) + frame(usage(5, 3)) + DONE,
                             upstream=upstream)
    assert raw == b"".join(renamed(e) for e in NESTED_FIRST) + DONE
    assert raw.count(b'"x_meta":{"model":"org/Test-Model-7B"}') == 4
    assert row_of(row) == (200, None, "stop", 5, 3)


@pytest.mark.parametrize("upstream", list(UPSTREAMS))
async def test_a_server_naming_its_model_otherwise_is_renamed_beside_a_nested_catalog_id(harness, upstream):
    """The catalog id is the name sent upstream; the server names its model otherwise (llama.cpp's alias), and a
    nested object before it holds the catalog id: the event's own ``model`` still becomes the catalog id."""
    events = [nested_first(t, f, top="served-alias", nested=MODEL) for t, f in (("Hello", None), ("!", "stop"))]
    raw, row = await relayed(harness, b"".join(map(frame, events)) + frame({**usage(5, 3), "model": "served-alias"})
                             + DONE, upstream=upstream, model={"upstream_model": MODEL})
    assert raw == b"".join(renamed(e) for e in events) + DONE
    assert row_of(row) == (200, None, "stop", 5, 3)


def late(delta: dict, finish: str | None = None) -> dict:
    """A llama.cpp chat chunk: its ``model`` after its choices."""
    return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "created": 1, "id": "chatcmpl-1",
            "model": UPSTREAM_MODEL, "system_fingerprint": "b0-unknown", "object": "chat.completion.chunk"}


@pytest.mark.parametrize("upstream", list(UPSTREAMS))
async def test_a_model_nested_in_a_choice_before_a_late_top_level_model_is_left_as_sent(harness, upstream):
    """llama.cpp names the model after the choices; a tool call's vendor object before it names one too."""
    tool = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "pick", "arguments": "{}"},
            "x_route": {"model": UPSTREAM_MODEL}}
    events = [late({"role": "assistant", "content": None}), late({"content": "Hi"}), late({"tool_calls": [tool]}),
              late({"content": "!"}), late({}, "tool_calls")]
    stream = b"".join(map(frame, events)) + frame({**usage(5, 4), "object": "chat.completion.chunk"}) + DONE
    raw, row = await relayed(harness, stream, upstream=upstream, path="/v1/chat/completions")
    assert raw == b"".join(renamed(e) for e in events) + DONE
    assert raw.count(b'"x_route":{"model":"org/Test-Model-7B"}') == 1
    assert row_of(row) == (200, None, "tool_calls", 5, 4)


async def test_an_event_whose_only_model_is_nested_goes_out_as_sent(harness):
    """No top-level ``model`` to replace: nothing is renamed, the nested one left as the upstream sent it."""
    events = [{"id": "cmpl-1", "object": "text_completion", "created": 1,
               "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": f,
                            "x_meta": {"model": UPSTREAM_MODEL}}]}
              for t, f in (("Hello", None), (" world", None), ("!", "stop"))]
    stream = b"".join(map(frame, events))
    raw, row = await relayed(harness, stream + frame(usage(5, 3)) + DONE)
    assert raw == stream + DONE
    assert row_of(row) == (200, None, "stop", 5, 3)


ODD = {
    "a nested model before the event's own": b"".join(map(frame, NESTED_FIRST * 3)),
    "a nested catalog id before the event's own":
        b"".join(frame(nested_first(t, nested="test-model")) for t in " a b c d e f".split(" ")),
    "only a nested model": b"".join(frame({"id": "x", "choices": [{"index": 0, "text": t,
                                                                   "m": {"model": UPSTREAM_MODEL}}]})
                                    for t in " a b c d e f".split(" ")),
    "a late model, a nested one in a choice":
        b"".join(frame(late({"content": t, "x": {"model": UPSTREAM_MODEL}})) for t in " a b c d e f".split(" ")),
    "a late model, a brace in the text": b"".join(frame(late({"content": t})) for t in " a } {b } c".split(" ")),
    "a late model, a nested object after it": b"".join(frame({**late({"content": t}), "x": {"model": "y"}})
                                                        for t in " a b c d".split(" ")),
    "a key that ends in model": b"".join(b'data: {"x\\"model":"' + UPSTREAM_MODEL.encode() + b'","model":"'
                                         + UPSTREAM_MODEL.encode() + b'","choices":[]}\n\n' for _ in range(6)),
    "the usual events, then one with a nested model first":
        b"".join(frame(text_chunk(t)) for t in " a b c d".split(" ")) + frame(nested_first(" e"))
        + b"".join(frame(text_chunk(t)) for t in " f g h".split(" ")),
    "late models, then one with a nested model first":
        b"".join(frame(late({"content": t})) for t in " a b c".split(" "))
        + frame(late({"content": "d", "x": {"model": UPSTREAM_MODEL}})) + frame(late({"content": "e"})) * 3,
    "the catalog id, then the upstream's name, from the start and late":
        frame(text_chunk("a", model=MODEL)) + frame(text_chunk("b")) * 3
        + frame({**late({"content": "c"}), "model": MODEL}) + frame(late({"content": "d"})) * 3,
}


@pytest.mark.parametrize("name", list(ODD))
@pytest.mark.parametrize("catalog_id", ["test-model", UPSTREAM_MODEL])
def test_odd_model_names_relay_the_same_in_bulk(name, catalog_id):
    """The runs the relay takes whole give the bytes it gives event by event, however the stream is cut."""
    assert_same(ODD[name] + DONE, catalog_id, include_usage=True, seed=list(ODD).index(name))


def test_the_model_of_the_usual_events_is_renamed_without_parsing_them(monkeypatch):
    """vLLM names the model near the start, llama.cpp after the choices: either event, alone in its chunk,
    goes out renamed as its own bytes; only the finish chunk is parsed."""
    parsed = []
    parse = EventRelay._parsed_event
    monkeypatch.setattr(EventRelay, "_parsed_event",
                        lambda self, payload: parsed.append(payload) or parse(self, payload))
    for event in (text_chunk, lambda text, finish=None: late({"content": text}, finish)):
        parsed.clear()
        events = [frame(event(t)) for t in ("Hello", " world")] + [frame(event("!", "stop")), DONE]
        out = run(relay_for("test-model", False), events, bulk=True)[0]
        assert b"".join(out).count(b'"model":"test-model"') == 3 and UPSTREAM_MODEL.encode() not in b"".join(out)
        assert len(parsed) == 1 and b'"stop"' in parsed[0]


# -- 2. JSON that orjson refuses: a lone surrogate escape --------------------------------------------------


def lone(obj: dict, escape: bytes) -> bytes:
    """``frame(obj)`` with its string ``"LONE"`` written as the escape of a lone surrogate."""
    return frame(obj).replace(b'"LONE"', b'"' + escape + b'"')


HIGH, LOW = b"\\ud83d", b"\\ude00"  # the two halves of U+1F600, in two tokens
SPLIT_END = {**text_chunk("LONE", "stop"), "usage": usage(5, 3)["usage"]}  # llama.cpp: usage on the last chunk


@pytest.mark.parametrize("include_usage", [False, True])
async def test_an_event_with_a_lone_surrogate_is_ruled_like_any_other(harness, include_usage):
    """The last chunk holds the second half of an emoji split between two tokens, the finish reason and the
    usage: it is renamed, its usage taken (and sent only in the usage chunk), its finish reason recorded,
    and the escape written back as the upstream sent it. An event that is not JSON still goes out as sent."""
    stream = frame(HELLO) + lone(text_chunk("LONE"), HIGH) + b"data: not JSON {\n\n" + lone(SPLIT_END, LOW) + DONE
    raw, row = await relayed(harness, stream, body={"stream_options": {"include_usage": include_usage}})
    expected = renamed(HELLO) + lone({**text_chunk("LONE"), "model": MODEL}, HIGH) + b"data: not JSON {\n\n" \
        + lone({**SPLIT_END, "model": MODEL, "usage": None}, LOW)
    if include_usage:
        expected += frame({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL, "choices": [],
                           "usage": {**usage(5, 3)["usage"], "cost": cost(5, 3)}})
    assert raw == expected + DONE
    assert row_of(row) == (200, None, "stop", 5, 3) and row["cost"] == cost(5, 3)


async def test_an_error_event_with_a_lone_surrogate_ends_the_stream(harness):
    error = lone({"error": {"message": "LONE", "code": "bad_token"}}, b"\\udcff")  # half a pair, the low one
    raw, row = await relayed(harness, frame(HELLO) + error + frame(WORLD) + frame(END) + DONE)
    assert raw == renamed(HELLO) + error + DONE
    assert (row["status"], row["error_code"], row["finish_reason"]) == (200, "bad_token", None)


SEEN: list = []


class SeesTexts:
    @hookimpl
    def transform_event(self, event):
        SEEN.extend(choice.get("text") for choice in event["choices"])


async def test_a_plugin_sees_an_event_with_a_lone_surrogate(harness):
    SEEN.clear()
    stream = frame(HELLO) + lone(text_chunk("LONE"), HIGH) + lone(SPLIT_END, LOW) + DONE
    raw, row = await relayed(harness, stream, plugins=[SeesTexts()])
    assert raw == renamed(HELLO) + lone({**text_chunk("LONE"), "model": MODEL}, HIGH) \
        + lone({**SPLIT_END, "model": MODEL, "usage": None}, LOW) + DONE
    assert SEEN == ["Hello", "\ud83d", "\ude00"]
    assert row_of(row) == (200, None, "stop", 5, 3)


async def test_a_last_event_with_a_lone_surrogate_and_no_blank_line_counts(harness):
    """llama.cpp ends its body after the finish chunk, with no ``[DONE]``: that chunk is whole, and JSON."""
    last = lone(SPLIT_END, LOW)[:-2]
    raw, row = await relayed(harness, frame(HELLO) + lone(text_chunk("LONE"), HIGH) + last)
    assert raw == renamed(HELLO) + lone({**text_chunk("LONE"), "model": MODEL}, HIGH) \
        + lone({**SPLIT_END, "model": MODEL, "usage": None}, LOW) + DONE
    assert row_of(row) == (200, None, "stop", 5, 3)


# -- 3. who is named when an event can no longer be written ------------------------------------------------


class LeavesASet:
    @hookimpl
    def transform_event(self, event):
        if event["choices"] and event["choices"][0]["text"] == " world":
            event["x_seen"] = {1, 2}


class Reads:
    @hookimpl
    def transform_event(self, event):
        event.get("choices")


class AlsoReads(Reads):
    pass


def plugin_error(message: str) -> bytes:
    return frame({"error": {"message": message, "type": "server_error", "param": None, "code": "plugin_error"}})


def named(raw: bytes, before: bytes, reason: str) -> set[str]:
    """The plugins a stream's ``plugin_error`` event names (``raw``: ``before`` it, that event, then ``[DONE]``)."""
    assert raw.startswith(before) and raw.endswith(DONE)
    error = orjson.loads(raw[len(before) + len(b"data: "):-len(DONE)])["error"]
    assert (error["type"], error["code"]) == ("server_error", "plugin_error")
    head, tail = "Plugin '", f"' raised in transform_event: TypeError: the event is no longer JSON: {reason}"
    assert error["message"].startswith(head) and error["message"].endswith(tail), error["message"]
    return set(error["message"][len(head):-len(tail)].split(", "))


async def test_a_plugin_that_leaves_the_event_no_longer_json_is_named_alone(harness):
    raw, row = await relayed(harness, frame(HELLO) + frame(WORLD) + frame(END) + frame(usage(5, 3)) + DONE,
                             plugins=[LeavesASet()])
    assert raw == renamed(HELLO) + plugin_error("Plugin 'LeavesASet' raised in transform_event: TypeError: the "
                                                "event is no longer JSON: Type is not JSON serializable: set") + DONE
    assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, "plugin_error", 2)


@pytest.mark.parametrize("order", ["the culprit first", "the culprit last"])
async def test_with_several_plugins_those_that_saw_the_event_are_named(harness, order):
    """Which of them left it so is not known: telling would cost a write of every event after each plugin."""
    plugins = [LeavesASet(), Reads()] if order == "the culprit first" else [Reads(), LeavesASet()]
    raw, row = await relayed(harness, frame(HELLO) + frame(WORLD) + frame(END) + frame(usage(5, 3)) + DONE,
                             plugins=plugins)
    assert named(raw, renamed(HELLO), "Type is not JSON serializable: set") == {"LeavesASet", "Reads"}
    assert (row["status"], row["error_code"], row["completion_tokens"]) == (200, "plugin_error", 2)


class LeavesASetInTheUsageChunk:
    @hookimpl
    def transform_event(self, event):
        if not event["choices"]:
            event["x_seen"] = {1, 2}


async def test_plugins_that_spoil_the_usage_chunk_are_named(harness):
    raw, row = await relayed(harness, frame(HELLO) + frame(END) + frame(usage(5, 3)) + DONE,
                             body={"stream_options": {"include_usage": True}},
                             plugins=[Reads(), LeavesASetInTheUsageChunk(), AlsoReads()])
    assert named(raw, renamed(HELLO) + renamed(END), "Type is not JSON serializable: set") == {
        "Reads", "LeavesASetInTheUsageChunk", "AlsoReads"}
    assert row_of(row) == (200, "plugin_error", "stop", 5, 3)


def too_deep(obj: dict, depth: int = 300) -> bytes:
    """``frame(obj)`` with its string ``"DEEP"`` an object nested ``depth`` levels (orjson reads 1,024, writes 254)."""
    return frame(obj).replace(b'"DEEP"', b'{"a":' * depth + b"1" + b"}" * depth)


BAD_RESPONSE = frame({"error": {"message": "The upstream sent an event nested deeper than the gateway can write "
                                           "JSON back (254 levels).", "type": "upstream_error", "param": None,
                                "code": "upstream_bad_response"}})


@pytest.mark.parametrize("plugins", [(), (Reads,), (Reads, AlsoReads)], ids=["no plugin", "one plugin", "two plugins"])
async def test_an_upstream_event_too_deep_to_write_back_blames_no_plugin(harness, caplog, plugins):
    """The plugins were shown the event (it is JSON: orjson reads it), but the fault is the upstream's: the
    stream ends with an ``upstream_bad_response`` error event, no plugin named, no traceback."""
    caplog.set_level(logging.INFO)
    deep = too_deep({**END, "x_trace": "DEEP"})
    raw, row = await relayed(harness, frame(HELLO) + frame(WORLD) + deep + frame(usage(5, 3)) + DONE,
                             plugins=[p() for p in plugins])
    assert raw == renamed(HELLO) + renamed(WORLD) + BAD_RESPONSE + DONE
    assert row_of(row)[:3] == (200, "upstream_bad_response", None)
    assert row["completion_tokens"] == 3  # the chunks the upstream sent, the last one's too
    assert "Traceback" not in caplog.text and "plugin_error" not in caplog.text


def test_a_usage_chunk_too_deep_to_write_back_blames_no_plugin():
    """The upstream's usage object is nested too deep: its usage chunk cannot be written, with a plugin or not."""
    deep = too_deep({**usage(5, 3), "usage": {**usage(5, 3)["usage"], "x_details": "DEEP"}})
    stream = frame(HELLO) + frame(END) + deep + DONE
    for impls in ((), tuple(PLUGINS["no-op"]), tuple(PLUGINS["no-op"]) * 2):
        out = run(relay_for("test-model", True, impls=impls), [stream], bulk=True)
        assert b"".join(out[0]).endswith(BAD_RESPONSE + DONE) and out[3] == "upstream_bad_response"
