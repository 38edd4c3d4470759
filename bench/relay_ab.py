"""Two (or more) kilnproxy trees' relays in one process, ``relay_cost.py``'s stream alternated between them.

Each tree's ``EventRelay`` is imported in turn (the ``kilnproxy`` modules forgotten between
trees, so each keeps its own), then batches of ``--batch`` fresh relays are fed M3's 13 KB
stream in one chunk, tree after tree (the order flipped every round), and the best batch of
each tree is printed per stream. What the machine does meanwhile falls on every tree alike,
round by round: steadier on a shared machine than separate ``relay_cost.py`` runs.
``--plugin``: none, ``event`` (``relay_cost.py``'s no-op ``lambda event: None``) or
``call-event`` (a no-op ``def transform_event(call, event)``, as ``plugins/noop_event.py``).

    python bench/relay_ab.py before=/tmp/before after=installed [--plugin call-event] [--rounds 400]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def noop_event(call, event):
    pass


def load(tree: str, plugin: str):
    """``tree``'s relay_cost functions, route and the plugin's implementations."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("kilnproxy", "relay_cost")]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    try:
        relay_cost = importlib.import_module("relay_cost")
        from kilnproxy.config import ModelConfig, Pricing, ServerConfig
        from kilnproxy.plugins.manager import Impl
        from kilnproxy.proxy.relay import plain_relay as relay
        from kilnproxy.proxy.upstream.routes import Route
        from upstreams import UPSTREAM_MODEL
        assert relay.__file__.startswith(tree), relay.__file__
        route = Route(ModelConfig("bench-stream", ("http://127.0.0.1:1/v1",), UPSTREAM_MODEL,
                                  pricing=Pricing(0.1, 0.3)), ServerConfig())
        impls = {"none": (), "event": relay_cost.NOOP,
                 "call-event": (Impl("noop_event", "transform_event", noop_event, ("call", "event")),)}[plugin]
        return relay_cost.relay, relay_cost.stream_through, route, impls
    finally:
        sys.path.remove(tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", metavar="NAME=TREE")
    parser.add_argument("--plugin", choices=("none", "event", "call-event"), default="event")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--batch", type=int, default=20)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from upstreams import canned_sse
    stream = canned_sse()
    events = stream.count(b"\n\n")
    trees = {name: str(HERE.parent) if tree == "installed" else str(Path(tree).resolve())
             for name, tree in (v.split("=", 1) for v in args.variants)}
    loaded = {name: load(tree, args.plugin) for name, tree in trees.items()}
    best = dict.fromkeys(loaded, float("inf"))
    names = list(loaded)
    for i in range(args.rounds):
        for name in names if i % 2 else names[::-1]:
            relay, stream_through, route, impls = loaded[name]
            relays = [relay(route, impls) for _ in range(args.batch)]
            start = time.perf_counter()
            for r in relays:
                stream_through(r, [stream])
            best[name] = min(best[name], (time.perf_counter() - start) / args.batch * 1e6)
    for name in names:
        print(f"{name:12s} {best[name]:7.1f} µs a stream, {best[name] / events:5.2f} µs an event"
              f" (plugin: {args.plugin})")


if __name__ == "__main__":
    main()
