"""The framed relay's own cost, in-process: M8's Responses stream, and a Messages stream, through ``FramedRelay``.

Runs the mock upstream's Responses API stream (M8's, ``upstreams.py``: 72
``event:`` + ``data:`` pairs, 64 of them text deltas, 16 KB) and its Anthropic
Messages stream of as many text deltas (70 pairs) through a fresh relay, as one
chunk (as nginx sends it) and as one chunk per event (as a model server
streams), with and without a no-op ``transform_event`` plugin; prints the best
time per stream over ``--repeat`` runs of ``--number`` streams each, beside
the completions relay on M3's stream (``relay_cost.py``'s figure) when
``--completions`` is given. ``--before FILE`` loads another version of
``framed_relay.py`` (e.g. ``git show REV:kilnproxy/proxy/relay/framed_relay.py``) beside
this tree's and alternates the two, repeat by repeat, in the same process.

    python bench/framed_cost.py [--number 300] [--repeat 7] [--completions] [--before FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import timeit

import orjson
from upstreams import CHUNKS, UPSTREAM_MODEL, canned_responses_sse, canned_sse

from kilnproxy.config import ModelConfig, Pricing, ServerConfig
from kilnproxy.call import Call
from kilnproxy.plugins.manager import Impl
from kilnproxy.proxy.relay.framed_relay import FramedRelay
from kilnproxy.proxy.request_record import RequestRecord
from kilnproxy.proxy.upstream.routes import Route

NOOP = (Impl("noop_event", "transform_event", lambda event: None, ("event",)),)
PRICING = Pricing(0.1, 0.3)


def canned_messages_sse() -> bytes:
    """The mock's Anthropic Messages stream of ``CHUNKS`` text deltas (vLLM's flavor)."""
    from aiohttp.test_utils import TestClient, TestServer

    from kilnproxy.mock_servers.mock_upstream import create_mock_app
    body = {"model": UPSTREAM_MODEL, "max_tokens": CHUNKS, "stream": True,
            "messages": [{"role": "user", "content": "The capital of France is"}],
            "mock": {"id": "msg_bench0000000000000000000000000000"}}

    async def ask() -> bytes:
        async with TestClient(TestServer(create_mock_app(flavor="vllm"))) as client:
            resp = await client.post("/v1/messages", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})
            assert resp.status == 200, (resp.status, await resp.text())
            return await resp.read()
    return asyncio.run(ask())


def framed(endpoint: str, impls: tuple, relay_class: type = FramedRelay) -> FramedRelay:
    call = Call("gen-bench", "bench", "key", endpoint, model="bench-" + endpoint, stream=True, pricing=PRICING)
    return relay_class(call, RequestRecord(call), impls)


def relay_class_of(path: str) -> type:
    """``FramedRelay`` from another version of ``framed_relay.py`` (its imports are this tree's)."""
    spec = importlib.util.spec_from_file_location("kilnproxy.proxy._framed_relay_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FramedRelay


def stream_through(r: FramedRelay, chunks: list[bytes]) -> bytes:
    out = []
    for chunk in chunks:
        out.append(r.feed_chunk(chunk))
        if r.ended:
            break
    out.append(r.close())
    return b"".join(out)


def best(makes: list, chunks: list[bytes], number: int, repeat: int) -> list[float]:
    """Each maker's best time per stream over ``repeat`` runs of ``number`` streams, the makers alternated."""
    times: list[list[float]] = [[] for _ in makes]
    for _ in range(repeat):
        for make, spent in zip(makes, times):
            relays = iter([make() for _ in range(number)])
            spent.append(timeit.timeit(lambda: stream_through(next(relays), chunks), number=number))
    return [min(spent) / number * 1e6 for spent in times]


def completions_best(number: int, repeat: int) -> float:
    from relay_cost import relay
    from relay_cost import stream_through as plain_through
    route = Route(ModelConfig("bench-stream", ("http://127.0.0.1:1/v1",), UPSTREAM_MODEL, pricing=PRICING),
                  ServerConfig())
    stream = canned_sse()
    relays = iter([relay(route, ()) for _ in range(number * repeat)])
    return min(timeit.repeat(lambda: plain_through(next(relays), [stream]), number=number,
                             repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--completions", action="store_true", help="also M3's stream through the completions relay")
    parser.add_argument("--before", metavar="FILE", help="another framed_relay.py, measured alternated with this one")
    args = parser.parse_args()
    classes = [relay_class_of(args.before), FramedRelay] if args.before else [FramedRelay]
    streams = {"responses": canned_responses_sse(), "messages": canned_messages_sse()}
    for endpoint, stream in streams.items():
        # the relay's answer checked once: every frame out, the usage read
        r = framed(endpoint, ())
        out = stream_through(r, [stream])
        assert r.finished and r.record.usage is not None and r.record.usage.completion_tokens == CHUNKS, endpoint
        assert out.count(b"\n\n") == stream.count(b"\n\n") and b'"cost"' in out, endpoint
        events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
        n = len(events)
        for name, chunks in (("one chunk", [stream]), ("a chunk per event", events)):
            for plugin, impls in (("", ()), (", no-op transform_event", NOOP)):
                makes = [lambda c=c: framed(endpoint, impls, c) for c in classes]
                figures = best(makes, chunks, args.number, args.repeat)
                print(f"{endpoint:9s} {name + plugin:40s} "
                      + "; ".join(f"{us:7.1f} µs per stream, {us / n:5.2f} µs per event" for us in figures)
                      + ("  (before; after)" if args.before else ""))
    if args.completions:
        us = completions_best(args.number, args.repeat)
        print(f"{'completions':9s} {'one chunk (M3, relay_cost.py)':40s} {us:7.1f} µs per stream")


if __name__ == "__main__":
    main()
