"""Streams relayed two ways, for the tests in proxy/relay/: by an ``EventRelay`` built by hand
(``relay_for``, ``run``, ``cuts``, ``assert_same`` and the ``transform_event`` plugins of ``PLUGINS``), and
through a running gateway in front of a raw upstream (``relayed``, and the frames it is fed: ``frame``,
``text_chunk``, ``usage``, ``renamed``, ``HELLO``/``WORLD``/``END``/``DONE``); ``cost`` prices tokens at the
test config's prices."""

import random

import orjson
from raw_upstreams import raw_upstream

from kilnproxy.call import DROP, STOP, Call
from kilnproxy.config import ModelConfig, Pricing, ServerConfig
from kilnproxy.plugins.manager import Impl
from kilnproxy.proxy.relay.errors import StreamPluginError
from kilnproxy.proxy.relay.plain_relay import EventRelay
from kilnproxy.proxy.request_record import RequestRecord
from kilnproxy.proxy.upstream.routes import Route
from kilnproxy.sse import DONE_FRAME, SSEParser
from kilnproxy.testing import MODEL, UPSTREAM_MODEL
from kilnproxy.usage import round_usd


PRICE = {"prompt": 0.10, "completion": 0.30, "cached_prompt": 0.05}


def cost(prompt, completion, cached=0):
    return round_usd(((prompt - cached) * PRICE["prompt"] + cached * PRICE["cached_prompt"]
                      + completion * PRICE["completion"]) / 1_000_000)


# -- an EventRelay built by hand --------------------------------------------------------------------


def relay_for(catalog_id: str, include_usage: bool, endpoint: str = "completions", impls=(),
              upstream_model: str = UPSTREAM_MODEL) -> EventRelay:
    route = Route(ModelConfig(catalog_id, ("http://127.0.0.1:1/v1",), upstream_model,
                              pricing=Pricing(0.1, 0.3)), ServerConfig())
    call = Call("gen-test", "acme", "key", endpoint, model=catalog_id, stream=True, include_usage=include_usage,
                pricing=route.pricing)
    return EventRelay(call, route, RequestRecord(call), impls)


def run(relay: EventRelay, chunks: list[bytes], bulk: bool) -> tuple:
    """``bulk``: the relay's own path; else every chunk parsed and relayed event by event."""
    parser = SSEParser()
    out = []  # what each chunk gives: the same bytes at the same time
    try:
        for chunk in chunks:
            out.append(relay.feed_chunk(chunk) if bulk else relay.feed(parser.feed(chunk)))
            if relay.ended:
                break
        else:
            out.append(relay.close() if bulk else relay.feed(parser.close()))
        out.append(relay.tail())
    except StreamPluginError as exc:
        out.append(exc.before + exc.frame() + DONE_FRAME)
    rec = relay.record
    return (out, rec.streamed_chunks, rec.finish_reason, rec.error_code, relay.ended, relay.clean_end,
            rec.usage)


