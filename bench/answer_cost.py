"""What writing a non-streamed answer costs, in-process: ``web.Response`` against ``kilnproxy.answers.Answer``.

Each answer (M2's completion JSON, 0.2 KB, with the generation-id header) is made,
prepared and written through a real ``StreamWriter`` to a transport that only counts
bytes, on a plain ``BaseRequest`` (as the hot routes have); the time of making the
request itself is taken off. Prints the best time per answer over ``--repeat`` runs
of ``--number``. On a tree without ``kilnproxy.answers`` only ``web.Response`` is timed.

    python bench/answer_cost.py [--number 5000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_parser import RawRequestMessage
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

try:
    from kilnproxy.answers import Answer
except ImportError:  # a tree from before Answer
    Answer = None

BODY = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
        b'"text":" Paris is","finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":2,'
        b'"total_tokens":7,"cost":0.0001}}')
HEADERS = {"X-Neocloud-Generation-Id": "gen-0123456789abcdef01234567"}


class _Transport:
    def __init__(self) -> None:
        self.sent = 0

    def write(self, data) -> None:
        self.sent += len(data)

    def writelines(self, chunks) -> None:
        self.sent += sum(map(len, chunks))

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, *args, **kwargs):
        return None


class _Protocol:
    transport = _Transport()
    _paused = False
    ssl_context = peername = sockname = None


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    loop = asyncio.get_running_loop()
    protocol = _Protocol()
    message = RawRequestMessage("POST", "/v1/completions", HttpVersion11, CIMultiDictProxy(CIMultiDict()), (),
                                False, None, False, False, URL("/v1/completions"))

    def request() -> web.BaseRequest:
        return web.BaseRequest(message, None, protocol, StreamWriter(protocol, loop), None, loop)

    makers = [("web.Response", lambda: web.Response(body=BODY, content_type="application/json", headers=HEADERS))]
    if Answer is not None:
        makers.append(("Answer", lambda: Answer(BODY, headers=HEADERS)))
    for name, make in makers:
        best = base = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            for _ in range(args.number):
                req, resp = request(), make()
                await resp.prepare(req)
                await resp.write_eof()
            best = min(best, time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(args.number):
                request()
            base = min(base, time.perf_counter() - start)
        print(f"{name:14s} {(best - base) / args.number * 1e6:6.2f} µs an answer made, prepared and written")


if __name__ == "__main__":
    asyncio.run(main())
