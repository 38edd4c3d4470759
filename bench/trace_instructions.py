"""What tracing costs the whole gateway process, all its threads, a request: counted, not timed.

Starts nginx with M2's canned answer, ``otlp_sink.py`` and the gateway (every feature on, as
``ab.py`` configures it) with ``[tracing]`` off and on (every request sampled, spans sent to the
sink), and for each:

* default: runs it under ``valgrind --tool=callgrind`` (every thread), sends ``--warm``
  non-streamed requests on ``--concurrency`` kept-alive connections, waits until the sink has
  every span of them, zeroes the counters, sends ``--requests`` more, waits for their spans again
  (so the exporter's thread's work on them is in), dumps the counters and prints the user-space
  instructions a request, all threads and each thread. ``--keep DIR`` keeps the callgrind files
  (``callgrind_annotate DIR/on.callgrind.1 --inclusive=yes``).
* ``--native``: both variants at once, pinned to CPU 0 as in ``ab.py``, wrk's M2 load (64
  connections) alternated over ``--rounds``: per request, the process's user and kernel CPU,
  voluntary and involuntary context switches (all threads) and minor page faults; with
  ``--perf``, one more run each under ``perf stat`` (tracepoints: cheap, unlike strace) for each
  system call, context switch, page fault and wake-up a request.

    python bench/trace_instructions.py [--requests 1024] [--warm 256] [--concurrency 64] [--tree DIR] [--only on]
    python bench/trace_instructions.py --native [--rounds 6] [--seconds 3] [--perf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loads import wrk
from procs import Procs, free_port
from run import KEY, gateway_config
from upstreams import request_body, write_nginx_files

HERE = Path(__file__).resolve().parent
SPANS = 4  # a non-streamed request's spans: the request, admission, upstream, usage commit
TICK = os.sysconf("SC_CLK_TCK")


async def requests(port: int, count: int, concurrency: int, body: bytes) -> None:
    """``count`` non-streamed requests on ``concurrency`` kept-alive connections, each answer read whole."""
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    left = iter(range(count))

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in left:
                writer.write(data)
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head
                length = int(re.search(rb"(?i)\r\ncontent-length: (\d+)", head).group(1))
                await reader.readexactly(length)
        finally:
            writer.close()
    await asyncio.gather(*(worker() for _ in range(concurrency)))


def sink_spans(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10) as answer:
        return json.load(answer)["spans"]


def wait_spans(port: int, want: int, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while (got := sink_spans(port)) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sink has {got} spans of {want}")
        time.sleep(0.2)


def wait_port(port: int, seconds: float = 900) -> None:
    import socket
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port}")


def summaries(work: Path, name: str) -> dict[str, int]:
    """Each thread's instructions in the dump (``--separate-threads``): file suffix -> total."""
    out = {}
    for path in sorted(work.glob(f"{name}.callgrind.1*")):
        match = re.search(r"^summary: (\d+)", path.read_text(errors="replace"), re.M)
        out[path.name.rsplit(".1", 1)[-1] or "-01"] = int(match.group(1)) if match else 0
    return out


def callgrind(args, work: Path, config: dict[str, Path], sink: int, tree: str, body: bytes) -> None:
    spans_before = 0
    for name, path in config.items():
        port = int(re.search(r"port = (\d+)", path.read_text()).group(1))
        out = work / f"{name}.callgrind"
        proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--separate-threads=yes",
                                 f"--callgrind-out-file={out}",
                                 sys.executable, "-m", "kilnproxy", "serve", "--config", str(path)],
                                env={**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"},
                                stdout=subprocess.DEVNULL, stderr=open(work / f"{name}.log", "w"))
        traced = name == "on"
        try:
            wait_port(port)
            asyncio.run(requests(port, args.warm, args.concurrency, body))
            if traced:
                wait_spans(sink, spans_before + SPANS * args.warm)
            subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
            asyncio.run(requests(port, args.requests, args.concurrency, body))
            if traced:
                wait_spans(sink, spans_before + SPANS * (args.warm + args.requests))
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        finally:
            proc.terminate()
            proc.wait()
        if traced:
            spans_before = sink_spans(sink)
        threads = summaries(work, name)
        total = sum(threads.values())
        each = ", ".join(f"thread{t} {n / args.requests:,.0f}" for t, n in threads.items() if n)
        print(f"{name:4s} {total / args.requests:10,.0f} instructions a request ({args.requests} requests, "
              f"{args.concurrency} at a time; {each})", flush=True)


