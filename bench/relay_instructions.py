"""The relay's instructions a stream, counted by valgrind (callgrind): ``relay_cost.py``'s stream through
``EventRelay`` for each kilnproxy tree, a figure the machine's other load does not move.

For each tree, runs the 13 KB stream of ``upstreams.py`` through ``--streams`` fresh relays (a relay
made and fed, then its tail) under ``valgrind --tool=callgrind``, and once through none, and prints
the difference per stream (``PYTHONHASHSEED=0`` in both). ``--per-event``: one chunk per event, as a
model server streams, instead of the stream in one chunk, as nginx sends it. ``--plugin``: with
``relay_cost.py``'s no-op ``transform_event`` plugin (every event parsed, shown to it and written
again). Needs valgrind.

    python bench/relay_instructions.py before=/tmp/before after=installed [--streams 300] [--per-event] [--plugin]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

RUN = """
import sys
from relay_cost import NOOP, relay, stream_through
from kilnproxy.config import ModelConfig, Pricing, ServerConfig
from kilnproxy.proxy.upstream.routes import Route
from upstreams import UPSTREAM_MODEL, canned_sse
route = Route(ModelConfig("bench-stream", ("http://127.0.0.1:1/v1",), UPSTREAM_MODEL, pricing=Pricing(0.1, 0.3)),
              ServerConfig())
stream = canned_sse()
chunks = [e + b"\\n\\n" for e in stream.split(b"\\n\\n") if e] if sys.argv[2] == "1" else [stream]
impls = NOOP if sys.argv[3] == "1" else ()
for _ in range(20):  # the first streams warm caches up: counted in neither run
    stream_through(relay(route, impls), chunks)
for _ in range(int(sys.argv[1])):
    stream_through(relay(route, impls), chunks)
"""


def instructions(tree: str, streams: int, per_event: bool, plugin: bool) -> int:
    """Run in ``bench/``: ``python -c`` puts its working directory first on the path, and the
    repository's root would shadow ``tree``'s kilnproxy with its own."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
    run = [sys.executable, "-c", RUN, str(streams), "1" if per_event else "0", "1" if plugin else "0"]
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *run], env=env, cwd=HERE,
                          capture_output=True, text=True, check=True)
    return int(re.search(r"Collected : (\d+)", done.stderr).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", metavar="NAME=TREE")
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--per-event", action="store_true")
    parser.add_argument("--plugin", action="store_true")
    args = parser.parse_args()
    for name, tree in (v.split("=", 1) for v in args.variants):
        tree = str(HERE.parent) if tree == "installed" else str(Path(tree).resolve())
        subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{tree!r}]; import kilnproxy.proxy.relay.plain_relay"],
                       cwd=HERE, check=True)  # the tree's bytecode compiled and kept before either count
        counted = (instructions(tree, n, args.per_event, args.plugin) for n in (args.streams, 0))
        per_stream = (next(counted) - next(counted)) / args.streams
        print(f"{name:12s} {per_stream:10,.0f} instructions a stream", flush=True)


if __name__ == "__main__":
    main()
