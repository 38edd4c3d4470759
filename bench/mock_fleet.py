"""M9's fleet: N mock upstreams with prompt caches (``kilnproxy mock-upstream --prompt-cache-slots``) in one process.

Each server is the mock upstream's own app (``kilnproxy.web.server.start_mock``) on a port of its own, on
127.0.0.1, with ``--slots`` slots of prompt cache and ``--prefill`` seconds per prompt token not cached, so
that a GPU fleet's proportions show (a turn whose conversation the server holds starts at once, one that
lands elsewhere waits for its whole prompt). Prints one line, ``fleet ready: URL URL ...``, once every
server listens, and runs until SIGTERM or SIGINT.

    python bench/mock_fleet.py --servers 16 --slots 32 --prefill 0.0001 --delay 0.01
"""

from __future__ import annotations

import argparse
import asyncio

from kilnproxy.web import server


async def serve(args) -> None:
    running = []
    try:
        for _ in range(args.servers):
            running.append(await server.start_mock("127.0.0.1", 0, delay=args.delay, context_window=args.context_window,
                                                   prompt_cache_slots=args.slots, prefill_per_token=args.prefill))
        await server.wait_for_signal(lambda: print("fleet ready: " + " ".join(r.url for r in running), flush=True))
    finally:
        for r in running:
            await r.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=16)
    parser.add_argument("--slots", type=int, default=32, help="prompt-cache slots of each server")
    parser.add_argument("--prefill", type=float, default=0.0001, help="seconds per prompt token not cached")
    parser.add_argument("--delay", type=float, default=0.01, help="seconds between streamed chunks")
    parser.add_argument("--context-window", type=int, default=32768)
    args = parser.parse_args()
    server.run(lambda: serve(args))


if __name__ == "__main__":
    main()
