"""aiohttp clients for the streamed measurements (run as separate processes).

``latency``: M4 and M7. ``n`` streams, ``concurrency`` at a time; per stream the
time to the first body byte and to the end of the body, and the time all took.
Prints one JSON line.

``hold``: M5. Opens ``n`` streams (``concurrency`` connecting at a time),
prints ``OPEN <k>`` once all have their first event (k = how many did), then
reads each to its end and prints ``DONE`` with the counts of streams that
ended with ``[DONE]`` and of those that failed.
"""

import argparse
import asyncio
import sys
import time

import aiohttp
import orjson
import uvloop


async def one_stream(session, url, body, headers, opened=None):
    started = time.perf_counter()
    ttfb = None
    tail = b""
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        async for chunk in resp.content.iter_any():
            if ttfb is None:
                ttfb = time.perf_counter() - started
                if opened is not None:
                    opened()
            tail = (tail + chunk)[-64:]
    if not tail.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError("the stream did not end with [DONE]")
    return ttfb, time.perf_counter() - started


async def latency(args, session, headers) -> None:
    gate = asyncio.Semaphore(args.concurrency)
    results = []

    async def run():
        async with gate:
            results.append(await one_stream(session, args.url, args.body, headers))

    started = time.perf_counter()
    await asyncio.gather(*(run() for _ in range(args.n)))
    wall = time.perf_counter() - started
    print(orjson.dumps({"ttfb_ms": [r[0] * 1000 for r in results], "total_ms": [r[1] * 1000 for r in results],
                        "wall_ms": wall * 1000}).decode(), flush=True)


async def hold(args, session, headers) -> None:
    gate = asyncio.Semaphore(args.concurrency)
    all_open = asyncio.Event()
    counts = {"open": 0, "settled": 0, "ok": 0, "failed": 0}
    errors: dict[str, int] = {}

    def settle():
        counts["settled"] += 1
        if counts["settled"] == args.n:
            all_open.set()

    async def run():
        opened = False

        def on_open():
            nonlocal opened
            opened = True
            counts["open"] += 1
            gate.release()
            settle()

        await gate.acquire()
        try:
            await one_stream(session, args.url, args.body, headers, on_open)
            counts["ok"] += 1
        except Exception as exc:
            counts["failed"] += 1
            name = type(exc).__name__ + (f": {exc}" if isinstance(exc, RuntimeError) else "")
            errors[name] = errors.get(name, 0) + 1
            if not opened:
                gate.release()
                settle()

    tasks = [asyncio.ensure_future(run()) for _ in range(args.n)]
    await all_open.wait()
    print(f"OPEN {counts['open']}", flush=True)
    await asyncio.gather(*tasks)
    print("DONE " + orjson.dumps({"ok": counts["ok"], "failed": counts["failed"], "errors": errors}).decode(),
          flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("latency", "hold"))
    parser.add_argument("--url", required=True)
    parser.add_argument("--body", required=True, type=str.encode)
    parser.add_argument("--key", default="")
    parser.add_argument("--header", action="append", default=[], help="'Name: value', repeatable")
    parser.add_argument("-n", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    headers = {"Content-Type": "application/json"}
    if args.key:
        headers["Authorization"] = f"Bearer {args.key}"
    for line in args.header:
        name, _, value = line.partition(":")
        headers[name.strip()] = value.strip()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await (latency if args.mode == "latency" else hold)(args, session, headers)


if __name__ == "__main__":
    sys.exit(uvloop.run(main()))
