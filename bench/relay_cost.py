"""The relay's own cost, in-process: M3's canned stream through ``EventRelay``, no network.

Runs the 64-chunk stream of ``upstreams.py`` (13 KB: 64 text events, the
finish event, the usage event, ``[DONE]``) through a fresh relay, as one chunk
(as nginx sends it) and as one chunk per event (as a model server streams), with
and without a no-op ``transform_event`` plugin, and prints the best time per
stream over ``--repeat`` runs of ``--number`` streams each. The steadier figure
to compare two versions of the relay with on a shared machine.

    python bench/relay_cost.py [--number 300] [--repeat 7]
"""

from __future__ import annotations

import argparse
import timeit

from upstreams import UPSTREAM_MODEL, canned_sse

from kilnproxy.config import ModelConfig, Pricing, ServerConfig
from kilnproxy.call import Call
from kilnproxy.plugins.manager import Impl
from kilnproxy.proxy.relay.plain_relay import EventRelay
from kilnproxy.proxy.request_record import RequestRecord
from kilnproxy.proxy.upstream.routes import Route
from kilnproxy.sse import SSEParser

NOOP = (Impl("noop_event", "transform_event", lambda event: None, ("event",)),)


def relay(route: Route, impls: tuple) -> EventRelay:
    call = Call("gen-bench", "bench", "key", "completions", model="bench-stream", stream=True, include_usage=True,
                pricing=route.pricing)
    return EventRelay(call, route, RequestRecord(call), impls)


def stream_through(r: EventRelay, chunks: list[bytes]) -> bytes:
    out = []
    if hasattr(r, "close"):  # the relay reads whole chunks
        for chunk in chunks:
            out.append(r.feed_chunk(chunk))
            if r.ended:
                break
    else:  # an older relay, given the parser
        parser = SSEParser()
        for chunk in chunks:
            out.append(r.feed_chunk(parser, chunk))
            if r.ended:
                break
    out.append(r.tail())
    return b"".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    route = Route(ModelConfig("bench-stream", ("http://127.0.0.1:1/v1",), UPSTREAM_MODEL,
                              pricing=Pricing(0.1, 0.3)), ServerConfig())
    stream = canned_sse()
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    n = len(events)
    for name, chunks in (("one chunk", [stream]), ("a chunk per event", events)):
        for plugin, impls in (("", ()), (", no-op transform_event", NOOP)):
            relays = iter([relay(route, impls) for _ in range(args.number * args.repeat)])
            best = min(timeit.repeat(lambda: stream_through(next(relays), chunks), number=args.number,
                                     repeat=args.repeat)) / args.number * 1e6
            print(f"{name + plugin:40s} {best:7.1f} µs per stream, {best / n:5.2f} µs per event")


if __name__ == "__main__":
    main()
