"""``EventRelay.feed_chunk`` (whole runs of unchanged events in one piece) gives exactly the bytes
and the record that parsing the same stream event by event gives, however the stream is cut:
every flavor of the mock upstream and odd streams, each cut in fixed ways, at every byte, and at
random (seeded, so that a failure names a cut that can be replayed)."""

import random
from pathlib import Path

import orjson
import pytest
from relays import PLUGINS, assert_same, cuts, relay_for, run

from kilnproxy.mock_servers.mock_upstream import Generation
from kilnproxy.proxy.relay.plain_scanner import PlainRun, _common_ends
from kilnproxy.testing import UPSTREAM_MODEL
from kilnproxy.proxy.relay.plain_relay import EventRelay


def mock_stream(flavor: str, chat: bool, words: int = 40, **opts) -> bytes:
    body = {"model": UPSTREAM_MODEL, "prompt": "a b c", "stream": True, "stream_options": {"include_usage": True}}
    gen = Generation(body, {"flavor": flavor, "delay": 0, "context_window": 4096, **opts}, chat, 3, words)
    frames = [b"data: " + orjson.dumps(f) + b"\n\n" for f in gen.frames()]
    return b"".join(frames) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("flavor", ["vllm", "vllm_old", "llamacpp", "ollama"])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("catalog_id", ["test-model", UPSTREAM_MODEL])
@pytest.mark.parametrize("include_usage", [False, True])
def test_mock_shapes_relay_the_same_in_bulk(flavor, chat, catalog_id, include_usage):
    stream = mock_stream(flavor, chat)
    assert_same(stream, catalog_id, include_usage, "chat/completions" if chat else "completions")


SHORT = {
    "vllm": lambda: mock_stream("vllm", True, words=3),
    "llamacpp": lambda: mock_stream("llamacpp", True, words=3),
    "comments, one inside an event": lambda: (
        b": ping\n\n" + event(model=UPSTREAM_MODEL, **TEXT) * 2 + event(model=UPSTREAM_MODEL, **TEXT)[:-1]
        + b": inside\n\n" + event(model=UPSTREAM_MODEL, **TEXT) + b"data: [DONE]\n\n"),
    "a comment after [DONE]": lambda: event(model=UPSTREAM_MODEL, **TEXT) * 2 + b"data: [DONE]\n\n: after\n\n",
}


@pytest.mark.parametrize("short", list(SHORT))
@pytest.mark.parametrize("catalog_id", ["test-model", UPSTREAM_MODEL])
def test_a_short_stream_cut_in_two_at_every_byte_relays_the_same(short, catalog_id):
    stream = SHORT[short]()
    for at in range(1, len(stream)):
        chunks = [stream[:at], stream[at:]]
        bulk = run(relay_for(catalog_id, True, "chat/completions"), chunks, bulk=True)
        assert bulk == run(relay_for(catalog_id, True, "chat/completions"), chunks, bulk=False), at


def test_a_vllm_stream_in_one_chunk_is_checked_whole_up_to_its_finish_chunk():
    """Its 40 word chunks go out after one check of the run; only the last three events are parsed."""
    stream = mock_stream("vllm", False)
    seen = []

    class Seen(EventRelay):
        def feed_data(self, payloads):
            seen.extend(payloads)
            return super().feed_data(payloads)

        def _feed_marked(self, payloads):  # the last events, set apart: read without _event's tests
            seen.extend(payloads)
            return super()._feed_marked(payloads)

    base = relay_for("test-model", True)
    relay = Seen(base.call, base.names, base.record, ())
    relay.feed_chunk(stream)
    assert len(seen) == 3 and b'"finish_reason":"length"' in seen[0] and seen[2] == b"[DONE]"
    words = b"\n\n".join(stream.split(b"\n\n")[:40]) + b"\n\n"
    assert PlainRun(relay.names.upstream_model_bytes, relay.names.model_bytes).count(words) == 40
    out = run(relay_for("test-model", True), [stream], bulk=True)
    assert b"".join(out[0]).count(b'"model":"test-model"') == 42 and UPSTREAM_MODEL.encode() not in b"".join(out[0])
    assert out[1:3] == (41, "length")  # the 40 words and the finish chunk


def event(**fields) -> bytes:
    return b"data: " + orjson.dumps({"id": "x", "object": "text_completion", **fields}) + b"\n\n"


TEXT = {"choices": [{"index": 0, "text": " a", "finish_reason": None}]}