def cuts(stream: bytes, seed: int = 0, random_cuts: int = 20) -> dict[str, list[bytes]]:
    rng = random.Random(seed)
    fixed = {
        "whole": [stream],
        "halves": [stream[:len(stream) // 2], stream[len(stream) // 2:]],
        "1500 bytes": [stream[i:i + 1500] for i in range(0, len(stream), 1500)],
        "1031 bytes": [stream[i:i + 1031] for i in range(0, len(stream), 1031)],
        "7 bytes": [stream[i:i + 7] for i in range(0, len(stream), 7)],
    }
    for i in range(random_cuts):
        at = sorted(rng.sample(range(1, len(stream)), rng.choice((1, 2, 3, 8, 30, len(stream) // 40))))
        fixed[f"random {seed}/{i}: {at}"] = [stream[a:b] for a, b in zip([0, *at], [*at, len(stream)])]
    return fixed


def assert_same(stream: bytes, catalog_id: str, include_usage: bool, endpoint: str = "completions",
                seed: int = 0) -> None:
    for name, chunks in cuts(stream, seed).items():
        bulk = run(relay_for(catalog_id, include_usage, endpoint), chunks, bulk=True)
        plain = run(relay_for(catalog_id, include_usage, endpoint), chunks, bulk=False)
        assert bulk == plain, name


def _upper(event):
    for choice in event.get("choices") or ():
        if choice.get("text"):
            choice["text"] = choice["text"].upper()


def _drop_some(call, event):
    call.state["n"] = call.state.get("n", 0) + 1
    return DROP if call.state["n"] % 3 == 0 else None


def _stop_late(event, call):
    call.state["n"] = call.state.get("n", 0) + 1
    return STOP if call.state["n"] == 20 else None


def _raise_late(call):
    call.state["n"] = call.state.get("n", 0) + 1
    if call.state["n"] == 9:
        raise ValueError("boom")


def _not_json_late(call, event):
    call.state["n"] = call.state.get("n", 0) + 1
    if call.state["n"] == 7:
        event["x"] = {1, 2}


class _Tagger:
    """A plugin object: its hook a method, ``call`` first (bound to the stream's call as the method's
    own ``self`` is bound to the object)."""

    def transform_event(self, call, event):
        event["gen"] = call.generation_id
        event.setdefault("seen", []).append(type(self).__name__)


def _change_the_last_too(call, event):
    """Keeps each event and changes it again when the next comes: what goes out is the event as
    it was when the plugin returned."""
    last = call.state.get("last")
    if last is not None:
        last["late"] = True
    event["late"] = False
    call.state["last"] = event


PLUGINS = {
    "no-op": [Impl("noop", "transform_event", lambda event: None, ("event",))],
    "takes no argument": [Impl("nothing", "transform_event", lambda: None, ())],
    "returns another event": [Impl("other", "transform_event", lambda event: {"id": "other"}, ("event",))],
    "a method, call first": [Impl("tagger", "transform_event", _Tagger().transform_event, ("call", "event"))],
    "changes the event before": [Impl("late", "transform_event", _change_the_last_too, ("call", "event"))],
    "two, the second dropping": [Impl("upper", "transform_event", _upper, ("event",)),
                                 Impl("drop", "transform_event", _drop_some, ("call", "event"))],
    "raises alone": [Impl("raise", "transform_event", _raise_late, ("call",))],
    "leaves the event not JSON": [Impl("set", "transform_event", _not_json_late, ("call", "event"))],
    "changes text": [Impl("upper", "transform_event", _upper, ("event",))],
    "drops every third": [Impl("drop", "transform_event", _drop_some, ("call", "event"))],
    "stops at the 20th": [Impl("stop", "transform_event", _stop_late, ("event", "call"))],
    "two, one raising": [Impl("upper", "transform_event", _upper, ("event",)),
                         Impl("raise", "transform_event", _raise_late, ("call",))],
}


# -- through a running gateway, in front of a raw upstream ---------------------------------------------


DONE = b"data: [DONE]\n\n"


def frame(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def text_chunk(text: str, finish: str | None = None, model: str = UPSTREAM_MODEL, **extra) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra}


def usage(prompt: int, completion: int) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": UPSTREAM_MODEL, "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


def renamed(obj: dict) -> bytes:
    """``frame`` of ``obj`` as the client gets it: the catalog id for the model."""
    return frame({**obj, "model": MODEL})


HELLO, WORLD, END = text_chunk("Hello"), text_chunk(" world"), text_chunk("!", "stop")


async def relayed(harness, stream: bytes, body: dict | None = None, path: str = "/v1/completions",
                  plugins=(), *, upstream=raw_upstream, model: dict | None = None) -> tuple[bytes, dict]:
    """What the client got for ``stream`` from the upstream (``upstream(stream=...)``, a context manager
    giving its URL), and the request's row; ``model``: changes to the catalog model (its ``upstream_model``)."""
    async with upstream(stream=stream) as url:
        configure = lambda c: c["models"][0].update(upstreams=[url], **(model or {}))  # noqa: E731
        async with harness(configure=configure, plugins=list(plugins)) as h:
            request = {"model": MODEL, "stream": True, **({"prompt": "hi there"} if path == "/v1/completions"
                                                          else {"messages": [{"role": "user", "content": "hi"}]}),
                       **(body or {})}
            async with h.post(path, request) as resp:
                assert resp.status == 200, await resp.text()
                raw = await resp.read()
                row = await h.row(resp.headers["X-Neocloud-Generation-Id"])
    assert b"HTTP/1.1" not in raw
    return raw, row
