"""A lever's before and after: variants of the gateway side by side under M2's (or M3's) load, in the same run.

Each variant is a kilnproxy tree (``git archive <rev> kilnproxy | tar -x -C DIR``, or a copy
with a change to measure; ``installed`` is the checkout this script runs from) with, optionally,
``[tracing]`` on (every trace kept, spans sent to ``otlp_sink.py``). Every variant is started
once, pinned to CPU 0 like ``run.py``'s process under test; then each round runs wrk against
each in turn, in reverse order every other round (M2's non-streamed requests, 64 in flight; with ``--stream`` M3's 64-chunk
streams, 32 in flight; with ``--responses`` M8's Responses API streams, 32 in flight;
``--seconds`` long), so that what the machine does meanwhile falls
on all of them alike. Prints, per variant, the CPU time per request of the whole process
(median of the rounds, then every round), the user and kernel parts, the thread that
spent the most (per stream with ``--stream``), wrk's latency p50 and p99 (with
``--latency``, M1's one request at a time), and how busy the process kept its core (a gateway
below 100 % waited for something else, and spends more CPU a request than a saturated one), and the
most it had read from the disk in one round (not what the page cache served: an event loop that
waits for the disk shows here first). On a
shared 2-vCPU machine the same variant moves ±10 µs from one run to the next: compare variants
within a run, over 6 rounds or more.

    python bench/ab.py before=/tmp/before after=installed [--tracing after] [--stream | --responses | --latency]
        [--plugin bench/plugins/noop_event.py] [--rounds 8] [--seconds 3] [--pg after]

``--pg NAME``: that variant's usage store is PostgreSQL (``[storage] url``): a database of its own on one
throw-away server (``kilnproxy.testing.postgres``, fsync on, as ``measure_pg.py`` has it), running on the
load's CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from loads import wrk
from procs import Procs, free_port
from run import KEY, gateway_config
from upstreams import request_body, responses_body, write_nginx_files

HERE = Path(__file__).resolve().parent
TICK = os.sysconf("SC_CLK_TCK")


def disk_reads(pid: int) -> int:
    """Bytes the process has had read from the disk so far (``read_bytes``: not those the page cache
    served). A gateway whose event loop waits for the disk keeps its core less than fully busy."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def thread_cpu(pid: int) -> dict[str, tuple[int, int]]:
    """Each thread's (user, system) clock ticks so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out[tid] = (int(fields[11]), int(fields[12]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", metavar="NAME=TREE", help="a name and a kilnproxy tree, or installed")
    parser.add_argument("--tracing", action="append", default=[], metavar="NAME", help="this variant with [tracing] on")
    parser.add_argument("--pg", action="append", default=[], metavar="NAME", help="this variant on PostgreSQL")
    parser.add_argument("--plugin", metavar="PATH", help="every variant with this plugin module loaded")
    parser.add_argument("--stream", action="store_true", help="M3's load: 64-chunk streams, 32 in flight")
    parser.add_argument("--responses", action="store_true", help="M8's load: Responses API streams, 32 in flight")
    parser.add_argument("--latency", action="store_true", help="M1's load: one request at a time")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variants)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("ab.py needs two CPUs: the gateway on one, the load and the upstream on the other")
    os.sched_setaffinity(0, {cpus[1]})
    plugin = str(Path(args.plugin).resolve()) if args.plugin else None
    work = Path(tempfile.mkdtemp(prefix="kilnproxy-ab-"))
    os.chdir(work)  # ``python -m kilnproxy`` imports from its working directory first: not from a checkout
    postgres = None
    if args.pg:
        sys.path.insert(0, str(HERE.parent))
        from kilnproxy.testing.postgres import PostgresServer
        postgres = PostgresServer(fsync=True)
        postgres.start()  # its processes inherit this one's CPU: the load's
    with Procs(work) as procs:
        nginx_port = free_port()
        procs.start("nginx", ["nginx", "-e", str(work / "nginx-error.log"), "-c",
                              str(write_nginx_files(nginx_port, work))], port=nginx_port)
        sink = free_port()
        procs.start("sink", [sys.executable, str(HERE / "otlp_sink.py"), "--port", str(sink)], cpus={cpus[1]}, port=sink)
        tracing = f'\n[tracing]\nenabled = true\nendpoint = "http://127.0.0.1:{sink}/v1/traces"\nsample_ratio = 1.0\n'
        gateways = {}
        for name, tree in variants.items():
            port = free_port()
            storage = None
            if name in args.pg:
                url = postgres.create_database(f"kiln_ab_{len(gateways)}")
                storage = f'url = "{url}"\nspool_path = "{work / name}-spool.db"\nreplica_timeout_seconds = 15'
            config = gateway_config(work / f"{name}.toml", work / f"{name}.db", port,
                                    {"bench": f"http://127.0.0.1:{nginx_port}/json/v1",
                                     "bench-stream": f"http://127.0.0.1:{nginx_port}/sse/v1",
                                     "bench-responses": {"url": f"http://127.0.0.1:{nginx_port}/sse/v1",
                                                         "endpoints": ["responses"]}},
                                    plugin=plugin, sections=tracing if name in args.tracing else "", storage=storage)
            env = {"PYTHONPATH": str(Path(tree).resolve())} if tree != "installed" else {"PYTHONPATH": str(HERE.parent)}
            proc = procs.start(name, [sys.executable, "-m", "kilnproxy", "serve", "--config", str(config)],
                               cpus={cpus[0]}, port=port, env=env)
            path = "/v1/responses" if args.responses else "/v1/completions"
            gateways[name] = (proc.pid, f"http://127.0.0.1:{port}{path}")
        body, connections = (request_body(True, model="bench-stream"), 32) if args.stream else (request_body(False), 64)
        if args.responses:
            body, connections = responses_body(), 32
        if args.latency:
            connections = 1
        unit = "a stream" if args.stream or args.responses else "a request"
        for pid, url in gateways.values():  # warm-up
            wrk(url, body, KEY, connections, 2, pid)
        per_request: dict[str, list[float]] = {name: [] for name in gateways}
        latency: dict[str, list[tuple[float, float]]] = {name: [] for name in gateways}
        parts: dict[str, list[tuple[float, float, float]]] = {name: [] for name in gateways}
        share: dict[str, list[float]] = {name: [] for name in gateways}  # of a core, while wrk ran
        reads: dict[str, list[int]] = {name: [] for name in gateways}  # bytes read from the disk, while wrk ran
        order = list(gateways.items())
        for round_ in range(args.rounds):
            # every other round in reverse: no variant always runs right after the same other one
            for name, (pid, url) in (order if round_ % 2 == 0 else order[::-1]):
                before, read_before = thread_cpu(pid), disk_reads(pid)
                result = wrk(url, body, KEY, connections, args.seconds, pid)
                after = thread_cpu(pid)
                reads[name].append(disk_reads(pid) - read_before)
                us = 1e6 / TICK / max(result["requests"], 1)
                spent = {t: (u - before.get(t, (0, 0))[0], s - before.get(t, (0, 0))[1]) for t, (u, s) in after.items()}
                per_request[name].append(result["cpu_us"])
                latency[name].append((result["p50_us"], result["p99_us"]))
                share[name].append(result["cpu_share"])
                parts[name].append((sum(u for u, _ in spent.values()) * us, sum(s for _, s in spent.values()) * us,
                                    max(u + s for u, s in spent.values()) * us))
        for name, rounds in per_request.items():
            user, system, top = (statistics.median(p[i] for p in parts[name]) for i in range(3))
            label = name + (" (tracing)" if name in args.tracing else "") + (" (PostgreSQL)" if name in args.pg else "")
            print(f"{label:24s} {statistics.median(rounds):6.1f} µs {unit}  (rounds: "
                  f"{' '.join(f'{r:.0f}' for r in rounds)}); user {user:.1f}, kernel {system:.1f}, "
                  f"busiest thread {top:.1f}; latency p50 {statistics.median(p for p, _ in latency[name]):.0f} µs, "
                  f"p99 {statistics.median(p for _, p in latency[name]):.0f} µs; "
                  f"{statistics.median(share[name]) * 100:.0f} % of its core busy; "
                  f"{max(reads[name]) >> 10} KiB read from the disk in a round at most")
    if postgres is not None:
        postgres.remove()


if __name__ == "__main__":
    main()