def late(text: str = " a") -> bytes:
    """An event that names the model after its text, as llama.cpp's do."""
    return (b'data: {"choices":[{"text":' + orjson.dumps(text) + b',"finish_reason":null}],"model":"'
            + UPSTREAM_MODEL.encode() + b'","id":"x"}\n\n')


LATE_END = late()[late().index(b'"model"'):]  # how every late() event ends
ODD_STREAMS = {
    "model twice in one event, none in the next":
        event(model=UPSTREAM_MODEL, extra={"model": UPSTREAM_MODEL}, **TEXT) + event(**TEXT) * 8,
    "catalog id already": event(model="test-model", **TEXT) * 8 + event(model=UPSTREAM_MODEL, **TEXT) * 8,
    "model twice in one event": event(model=UPSTREAM_MODEL, **TEXT) * 4
        + event(model=UPSTREAM_MODEL, extra={"model": UPSTREAM_MODEL}, **TEXT) + event(model=UPSTREAM_MODEL, **TEXT) * 4,
    "catalog id inside an event": event(model=UPSTREAM_MODEL, **TEXT) * 4
        + event(model=UPSTREAM_MODEL, extra={"model": "test-model"}, **TEXT) + event(model=UPSTREAM_MODEL, **TEXT) * 4,
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
    "CR line ends only": event(model=UPSTREAM_MODEL, **TEXT).replace(b"\n", b"\r") * 12,
    "model last": late() * 6 + late(" b") * 6 + late('say "usage"') + late() * 3,
    "model last, an id: line that ends as the events do": late() * 6 + b"id: 1," + LATE_END + late() * 6,
    "model last, two data lines": late() * 6 + late()[:-2].replace(b',"model"', b'\ndata: ,"model"') + b"\n\n"
                                  + late() * 6,
    "model last, comment in between": late() * 6 + b": ping\n\n" + late() * 6,
    "usage null on every event, as OpenAI's": event(model=UPSTREAM_MODEL, usage=None, **TEXT) * 12,
    "usage null, then counts mid-stream": event(model=UPSTREAM_MODEL, usage=None, **TEXT) * 6
        + event(model=UPSTREAM_MODEL, usage={"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}, **TEXT)
        + event(model=UPSTREAM_MODEL, usage=None, **TEXT) * 6,
    "usage null and usage counts in one event": event(model=UPSTREAM_MODEL, usage=None, **TEXT) * 6
        + event(model=UPSTREAM_MODEL, usage=None, x={"usage": {"prompt_tokens": 1}}, **TEXT)
        + event(model=UPSTREAM_MODEL, usage=None, **TEXT) * 6,
    # the frames of a run (PlainRun._by_frames): what differs between events is a token's text
    "tokens that are markers": b"".join(event(model=UPSTREAM_MODEL, choices=[{"index": 0, "text": t, "finish_reason": None}])
                                        for t in [" a", " b", "error", " c", "usage", "finish_reason", " d", "role", " e"]),
    "tokens that are model names": b"".join(event(model=UPSTREAM_MODEL, choices=[{"index": 0, "text": t}])
                                            for t in [" a", " b", "test-model", " c", UPSTREAM_MODEL, " d"]),
    "tokens that hold frame edges": b"".join(event(model=UPSTREAM_MODEL, choices=[{"index": 0, "text": t}])
                                             for t in [" a", ",", "},{", '","model":"x', "{", " b"]),
    "an event of another shape mid-run": event(model=UPSTREAM_MODEL, **TEXT) * 5
        + event(**TEXT, model=UPSTREAM_MODEL, created=1) + event(model=UPSTREAM_MODEL, **TEXT) * 5,
    "the model in a text, once": event(model=UPSTREAM_MODEL, **TEXT) * 3
        + event(choices=[{"index": 0, "text": '"model":"' + UPSTREAM_MODEL + '"'}]) + event(model=UPSTREAM_MODEL, **TEXT) * 3,
    "no model, texts": b"".join(event(choices=[{"index": 0, "text": t}]) for t in " a b c d e f".split(" ")),
    "usage null in the middle only": b"".join(event(model=UPSTREAM_MODEL, choices=[{"index": 0, "text": t}], usage=None, x=t)
                                              for t in " a b c d e".split(" ")),
    # what a bug hunt sent: each has a test through the gateway in test_relay_odd_upstreams.py
    "choices not a list, beside usage": event(model=UPSTREAM_MODEL, **TEXT) * 4
        + event(model=UPSTREAM_MODEL, choices={"a": 1}, usage={"prompt_tokens": 5, "completion_tokens": 3})
        + event(model=UPSTREAM_MODEL, **TEXT) * 4,
    "error null on every event": event(model=UPSTREAM_MODEL, error=None, **TEXT) * 12,
    "two choices, a finish reason beside a null": event(model=UPSTREAM_MODEL, **TEXT) * 6 + event(
        model=UPSTREAM_MODEL, choices=[{"index": 0, "text": " a", "finish_reason": "stop"},
                                       {"index": 1, "text": " b", "finish_reason": None}]) * 2
        + event(model=UPSTREAM_MODEL, **TEXT) * 4,
    "a usage chunk twice": event(model=UPSTREAM_MODEL, **TEXT) * 6
        + event(model=UPSTREAM_MODEL, choices=[], usage={"prompt_tokens": 5, "completion_tokens": 3}) * 2,
    "usage not an object": event(model=UPSTREAM_MODEL, **TEXT) * 6 + event(model=UPSTREAM_MODEL, choices=[], usage=[5, 3]),
    "[DONE] with a trailing space": event(model=UPSTREAM_MODEL, **TEXT) * 6 + b"data: [DONE] \n\n",
    "a model the server names otherwise": event(model="served-alias", **TEXT) * 12,
}


def test_a_run_of_like_events_is_shown_plain_by_its_frames():
    """A vLLM run: the frames taken from its first two events, one split; the same bytes as a
    rename of the whole run."""
    stream = mock_stream("vllm", False)
    words = b"\n\n".join(stream.split(b"\n\n")[:40]) + b"\n\n"
    plain = PlainRun(b'"model":"' + UPSTREAM_MODEL.encode() + b'"', b'"model":"test-model"')
    assert plain._by_frames(words) is not None
    assert plain.prefix.startswith(b'{"id":') and plain.prefix.endswith(b",") and plain.suffix.endswith(b"}")
    assert plain.take(words) == (40, words.replace(UPSTREAM_MODEL.encode(), b"test-model"), 0)


@pytest.mark.parametrize("name", list(ODD_STREAMS))
@pytest.mark.parametrize("catalog_id", ["test-model", UPSTREAM_MODEL])
def test_odd_streams_relay_the_same_in_bulk(name, catalog_id):
    assert_same(ODD_STREAMS[name] + b"data: [DONE]\n\n", catalog_id, include_usage=True,
                seed=list(ODD_STREAMS).index(name))


@pytest.mark.parametrize("name", list(ODD_STREAMS))
def test_odd_streams_relay_the_same_in_bulk_with_a_plugin(name):
    """A stream's usual events are taken in line with one plugin (``_plugged_data``), the others
    (usage, errors, not JSON, not an object) as each event is when it comes alone."""
    stream = ODD_STREAMS[name] + b"data: [DONE]\n\n"
    for cut, chunks in cuts(stream, seed=list(ODD_STREAMS).index(name)).items():
        runs = [run(relay_for("test-model", True, impls=tuple(PLUGINS["no-op"])), chunks, bulk) for bulk in (True, False)]
        assert runs[0] == runs[1], cut


@pytest.mark.parametrize("plugins", ["changes text", "a method, call first", "changes the event before",
                                     "drops every third", "raises alone", "two, the second dropping"])
@pytest.mark.parametrize("name", list(ODD_STREAMS))
def test_odd_streams_relay_the_same_in_bulk_with_plugins_that_act(name, plugins):
    """The same with plugins that change, keep, drop or fail on events, alone and in order."""
    stream = ODD_STREAMS[name] + b"data: [DONE]\n\n"
    impls = tuple(PLUGINS[plugins])
    for cut, chunks in cuts(stream, seed=list(ODD_STREAMS).index(name), random_cuts=3).items():
        runs = [run(relay_for("test-model", True, impls=impls), chunks, bulk) for bulk in (True, False)]
        assert runs[0] == runs[1], cut


@pytest.mark.parametrize("plugins", list(PLUGINS))
@pytest.mark.parametrize("flavor", ["vllm", "llamacpp", "ollama"])
@pytest.mark.parametrize("chat", [False, True])
def test_with_transform_event_plugins_the_stream_is_the_same(plugins, flavor, chat):
    """Every event parsed once and shown to the plugins, split at C speed, gives what the parser gives."""
    stream = mock_stream(flavor, chat, words=30)
    endpoint = "chat/completions" if chat else "completions"
    for name, chunks in cuts(stream, seed=len(plugins), random_cuts=8).items():
        bulk = run(relay_for("test-model", True, endpoint, tuple(PLUGINS[plugins])), chunks, bulk=True)
        plain = run(relay_for("test-model", True, endpoint, tuple(PLUGINS[plugins])), chunks, bulk=False)
        assert bulk == plain, name
    by_event = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    out, streamed, finish = run(relay_for("test-model", True, endpoint, tuple(PLUGINS[plugins])), by_event, True)[:3]
    frames = b"".join(out).split(b"\n\n")
    assert (b"plugin_error" in frames[-3]) == (plugins in ("two, one raising", "raises alone", "leaves the event not JSON"))
    if flavor == "vllm":  # 31 events (30 words and the finish chunk), the usage chunk, [DONE], ""
        assert len(frames) - 2 == {"drops every third": 22, "two, the second dropping": 22, "stops at the 20th": 20 + 1,
                                   "two, one raising": 8 + 1,
                                   "raises alone": 8 + 1, "leaves the event not JSON": 6 + 1}.get(plugins, 32)
        assert finish == (None if plugins in ("stops at the 20th", "two, one raising", "raises alone",
                                              "leaves the event not JSON") else "length")


@pytest.mark.parametrize("ending", [b"", b"\n", b"\r"])
def test_a_last_event_with_no_blank_line_counts_at_the_end_of_the_body(ending):
    """llama.cpp ends a failed stream without [DONE]; a body may also end right after a data line."""
    stream = event(model=UPSTREAM_MODEL, **TEXT) * 20 + event(model=UPSTREAM_MODEL, **TEXT)[:-2] + ending
    for name, chunks in cuts(stream).items():
        bulk = run(relay_for("test-model", True), chunks, bulk=True)
        assert bulk == run(relay_for("test-model", True), chunks, bulk=False), name
        assert bulk[1] == 21, name


RECORDED = sorted((Path(__file__).resolve().parents[2] / "data" / "streams").glob("*.sse"))  # tests/e2e/record_streams.py


@pytest.mark.parametrize("path", RECORDED, ids=lambda path: path.stem)
@pytest.mark.parametrize("catalog_id", ["test-model", "gemma3-270m"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_recorded_llamacpp_streams_relay_the_same(path, catalog_id, include_usage):
    """Real streams of llama.cpp (Gemma 3 270M), cut at random; with and without a no-op plugin."""
    stream = path.read_bytes()
    endpoint = "chat/completions" if "chat" in path.stem else "completions"
    for impls in ((), tuple(PLUGINS["no-op"])):
        for name, chunks in cuts(stream, seed=len(stream), random_cuts=30).items():
            relays = [relay_for(catalog_id, include_usage, endpoint, impls, "gemma3-270m") for _ in range(2)]
            bulk, plain = run(relays[0], chunks, bulk=True), run(relays[1], chunks, bulk=False)
            assert bulk == plain, name
    assert bulk[2] in ("length", "stop") and bulk[4:6] == (True, True)  # a finish reason, [DONE]


def test_frames_that_would_overlap_in_a_short_event_are_not_taken():
    """Frames taken where two events differ by a key, then events without it: each holds the
    prefix and the suffix only overlapping, so the frames do not show them plain; ``count`` decides."""
    longer = event(model=UPSTREAM_MODEL, extra={"model": UPSTREAM_MODEL}, **TEXT)
    shorter = event(model=UPSTREAM_MODEL, **TEXT)
    plain = PlainRun(b'"model":"' + UPSTREAM_MODEL.encode() + b'"', b'"model":"test-model"')
    plain.take(longer + shorter)
    assert plain.prefix.endswith(b'7B",') and plain.suffix.startswith(b',"choices"')
    assert plain._by_frames(shorter * 2) is None
    assert plain.take(shorter * 2) == (2, (shorter * 2).replace(UPSTREAM_MODEL.encode(), b"test-model"), 0)


def test_the_common_start_and_end_of_two_events_are_found_byte_exact():
    """``_frames_from`` reads the frames from two events' common start and end (xor of the two read
    once as numbers, aligned at their ends and at their starts): the same lengths as a byte-by-byte
    walk, for bytes that differ anywhere and are of any lengths."""
    def walk(a: bytes, b: bytes) -> int:
        same = 0
        while same < min(len(a), len(b)) and a[same] == b[same]:
            same += 1
        return same

    rng = random.Random(7)
    for _ in range(3000):
        a, b = (bytes(rng.choice(b"ab\x00\xff") for _ in range(rng.randint(0, 12))) for _ in range(2))
        assert _common_ends(a, b) == (walk(a, b), walk(a[::-1], b[::-1])), (a, b)


@pytest.mark.parametrize("endpoint, counted", [("completions", 4), ("chat/completions", 3)])
def test_a_chunk_that_names_a_role_counts_as_a_token_only_on_text_completions(endpoint, counted):
    """The tokens streamed (the estimate when no usage comes) leave out a chat stream's role chunk; a
    text completion's chunks name no role, and each is counted, ``"role":`` in it or not."""
    stream = event(model=UPSTREAM_MODEL, **TEXT) * 3 + event(model=UPSTREAM_MODEL, role="assistant", **TEXT) \
        + b"data: [DONE]\n\n"
    for impls in ((), tuple(PLUGINS["no-op"])):
        for bulk in (True, False):
            assert run(relay_for("test-model", False, endpoint, impls), [stream], bulk)[1] == counted


@pytest.mark.parametrize("chunked", ["whole", "a chunk per event"])
def test_what_transform_event_returns_other_than_stop_or_drop_is_ignored(chunked):
    """The event the plugin was given goes out, as it left it: a dict it returns is not sent."""
    stream = mock_stream("vllm", False, words=12)
    chunks = [stream] if chunked == "whole" else [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    returned = run(relay_for("test-model", True, impls=tuple(PLUGINS["returns another event"])), chunks, True)
    assert returned == run(relay_for("test-model", True, impls=tuple(PLUGINS["no-op"])), chunks, True)
    assert b'"id":"other"' not in b"".join(returned[0]) and returned[1:3] == (13, "length")


WORDS = b"".join(event(model=UPSTREAM_MODEL, choices=[{"index": 0, "text": f" w{i}", "finish_reason": None}])
                 for i in range(12))
FINISH_EVENT = event(model=UPSTREAM_MODEL, choices=[{"index": 0, "text": "", "finish_reason": "stop"}])
USAGE_EVENT = event(model=UPSTREAM_MODEL, choices=[], usage={"prompt_tokens": 3, "completion_tokens": 13,
                                                              "total_tokens": 16})
LAST_EVENTS = {  # what follows the framed run: read one by one, from the chunk's one split or else
    "finish, usage, [DONE]": FINISH_EVENT + USAGE_EVENT + b"data: [DONE]\n\n",
    "a finish event that fits no frame": b'data: {"choices":[{"index":0,"text":"","finish_reason":"stop"}],"model":"'
        + UPSTREAM_MODEL.encode() + b'","id":"x","object":"text_completion"}\n\n' + USAGE_EVENT + b"data: [DONE]\n\n",
    "usage on two data lines": FINISH_EVENT + USAGE_EVENT.replace(b'"choices":[],', b'"choices":[],\ndata: ')
        + b"data: [DONE]\n\n",
    "a comment before [DONE]": FINISH_EVENT + USAGE_EVENT + b": done soon\n\ndata: [DONE]\n\n",
    "[DONE] with spaces, then more": FINISH_EVENT + b"data: [DONE]  \n\n" + USAGE_EVENT,
    "an error event last": FINISH_EVENT + b'data: {"error":{"message":"boom","code":"x"}}\n\n',
    "two finish events (two choices)": FINISH_EVENT + FINISH_EVENT.replace(b'"index":0', b'"index":1')
        + USAGE_EVENT + b"data: [DONE]\n\n",
    "usage null, then usage": FINISH_EVENT.replace(b'"choices"', b'"usage":null,"choices"') + USAGE_EVENT
        + b"data: [DONE]\n\n",
    "five marked events": FINISH_EVENT * 4 + USAGE_EVENT + b"data: [DONE]\n\n",
    "only marked events": b"",
}


@pytest.mark.parametrize("catalog_id", ["test-model", UPSTREAM_MODEL])
@pytest.mark.parametrize("name", list(LAST_EVENTS))
def test_the_last_events_of_a_chunk_are_read_the_same_however_they_are_framed(name, catalog_id):
    """A chunk of whole events is split once: its last marked events (finish, usage, [DONE], an error)
    are read one by one and the rest checked by its frames; events of several lines, comments and
    events that fit no frame among the last ones give the same bytes and record as parsing each."""
    stream = (WORDS if LAST_EVENTS[name] else FINISH_EVENT * 2) + LAST_EVENTS[name]
    for include_usage in (True, False):
        assert_same(stream, catalog_id, include_usage)
        bulk = run(relay_for(catalog_id, include_usage), [stream], bulk=True)
        assert bulk == run(relay_for(catalog_id, include_usage), [stream], bulk=False)