def process_counts(pid: int) -> dict[str, int]:
    """The process's CPU ticks, page faults and (summed over its threads) context switches so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    counts = {"user": int(fields[11]), "sys": int(fields[12]), "minflt": int(fields[7]),
              "voluntary": 0, "involuntary": 0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        counts["voluntary"] += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
        counts["involuntary"] += int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
    return counts


def perf_counts(pid: int, url: str, body: bytes, seconds: float, out: Path) -> tuple[int, dict[str, int]]:
    """Requests served and the events ``perf stat`` counted in ``pid`` (all its threads) meanwhile: each
    system call, context switches, page faults, and the wake-ups the gateway's threads made."""
    events = "syscalls:sys_enter_*,sched:sched_wakeup,sched:sched_waking,context-switches,page-faults,cpu-migrations"
    tracer = subprocess.Popen(["perf", "stat", "-x", ",", "-e", events, "-o", str(out), "-p", str(pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    served = wrk(url, body, KEY, 64, seconds, pid)["requests"]
    tracer.send_signal(2)
    tracer.wait()
    calls = {}
    for line in out.read_text().splitlines():
        parts = line.split(",")
        if len(parts) >= 3 and parts[0].strip().isdigit() and int(parts[0]):
            calls[parts[2].replace("syscalls:sys_enter_", "")] = int(parts[0])
    return served, calls


def cpu_busy(cpu: int) -> tuple[int, int]:
    """(busy, all) clock ticks of one CPU so far, every process's."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            ticks = [int(t) for t in line.split()[1:]]
            return sum(ticks) - ticks[3] - ticks[4], sum(ticks)
    raise RuntimeError(f"no cpu{cpu} in /proc/stat")


def native(args, work: Path, procs: Procs, config: dict[str, Path], tree: str, body: bytes, cpus: list[int],
           sink_pid: int) -> None:
    gateways = {}
    for name, path in config.items():
        port = int(re.search(r"port = (\d+)", path.read_text()).group(1))
        proc = procs.start(name, [sys.executable, "-m", "kilnproxy", "serve", "--config", str(path)],
                           cpus={cpus[0]}, port=port, env={"PYTHONPATH": tree})
        gateways[name] = (proc.pid, f"http://127.0.0.1:{port}/v1/completions")
    for pid, url in gateways.values():
        wrk(url, body, KEY, 64, 2, pid)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in gateways}
    for _ in range(args.rounds):
        for name, (pid, url) in gateways.items():
            before, sink_before, load_before = process_counts(pid), process_counts(sink_pid), cpu_busy(cpus[-1])
            result = wrk(url, body, KEY, 64, args.seconds, pid)
            served = max(result["requests"], 1)
            after, sink_after, load_after = process_counts(pid), process_counts(sink_pid), cpu_busy(cpus[-1])
            row = {k: (after[k] - before[k]) / served for k in before}
            row["share"] = result["cpu_share"]
            row["load"] = (load_after[0] - load_before[0]) / max(load_after[1] - load_before[1], 1)
            row["sink"] = sum(sink_after[k] - sink_before[k] for k in ("user", "sys")) * 1e6 / TICK / served
            row["user"] *= 1e6 / TICK
            row["sys"] *= 1e6 / TICK
            rows[name].append(row)
    for name, rounds in rows.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"{name:4s} a request (median of {args.rounds} rounds): user {med['user']:.1f} µs, kernel "
              f"{med['sys']:.1f} µs; context switches voluntary {med['voluntary']:.4f}, involuntary "
              f"{med['involuntary']:.4f}; minor faults {med['minflt']:.4f}; the gateway's share of its CPU "
              f"{med['share']:.3f}, the load CPU busy {med['load']:.3f}, the sink {med['sink']:.1f} µs; user by round "
              + " ".join(f"{r['user']:.0f}" for r in rounds), flush=True)
    if args.perf:
        counted = {}
        for name, (pid, url) in gateways.items():
            counted[name] = perf_counts(pid, url, body, args.seconds, work / f"{name}.perf")
        names = sorted(set().union(*(c for _, c in counted.values())),
                       key=lambda s: -max(c.get(s, 0) / n for n, c in counted.values()))
        print("events a request (perf stat): " + "  ".join(f"{n}: {served} requests" for n, (served, _) in counted.items()))
        for call in names:
            print(f"  {call:18s} " + "  ".join(f"{n} {c.get(call, 0) / served:7.3f}" for n, (served, c) in counted.items()))
        print("  " + "system calls".ljust(18) + " " + "  ".join(
            f"{n} {sum(v for k, v in c.items() if ':' not in k and '-' not in k) / served:7.3f}"
            for n, (served, c) in counted.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(HERE.parent), help="the kilnproxy checkout measured")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--warm", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--keep", metavar="DIR", help="copy the callgrind files there")
    parser.add_argument("--only", choices=("off", "on"), help="one variant only (callgrind)")
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--perf", action="store_true")
    args = parser.parse_args()
    tree = str(Path(args.tree).resolve())
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})
    work = Path(tempfile.mkdtemp(prefix="kilnproxy-tr-"))
    os.chdir(work)
    body = request_body(False)
    with Procs(work) as procs:
        nginx_port = free_port()
        procs.start("nginx", ["nginx", "-e", str(work / "nginx-error.log"), "-c",
                              str(write_nginx_files(nginx_port, work))], port=nginx_port)
        sink = free_port()
        sink_pid = procs.start("sink", [sys.executable, str(HERE / "otlp_sink.py"), "--port", str(sink)],
                               cpus={cpus[-1]}, port=sink).pid
        tracing = f'\n[tracing]\nenabled = true\nendpoint = "http://127.0.0.1:{sink}/v1/traces"\nsample_ratio = 1.0\n'
        config = {name: gateway_config(work / f"{name}.toml", work / f"{name}.db", free_port(),
                                       {"bench": f"http://127.0.0.1:{nginx_port}/json/v1"},
                                       sections=tracing if name == "on" else "")
                  for name in ("off", "on")}
        if args.native:
            native(args, work, procs, config, tree, body, cpus, sink_pid)
        else:
            callgrind(args, work, {k: v for k, v in config.items() if args.only in (None, k)}, sink, tree, body)
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                for path in work.glob("*.callgrind*"):
                    shutil.copy(path, args.keep)


if __name__ == "__main__":
    main()
