"""M1-M6: each runs its targets in rounds, the order rotated every round (A B C, B C A, ...)."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from statistics import median

from loads import LoadError, hold_streams, post, stream_latency, wrk
from peers import PORTKEY, litellm_headers, portkey_headers
from procs import free_port, peak_rss_kib
from report import ratio, spread, table
from upstreams import CHUNKS, request_body

HERE = Path(__file__).resolve().parent
GW, PT, UP = "kilnproxy", "pass-through", "upstream"
PT_LINES = "pass-through, line by line"
GW_EVENT = "kilnproxy, no-op transform_event plugin"
NO_LEDGER = "kilnproxy, usage accounting off"
PER_MINUTE = "kilnproxy, per-minute limits on"  # requests and tokens per minute on the org, never reached
PEER_STREAMS = 2000  # M5: streams a peer holds open
VARIANTS = ("kilnproxy, every feature on", "usage accounting off", "no-op plugin, per-request hooks",
            "no-op plugin, every hook")


class Bench:
    def __init__(self, args, procs, key, pids, *, nginx, mock, gateway, passthrough, peer=None, peers=()):
        self.args, self.procs, self.key, self.pids = args, procs, key, pids
        self.nginx, self.mock = nginx, mock
        self.gateway, self.passthrough = gateway, passthrough
        self.peer = peer  # peer(name, {model: upstream base}) -> base URL of a new process
        self.peers = {name: peer(name, {}) for name in peers}  # the peers that could be installed
        self.gw = gateway("kilnproxy")
        self.pt_nginx = passthrough("passthrough-nginx", nginx)
        self.pt_mock = passthrough("passthrough-mock", mock)
        self.sections: list[str] = []
        self.goals: list[list[str]] = []

    # -- helpers --------------------------------------------------------------

    def peer_targets(self, upstream_base: str, base_urls: dict[str, str] | None = None) -> dict:
        """The peers as targets for an upstream: (URL, headers); Portkey routes by headers,
        LiteLLM by the request's model name (its config maps each bench model to its upstream)."""
        out = {}
        for name, base in (base_urls or self.peers).items():
            headers = portkey_headers(upstream_base) if name == PORTKEY else litellm_headers()
            out[name] = (f"{base}/v1/completions", headers)
        return out

    def rounds(self, targets: dict, run, warm=None) -> dict[str, list]:
        names = list(targets)
        for name in names:
            (warm or run)(targets[name])
        out = {name: [] for name in names}
        for r in range(self.args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                out[name].append(run(targets[name]))
        return out

    def wrk_rounds(self, targets: dict, body: bytes, connections: int) -> dict[str, list]:
        """``targets``: name -> URL, or (URL, headers)."""
        def run(target):
            url, headers = target if isinstance(target, tuple) else (target, None)
            summary = wrk(url, body, self.key, connections, self.args.seconds,
                          self.pids["/".join(url.split("/")[:3])], headers)
            if summary["errors"]:
                raise LoadError(f"{url}: {summary['errors']} failed requests in {summary}")
            return summary

        def warm(target):
            url, headers = target if isinstance(target, tuple) else (target, None)
            wrk(url, body, self.key, connections, 1, headers=headers)
        return self.rounds(targets, run, warm=warm)

    @property
    def gw_no_ledger(self) -> str:
        if not hasattr(self, "_gw_no_ledger"):
            self._gw_no_ledger = self.gateway("kilnproxy-no-ledger",
                                              argv_head=[sys.executable, str(HERE / "gateway_no_ledger.py")])
        return self._gw_no_ledger

    @property
    def gw_per_minute(self) -> str:
        if not hasattr(self, "_gw_per_minute"):
            self._gw_per_minute = self.gateway("kilnproxy-per-minute", per_minute=True)
        return self._gw_per_minute

    def goal(self, name: str, target: str, figure: str, met: bool | None) -> None:
        self.goals.append([name, target, figure, "yes" if met else "n/a" if met is None else "**no**"])

    def summary(self) -> str:
        return "## Targets\n\n" + table(["", "target", "figure (median, min–max)", "met"], self.goals)

    # -- the measurements -----------------------------------------------------

    def check(self) -> None:
        """Every target answers as it should before anything is timed."""
        for url, model in ((f"{self.gw}/v1/completions", "bench-stream"), (f"{self.gw}/v1/completions", "bench-mock"),
                           (f"{self.pt_nginx}/sse/v1/completions", "x"), (f"{self.pt_mock}/v1/completions", "x")):
            status, raw = post(url, request_body(True, model=model), self.key)
            events = [l for l in raw.split(b"\n\n") if l]
            if status != 200 or events[-1] != b"data: [DONE]" or len(events) != CHUNKS + 3:
                raise LoadError(f"{url} ({model}) streamed a wrong answer: {status} {raw[-300:]!r}")
            if url.startswith(self.gw) and b'"cost"' not in events[-2]:
                raise LoadError(f"{url}: no cost in the usage chunk: {events[-2]!r}")
        status, raw = post(f"{self.gw}/v1/completions", request_body(False), self.key)
        if status != 200 or b'"cost"' not in raw:
            raise LoadError(f"the gateway's JSON answer is wrong: {status} {raw!r}")

    def m1(self) -> None:
        targets = {UP: f"{self.nginx}/json/v1/completions", PT: f"{self.pt_nginx}/json/v1/completions",
                   GW: f"{self.gw}/v1/completions", NO_LEDGER: f"{self.gw_no_ledger}/v1/completions",
                   PER_MINUTE: f"{self.gw_per_minute}/v1/completions", **self.peer_targets(f"{self.nginx}/json/v1")}
        res = self.wrk_rounds(targets, request_body(False), 1)
        p50 = {k: [s["p50_us"] / 1000 for s in v] for k, v in res.items()}
        p99 = {k: [s["p99_us"] / 1000 for s in v] for k, v in res.items()}
        added = [g - p for g, p in zip(p50[GW], p50[PT])]
        p99_ratio = [g / p for g, p in zip(p99[GW], p99[PT])]
        rows = [[k, spread(p50[k], "{:.3f}"), spread(p99[k], "{:.3f}"),
                 spread([a - b for a, b in zip(p50[k], p50[UP])], "{:+.3f}") if k != UP else "",
                 spread([a - b for a, b in zip(p50[k], p50[PT])], "{:+.3f}") if k not in (UP, PT) else "",
                 spread([a / b for a, b in zip(p99[k], p99[PT])], "{:.2f}×") if k not in (UP, PT) else ""]
                for k in targets]
        self.sections.append("## M1 latency, non-streamed, one request at a time (wrk -c1)\n\n" + table(
            ["", "p50 ms", "p99 ms", "p50 added over upstream, ms", "p50 added over pass-through, ms",
             "p99 / pass-through's p99"], rows)
            + f"\n\n*{PER_MINUTE}*: requests and tokens per minute set on the org, too high to refuse "
            "anything (their windows kept per request). "
            f"*{NO_LEDGER}*: the M6 variant whose ledger stores nothing: the difference to kilnproxy is "
            "the wait for the row's commit (committed before the response ends; WAL checkpoints run "
            "in the background, never inside that commit).")
        self.goal("M1", "p50 added over pass-through ≤ 0.1 ms", spread(added, "{:.3f} ms"), median(added) <= 0.1)
        self.goal("M1", "p99 ≤ 2× the pass-through's p99", spread(p99_ratio, "{:.2f}×"), median(p99_ratio) <= 2)

    def throughput_table(self, res: dict, per: int, unit: str) -> tuple[list[list[str]], list[float], list[float]]:
        """Rows of requests (or chunks) per second, measured and per full core (1 / CPU time per
        request): on a shared machine the gateway's core is not all ours, so the CPU time is the
        steadier figure. Returns the rows and the per-round shares of the pass-through, both ways."""
        rate = {k: [s["rps"] * per for s in v] for k, v in res.items()}
        cpu = {k: [s["cpu_us"] for s in v] for k, v in res.items()}
        core = {k: [per * 1e6 / c for c in v] for k, v in cpu.items()}
        rows = [[k, spread(rate[k]), ratio(rate[k], rate[PT]) if k != UP else "",
                 spread([s["cpu_share"] * 100 for s in res[k]], "{:.0f}%"), spread(cpu[k], "{:.0f}"),
                 spread(core[k]), ratio(core[k], core[PT]) if k != UP else ""] for k in res]
        header = ["", f"{unit}/s", "% of pass-through", "CPU used", f"CPU µs per {'request' if per == 1 else 'stream'}",
                  f"{unit}/s per full core", "% of pass-through, per core"]
        measured = [g / p * 100 for g, p in zip(rate[GW], rate[PT])]
        by_core = [g / p * 100 for g, p in zip(core[GW], core[PT])]
        return [header] + rows, measured, by_core

    def m2(self) -> None:
        targets = {UP: f"{self.nginx}/json/v1/completions", PT: f"{self.pt_nginx}/json/v1/completions",
                   GW: f"{self.gw}/v1/completions", PER_MINUTE: f"{self.gw_per_minute}/v1/completions",
                   **self.peer_targets(f"{self.nginx}/json/v1")}
        res = self.wrk_rounds(targets, request_body(False), 64)
        rows, measured, by_core = self.throughput_table(res, 1, "requests")
        self.sections.append("## M2 throughput, non-streamed, 64 in flight (wrk -c64)\n\n" + table(rows[0], rows[1:])
                             + f"\n\nThe upstream row is nginx sharing CPU {self._load_cpu()} with wrk: its own "
                             "rate, a lower bound. *per full core*: 1 s / CPU time per request of that process.")
        self.goal("M2", "≥ 100% of pass-through requests/s (per full core; measured)",
                  f"{spread(by_core, '{:.0f}%')}; {spread(measured, '{:.0f}%')}", median(by_core) >= 100)

    def m3(self) -> None:
        body = request_body(True, model="bench-stream")
        targets = {UP: f"{self.nginx}/sse/v1/completions", PT: f"{self.pt_nginx}/sse/v1/completions",
                   PT_LINES: f"{self._pt_lines()}/sse/v1/completions", GW: f"{self.gw}/v1/completions",
                   GW_EVENT: f"{self._gw_event()}/v1/completions", **self.peer_targets(f"{self.nginx}/sse/v1")}
        res = self.wrk_rounds(targets, body, 32)
        rows, measured, by_core = self.throughput_table(res, CHUNKS, "chunks")
        event = [p["cpu_us"] / g["cpu_us"] * 100 for g, p in zip(res[GW_EVENT], res[PT])]  # per core
        self.sections.append(f"## M3 streamed throughput, {CHUNKS}-chunk streams, 32 in flight (wrk -c32)\n\n"
                             + table(rows[0], rows[1:])
                             + "\n\nEach stream: 64 text chunks, the finish chunk, the usage chunk "
                             "(the client asks for `include_usage`), `[DONE]`; nginx sends it in one go. "
                             "*pass-through*: copies each chunk as it arrives; *line by line*: the same, "
                             "writing each line as aiohttp's reader finds it (`bench/passthrough_lines.py`); "
                             "*no-op transform_event plugin*: `bench/plugins/noop_event.py`, every event "
                             "parsed and serialised again.")
        self.goal("M3", "≥ 80% of pass-through chunks/s (per full core; measured)",
                  f"{spread(by_core, '{:.0f}%')}; {spread(measured, '{:.0f}%')}", median(by_core) >= 80)
        self.goal("M3", "with a no-op transform_event plugin: ≥ 50% of pass-through chunks/s (per full core)",
                  spread(event, "{:.0f}%"), median(event) >= 50)

    def _pt_lines(self) -> str:
        """The line-by-line pass-through in front of nginx, on the pass-through's CPU; checked to stream
        what the other one does."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.pids[url] = self.procs.start("passthrough-lines", [sys.executable, str(HERE / "passthrough_lines.py"),
                                          "--port", str(port), "--upstream", self.nginx],
                                          cpus=os.sched_getaffinity(self.pids[self.pt_nginx]), port=port).pid
        body = request_body(True, model="x")
        if post(f"{url}/sse/v1/completions", body, self.key) != post(f"{self.pt_nginx}/sse/v1/completions", body,
                                                                        self.key):
            raise LoadError("the line-by-line pass-through streamed something else than the pass-through")
        return url

    def _gw_event(self) -> str:
        return self.gateway("kilnproxy-noop-event", plugin=str(HERE / "plugins" / "noop_event.py"))

    def m4(self) -> None:
        body = request_body(True, model="bench-mock")
        targets = {UP: f"{self.mock}/v1/completions", PT: f"{self.pt_mock}/v1/completions",
                   GW: f"{self.gw}/v1/completions", **self.peer_targets(f"{self.mock}/v1")}
        n = 48

        def latency(target, count):
            url, headers = target if isinstance(target, tuple) else (target, None)
            return stream_latency(url, body, self.key, count, 8, headers)
        res = self.rounds(targets, lambda t: latency(t, n), warm=lambda t: latency(t, 8))
        ttfb = {k: [median(r["ttfb_ms"]) for r in v] for k, v in res.items()}
        total = {k: [median(r["total_ms"]) for r in v] for k, v in res.items()}
        added = [g - p for g, p in zip(ttfb[GW], ttfb[PT])]
        rows = [[k, spread(ttfb[k], "{:.2f}"), spread(total[k], "{:.1f}"),
                 spread([a - b for a, b in zip(ttfb[k], ttfb[PT])], "{:+.2f}") if k not in (UP, PT) else "",
                 spread([a - b for a, b in zip(total[k], total[PT])], "{:+.2f}") if k not in (UP, PT) else ""]
                for k in targets]
        self.sections.append(f"## M4 streamed latency, {CHUNKS} chunks at 5 ms, 8 in flight ({n} streams a round, "
                             "the mock upstream)\n\n" + table(
                                 ["", "time to first byte ms", "total ms", "TTFB added over pass-through, ms",
                                  "total added over pass-through, ms"], rows)
                             + "\n\nMedians per round of the per-stream times, from an aiohttp client.")
        self.goal("M4", "TTFB added over pass-through ≤ 1 ms", spread(added, "{:.2f} ms"), median(added) <= 1)

    def m6(self) -> None:
        gws = {
            VARIANTS[0]: self.gw,
            VARIANTS[1]: self.gw_no_ledger,
            VARIANTS[2]: self.gateway("kilnproxy-noop-request", plugin=str(HERE / "plugins" / "noop_per_request.py")),
            VARIANTS[3]: self.gateway("kilnproxy-noop-all", plugin=str(HERE / "plugins" / "noop_all.py")),
        }
        urls = {k: f"{v}/v1/completions" for k, v in gws.items()}
        m2 = self.wrk_rounds(urls, request_body(False), 64)
        m3 = self.wrk_rounds(urls, request_body(True, model="bench-stream"), 32)
        full = VARIANTS[0]
        cpu2 = {k: [s["cpu_us"] for s in v] for k, v in m2.items()}
        cpu3 = {k: [s["cpu_us"] for s in v] for k, v in m3.items()}

        def price(cpu, k):  # extra CPU per request over the variant without it, % of the full gateway's
            return [(f - o) / f * 100 for f, o in zip(cpu[full], cpu[k])] if k == VARIANTS[1] else \
                [(o - f) / f * 100 for f, o in zip(cpu[full], cpu[k])]

        rows = [[k, spread([s["rps"] for s in m2[k]]), spread(cpu2[k], "{:.0f}"),
                 spread(price(cpu2, k), "{:+.1f}%") if k != full else "",
                 spread([s["rps"] * CHUNKS for s in m3[k]]), spread(cpu3[k], "{:.0f}"),
                 spread(price(cpu3, k), "{:+.1f}%") if k != full else ""] for k in gws]
        self.sections.append("## M6 the price of features: M2 and M3 per variant\n\n" + table(
            ["", "M2 requests/s", "M2 CPU µs per request", "M2 price", "M3 chunks/s", "M3 CPU µs per stream",
             "M3 price"], rows)
            + "\n\n*price*: CPU per request of the full gateway minus that of the variant without the feature "
            "(with the plugin: of the variant minus the full gateway), as a share of the full gateway's. "
            "*usage accounting off*: the same gateway with a ledger that stores nothing "
            "(`bench/gateway_no_ledger.py`). *no-op plugin*: `bench/plugins/`; implementing "
            "`transform_event` makes every event parsed and re-serialised.")
        cost = price(cpu2, VARIANTS[1])
        self.goal("M6", "usage accounting < 5% of M2 (CPU per request)", spread(cost, "{:.1f}%"), median(cost) < 5)
        hooks = price(cpu2, VARIANTS[2])
        self.goal("M6", "no-op per-request hooks, price in M2 (hooks nobody implements are never called)",
                  spread(hooks, "{:.1f}%"), None)

    def m5(self) -> None:
        # Each stream holds two sockets in the process under test (client side, upstream side).
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        streams = min(self.args.streams, (hard - 100) // 2)
        rows, results = [], {}
        for name in (GW, PT, *self.peers):
            headers, want = None, streams
            slow_port = free_port()
            slow = self.procs.start(f"slow-{name}", [sys.executable, str(HERE / "slow_upstream.py"),
                                                     "--port", str(slow_port)], port=slow_port)
            slow_url = f"http://127.0.0.1:{slow_port}"
            if name == GW:
                url = self.gateway("kilnproxy-m5", extra={"bench-slow": f"{slow_url}/v1"}) + "/v1/completions"
            elif name == PT:
                url = self.passthrough("passthrough-m5", slow_url) + "/v1/completions"
            else:  # a peer: fewer streams (per-stream memory is the figure), a process of its own
                want = min(streams, PEER_STREAMS)
                base = self.peer(name, {"bench-slow": f"{slow_url}/v1"})
                (url, headers), = self.peer_targets(f"{slow_url}/v1", {name: base}).values()
            pid = self.procs.running[-1][1].pid
            target = self.procs.running[-1][1]
            idle = peak_rss_kib(pid)[1]

            def at_open(opened):
                hwm, rss = peak_rss_kib(pid)
                post(f"{slow_url}/release")
                return {"rss_open": rss}

            try:
                r = hold_streams(url, request_body(True, model="bench-slow"), self.key, want, 4,
                                 at_open, timeout=300, headers=headers)
            except LoadError as exc:
                if name in (GW, PT):
                    raise
                print(f"M5 {name}: {exc}", flush=True)
                rows.append([name, f"failed: {str(exc)[:80]}", "", "", "", "", ""])
                self.procs.stop(target)
                self.procs.stop(slow)
                continue
            r["idle"], r["peak"] = idle, peak_rss_kib(pid)[0]
            self.procs.stop(target)
            self.procs.stop(slow)
            results[name] = r
            per = (r["rss_open"] - idle) / max(r["opened"], 1)
            rows.append([name, f"{r['opened']} / {want}", str(r["failed"]), f"{idle / 1024:.0f}",
                         f"{r['rss_open'] / 1024:.0f}", f"{r['peak'] / 1024:.0f}", f"{per:.1f}"])
            if r["errors"]:
                print(f"M5 {name}: errors {json.dumps(r['errors'])}", flush=True)
        limited = (f" The hard limit on open files here ({hard}) allows {streams} streams, not "
                   f"{self.args.streams}: each needs two sockets in the process under test."
                   if streams < self.args.streams else "")
        self.sections.append(f"## M5 memory: {streams} concurrent slow streams held open\n\n" + table(
            ["", "open at once", "failed", "RSS idle MiB", "RSS all open MiB", "peak RSS (VmHWM) MiB",
             "KiB per open stream"], rows)
            + "\n\nEach stream gets one chunk and waits; once every stream is open the slow upstream "
            "ends them all. One run per target (4 aiohttp client processes); the peers hold "
            f"{PEER_STREAMS} at most." + limited)
        gw = results[GW]
        ok = gw["failed"] == 0 and gw["opened"] == streams and gw["peak"] < 1024 * 1024
        per_stream = (gw["rss_open"] - gw["idle"]) / max(gw["opened"], 1)
        self.goal("M5", "≤ 30 KiB per open stream", f"{per_stream:.1f} KiB", per_stream <= 30)
        self.goal("M5", f"{streams} streams, none failed, peak RSS < 1 GiB",
                  f"{gw['failed']} failed, {gw['peak'] / 1024:.0f} MiB"
                  + (f" (all open at {self.args.streams}: about {(gw['idle'] + self.args.streams * (gw['rss_open'] - gw['idle']) / max(gw['opened'], 1)) / 1024:.0f} MiB)" if limited else ""), ok)

    def _load_cpu(self) -> str:
        import os
        return ",".join(map(str, sorted(os.sched_getaffinity(0))))
