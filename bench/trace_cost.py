"""In-process: the CPU a request's trace costs, driven as the gateway drives it under M2's load.

Each trace: ``Tracing.begin`` (no ``traceparent`` from the client, every trace sampled), ``model``,
the admission span, one upstream attempt and its status, the first token, ``end`` with the row of M2's answer and a
commit still pending; the commits of 64 requests (M2's in flight) then complete together and the
loop runs their callbacks, which encode the spans and queue them (``add_all``). The exporter's
thread runs as in the gateway: it frames each batch of 512 spans and sends it, to nothing (the
default) or with ``--post`` to ``otlp_sink.py`` (started here, in a process of its own) over
OTLP/HTTP. CPU is the whole process's (``time.process_time``: the loop's thread and the
exporter's; the queue long enough that no span is dropped), minus the same loop with the trace calls left out; µs per trace, best of ``--runs``.

    python bench/trace_cost.py [--tree DIR] [--post] [--runs 7] [--traces 20000]

``--tree``: a kilnproxy tree to import instead of the installed one (``git archive <rev>
kilnproxy | tar -x -C DIR``), for a before and after in alternated processes.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
IN_FLIGHT = 64
QUEUE = 1 << 22  # no span dropped: the loop here never waits, so the exporter's thread may fall behind


def _row(n: int) -> dict:
    """The row of M2's answer (what ``RequestRecord.row`` gives ``end``)."""
    return {"id": f"gen-{n}", "created_at": 1.0, "org": "bench", "key_id": "k", "model": "bench-upstream",
            "endpoint": "completions", "stream": 0, "status": 200, "error_code": None, "prompt_tokens": 9,
            "completion_tokens": 64, "cached_tokens": None, "total_tokens": 73, "cost": 0.000146,
            "duration_ms": 1.0, "ttft_ms": None, "finish_reason": "length", "disconnected": 0,
            "requested_model": "bench"}


async def _run(tracing, traces: int, traced: bool) -> float:
    """Seconds of process CPU for ``traces`` requests' worth of commits, with (``traced``) or without
    their trace calls."""
    from multidict import CIMultiDict, CIMultiDictProxy

    loop = asyncio.get_running_loop()
    headers = CIMultiDictProxy(CIMultiDict({"Host": "127.0.0.1", "Authorization": "Bearer x",
                                            "Content-Type": "application/json", "Content-Length": "120"}))
    calls = [SimpleNamespace(org="bench", generation_id=f"gen-{n:024x}") for n in range(traces)]
    rows = [_row(n) for n in range(IN_FLIGHT)]
    base_url = "http://127.0.0.1:8001/v1"
    start = time.process_time()
    for first in range(0, traces, IN_FLIGHT):
        pending = []
        for n in range(first, min(first + IN_FLIGHT, traces)):
            committed = loop.create_future()
            if traced:
                trace = tracing.begin(headers, "completions", calls[n])
                trace.model("bench")
                with trace.admission():
                    pass
                trace.attempt(base_url, {})
                trace.attempt_done(200)
                trace.first_token(0.512)  # the answer's first byte (``RequestRecord.first_byte``)
                trace.end(rows[n % IN_FLIGHT], committed)
            pending.append(committed)
        for committed in pending:
            committed.set_result(None)
        await asyncio.sleep(0)  # the commit callbacks
        await asyncio.sleep(0)  # what they scheduled: the encoding
    if traced:
        assert tracing.processor.flush(60)
    return time.process_time() - start


def _sink() -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(HERE / "otlp_sink.py"), "--port", str(port)])
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("otlp_sink.py did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="a kilnproxy tree to import instead of the installed one")
    parser.add_argument("--post", action="store_true", help="send the batches to otlp_sink.py over OTLP/HTTP")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--traces", type=int, default=20_000)
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    from kilnproxy.config_types import TracingConfig
    from kilnproxy.ops.tracing.install import Tracing

    sink = None
    try:
        if args.post:
            sink, port = _sink()
            config = TracingConfig(enabled=True, sample_ratio=1.0, endpoint=f"http://127.0.0.1:{port}/v1/traces",
                                   max_queue_size=QUEUE)
            tracing = Tracing(config)
        else:
            tracing = Tracing(TracingConfig(enabled=True, sample_ratio=1.0, max_queue_size=QUEUE), send=lambda body: None)
        try:
            import uvloop
            new_loop = uvloop.new_event_loop
        except ImportError:
            new_loop = asyncio.new_event_loop
        from kilnproxy.web.server import settle_gc

        settle_gc()  # the collector as the gateway sets it
        best_on = best_off = float("inf")
        for _ in range(args.runs):
            loop = new_loop()
            try:
                best_off = min(best_off, loop.run_until_complete(_run(tracing, args.traces, False)))
                best_on = min(best_on, loop.run_until_complete(_run(tracing, args.traces, True)))
            finally:
                loop.close()
        tracing.close()
        exported = tracing.exporter.exported
        assert exported == 4 * args.traces * args.runs, exported
    finally:
        if sink is not None:
            sink.terminate()
            sink.wait()
    per = 1e6 / args.traces
    import kilnproxy

    print(f"{Path(kilnproxy.__file__).parent.parent}{' --post' if args.post else ''}: "
          f"{(best_on - best_off) * per:.2f} µs a trace (loop alone {best_off * per:.2f}, with traces "
          f"{best_on * per:.2f}; best of {args.runs} runs of {args.traces})")


if __name__ == "__main__":
    main()
