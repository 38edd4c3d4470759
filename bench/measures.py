"""M1-M8: each runs its targets in rounds, in their order and reversed every other round (A B C, C B A, ...).

A target is listed beside the one its ratio is taken to (the gateway beside the pass-through, a
variant beside the gateway), so that the two runs of a ratio are always back to back, and which
of them goes first alternates: a machine whose speed drifts over seconds moves both alike."""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from statistics import median

import m7_fair
from loads import (
    LoadError,
    MetricsPeaks,
    get_json,
    hold_streams,
    post,
    stream_latency,
    wrk,
)
from peers import PORTKEY, litellm_headers, portkey_headers
from procs import free_port, peak_rss_kib
from report import ratio, spread, table
from runtime_keys import make_keys
from upstreams import (
    CHUNKS,
    EMBEDDING_DIMENSIONS,
    RESPONSES_EVENTS,
    embeddings_body,
    request_body,
    responses_body,
)

HERE = Path(__file__).resolve().parent
GW, PT, UP = "kilnproxy", "pass-through", "upstream"
PT_LINES = "pass-through, line by line"
GW_EVENT = "kilnproxy, no-op transform_event plugin"
NO_LEDGER = "kilnproxy, usage accounting off"
PER_MINUTE = "kilnproxy, per-minute limits on"  # requests and tokens per minute on the org, never reached
RUNTIME_KEY_COUNT = 10_000
RUNTIME_KEYS = f"kilnproxy, {RUNTIME_KEY_COUNT:,} runtime keys"  # in its SQLite store; the load sends one of them
TRACING = "kilnproxy, tracing on"  # every request traced, spans exported to a local OTLP/HTTP receiver
# M2 with three upstreams (three entries of nginx's one URL: every request answered alike), by each policy
ROUTED_LB = "kilnproxy, 3 upstreams, least_busy"
ROUTED_CA = "kilnproxy, 3 upstreams, cache_aware"
PEER_STREAMS = 2000  # M5: streams a peer holds open
SLOTS, QUEUE_CLIENTS, QUEUE_STREAMS = 4, 64, 128  # M7: an upstream's slots; clients at once; streams a round
QUEUED = f"kilnproxy, {SLOTS} slots, {QUEUE_CLIENTS} clients"
UNQUEUED = f"kilnproxy, no cap, {SLOTS} clients"
GW_JSON = "kilnproxy, /v1/completions (M2's)"
PT_JSON = "pass-through, /v1/completions"
GW_COMPLETIONS = "kilnproxy, /v1/completions stream (M3's)"
PT_COMPLETIONS = "pass-through, /v1/completions stream"
VARIANTS = ("kilnproxy, every feature on", "usage accounting off", "no-op plugin, per-request hooks",
            "no-op plugin, every hook")


class Bench:
    def __init__(self, args, procs, key, pids, *, nginx, mock, gateway, passthrough, peer=None, peers=()):
        self.args, self.procs, self.key, self.pids = args, procs, key, pids
        self.nginx, self.mock = nginx, mock
        self.gateway, self.passthrough = gateway, passthrough
        self.peer = peer  # peer(name, {model: upstream base}) -> base URL of a new process
        self.peers = {name: peer(name, {}) for name in peers}  # the peers that could be installed
        self.peer_pids = {pids[url] for url in self.peers.values()}
        self.gw = gateway("kilnproxy")
        self.pt_nginx = passthrough("passthrough-nginx", nginx)
        self.pt_mock = passthrough("passthrough-mock", mock)
        self.sections: list[str] = []
        self.goals: list[list[str]] = []
        self.sent: Counter[str] = Counter()  # requests wrk sent to each URL, warm-ups included

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
            for name in (names if r % 2 == 0 else names[::-1]):
                out[name].append(run(targets[name]))
        return out

    @contextmanager
    def alone(self, pid: int):
        """While ``pid`` is measured, the peers not measured are stopped (SIGSTOP): idle, LiteLLM's
        background loops still take about 15 % of the core they share with the process measured. The
        gateways are not: a health check's timeout passes while the process is stopped, and it would
        find its upstreams down when it runs again."""
        others = [p for p in self.peer_pids if p != pid]
        stopped = []
        try:
            for other in others:
                try:
                    os.kill(other, signal.SIGSTOP)
                    stopped.append(other)
                except ProcessLookupError:
                    pass
            yield
        finally:
            for other in stopped:
                try:
                    os.kill(other, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def wrk_rounds(self, targets: dict, body: bytes, connections: int,
                   bodies: dict[str, bytes] | None = None) -> dict[str, list]:
        """``targets``: name -> URL, or (URL, headers); ``bodies``: name -> a body of its own."""
        bodies = bodies or {}
        named = {name: (name, target) for name, target in targets.items()}

        def split(item):
            name, target = item
            url, headers = target if isinstance(target, tuple) else (target, None)
            return url, headers, bodies.get(name, body)

        def run(item):
            url, headers, sent = split(item)
            pid = self.pids["/".join(url.split("/")[:3])]
            with self.alone(pid):
                summary = wrk(url, sent, self.key, connections, self.args.seconds, pid, headers)
            self.sent[url] += summary["requests"]
            if summary["errors"]:
                raise LoadError(f"{url}: {summary['errors']} failed requests in {summary}")
            return summary

        def warm(item):
            url, headers, sent = split(item)
            with self.alone(self.pids["/".join(url.split("/")[:3])]):
                self.sent[url] += wrk(url, sent, self.key, connections, 1, headers=headers)["requests"]
        return self.rounds(named, run, warm=warm)

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

    @property
    def gw_runtime_keys(self) -> tuple[str, dict[str, str]]:
        """Issue 19's gateway: its SQLite store holds RUNTIME_KEY_COUNT runtime keys of the config's org
        "bench", made before it starts; the target (URL, headers) sends one of their secrets."""
        if not hasattr(self, "_gw_runtime_keys"):
            name = "kilnproxy-runtime-keys"
            db = self.procs.logdir / f"{name}.db"
            started = time.monotonic()
            secret = make_keys(db, "bench", RUNTIME_KEY_COUNT)
            self.keys_made_s = time.monotonic() - started
            url = f"{self.gateway(name, storage=f'path = {json.dumps(str(db))}')}/v1/completions"
            try:
                status, raw = post(url, request_body(False), secret)
            except OSError as exc:  # urllib's HTTPError too (a 401: the key was not loaded)
                raise LoadError(f"{url}: a runtime key's request failed: {exc}") from None
            if status != 200 or b'"cost"' not in raw:
                raise LoadError(f"{url}: a wrong answer to a runtime key: {status} {raw[:300]!r}")
            self._gw_runtime_keys = (url, {"Authorization": f"Bearer {secret}"})
        return self._gw_runtime_keys

    @property
    def gw_tracing(self) -> str:
        """Issue 21's gateway: ``[tracing]`` on, every trace kept, spans sent to ``otlp_sink.py`` (on the
        load CPU, as the upstreams are)."""
        if not hasattr(self, "_gw_tracing"):
            port = free_port()
            self.procs.start("otlp-sink", [sys.executable, str(HERE / "otlp_sink.py"), "--port", str(port)],
                             port=port)
            self.otlp = f"http://127.0.0.1:{port}"
            self._gw_tracing = self.gateway("kilnproxy-tracing", sections=(
                f'\n[tracing]\nenabled = true\nendpoint = "{self.otlp}/v1/traces"\nsample_ratio = 1.0\n'))
        return self._gw_tracing

    def gw_routed(self, routing: str) -> str:
        """Issue 40's gateways: model "bench" on three upstreams, the same nginx URL three times (so that
        both policies choose among three and every answer is the same), routed by ``routing``."""
        name = f"_gw_routed_{routing}"
        if not hasattr(self, name):
            url = f"{self.nginx}/json/v1"
            setattr(self, name, self.gateway(f"kilnproxy-{routing}", extra={
                "bench": {"urls": [url, url, url], "routing": routing}}))
        return getattr(self, name)

    def tracing_note(self) -> str:
        """What the receiver got so far against the requests sent to the tracing gateway, and the spans its
        log says it dropped (the last batch, up to 5 s of spans, may still be on its way)."""
        stats = get_json(f"{self.otlp}/stats")
        sent = self.sent[f"{self.gw_tracing}/v1/completions"]
        log = (self.procs.logdir / "kilnproxy-tracing.log").read_text(errors="replace")
        drops = [line for line in log.splitlines() if "span(s) dropped" in line]
        dropped = (f"its log reports dropped spans: {drops[-1].strip()[:200]}" if drops
                   else "its log reports no dropped span")
        return (f"The receiver has taken {stats['spans']:,} spans in {stats['exports']:,} exports "
                f"({stats['bytes'] / 1e6:.1f} MB) for {sent:,} requests sent to *{TRACING}* so far "
                f"({stats['spans'] / max(sent, 1):.2f} a request); {dropped}.")

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
        self.check_apis()

    def check_apis(self) -> None:
        """M8's answers: the embeddings JSON and the Responses stream, through the gateway and the pass-through."""
        for url in (f"{self.gw}/v1/embeddings", f"{self.pt_nginx}/json/v1/embeddings"):
            status, raw = post(url, embeddings_body(), self.key)
            answer = json.loads(raw) if status == 200 else {}
            if len(answer.get("data", [{}])[0].get("embedding", ())) != EMBEDDING_DIMENSIONS:
                raise LoadError(f"{url}: a wrong embeddings answer: {status} {raw[:300]!r}")
            if url.startswith(self.gw) and ("cost" not in answer["usage"] or answer["model"] != "bench-embed"):
                raise LoadError(f"{url}: no cost or the wrong model in the embeddings answer: {answer['usage']}")
        for url in (f"{self.gw}/v1/responses", f"{self.pt_nginx}/sse/v1/responses"):
            status, raw = post(url, responses_body(), self.key)
            frames = [f for f in raw.split(b"\n\n") if f]
            if (status != 200 or len(frames) != RESPONSES_EVENTS or not all(f.startswith(b"event: ") for f in frames)
                    or b"[DONE]" in raw or not frames[-1].startswith(b"event: response.completed\n")):
                raise LoadError(f"{url}: a wrong Responses stream: {status} {len(frames)} frames, {raw[-300:]!r}")
            if url.startswith(self.gw) and (b'"cost"' not in frames[-1] or b'"model":"bench-responses"' not in frames[0]):
                raise LoadError(f"{url}: no cost or the wrong model in the Responses stream: {frames[-1][-300:]!r}")

    def m1(self) -> None:
        targets = {UP: f"{self.nginx}/json/v1/completions", PT: f"{self.pt_nginx}/json/v1/completions",
                   GW: f"{self.gw}/v1/completions", NO_LEDGER: f"{self.gw_no_ledger}/v1/completions",
                   PER_MINUTE: f"{self.gw_per_minute}/v1/completions", RUNTIME_KEYS: self.gw_runtime_keys,
                   TRACING: f"{self.gw_tracing}/v1/completions", **self.peer_targets(f"{self.nginx}/json/v1")}
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
            "in the background, never inside that commit). " + self.variants_note() + " " + self.tracing_note())
        self.goal("M1", "p50 added over pass-through ≤ 0.1 ms", spread(added, "{:.3f} ms"), median(added) <= 0.1)
        self.goal("M1", "p99 ≤ 2× the pass-through's p99", spread(p99_ratio, "{:.2f}×"), median(p99_ratio) <= 2)
        limits = [m - g for m, g in zip(p50[PER_MINUTE], p50[GW])]
        self.goal("M1", "per-minute limits on: p50 within noise of kilnproxy without (difference)",
                  spread(limits, "{:+.3f} ms"), None)
        keys = [k - g for k, g in zip(p50[RUNTIME_KEYS], p50[GW])]
        self.goal("M1", f"{RUNTIME_KEY_COUNT:,} runtime keys in the store: p50 within noise of kilnproxy with "
                  "its config key (difference)", spread(keys, "{:+.3f} ms"), None)
        traced = [t - g for t, g in zip(p50[TRACING], p50[GW])]
        self.goal("M1", "tracing on: p50 added over tracing off (difference)", spread(traced, "{:+.3f} ms"), None)

    def variants_note(self) -> str:
        made = f" (made in {self.keys_made_s:.0f} s)" if hasattr(self, "keys_made_s") else ""
        return (f"*{RUNTIME_KEYS}*: the gateway's SQLite store holds {RUNTIME_KEY_COUNT:,} keys of the org, "
                f"created before it started{made} as the admin API creates them, and the load sends one of "
                "their secrets (kilnproxy authenticates from the store's snapshot in memory; its config has "
                f"one key, the one the other rows send). *{TRACING}*: `[tracing] enabled = true`, "
                "`sample_ratio = 1.0`, spans exported over OTLP/HTTP to a local receiver that counts them "
                f"and answers 200 (`bench/otlp_sink.py`, CPU {self._load_cpu()}); the exporter's thread is in "
                "the gateway's process and its CPU time.")

    def throughput_table(self, res: dict, per: int, unit: str, base: dict[str, str] | None = None,
                         gw: str = GW, pt: str = PT) -> tuple[list[list[str]], list[float], list[float]]:
        """Rows of requests (or chunks) per second, measured and per full core (1 / CPU time per
        request): on a shared machine the gateway's core is not all ours, so the CPU time is the
        steadier figure. ``base``: the baseline of each row (default: the pass-through; none for the
        upstream). Returns the rows and the per-round shares of ``gw`` to ``pt``, both ways."""
        base = base or {k: PT for k in res if k not in (UP, PT)}
        rate = {k: [s["rps"] * per for s in v] for k, v in res.items()}
        cpu = {k: [s["cpu_us"] for s in v] for k, v in res.items()}
        core = {k: [per * 1e6 / c for c in v] for k, v in cpu.items()}
        rows = [[k, spread(rate[k]), ratio(rate[k], rate[base[k]]) if k in base else "",
                 spread([s["cpu_share"] * 100 for s in res[k]], "{:.0f}%"), spread(cpu[k], "{:.0f}"),
                 spread(core[k]), ratio(core[k], core[base[k]]) if k in base else ""] for k in res]
        header = ["", f"{unit}/s", "% of pass-through", "CPU used", f"CPU µs per {'request' if per == 1 else 'stream'}",
                  f"{unit}/s per full core", "% of pass-through, per core"]
        measured = [g / p * 100 for g, p in zip(rate[gw], rate[pt])]
        by_core = [g / p * 100 for g, p in zip(core[gw], core[pt])]
        return [header] + rows, measured, by_core

    def m2(self) -> None:
        targets = {UP: f"{self.nginx}/json/v1/completions", PT: f"{self.pt_nginx}/json/v1/completions",
                   GW: f"{self.gw}/v1/completions", TRACING: f"{self.gw_tracing}/v1/completions",
                   PER_MINUTE: f"{self.gw_per_minute}/v1/completions", RUNTIME_KEYS: self.gw_runtime_keys,
                   ROUTED_LB: f"{self.gw_routed('least_busy')}/v1/completions",
                   ROUTED_CA: f"{self.gw_routed('cache_aware')}/v1/completions",
                   **self.peer_targets(f"{self.nginx}/json/v1")}
        res = self.wrk_rounds(targets, request_body(False), 64)
        rows, measured, by_core = self.throughput_table(res, 1, "requests")
        self.sections.append("## M2 throughput, non-streamed, 64 in flight (wrk -c64)\n\n" + table(rows[0], rows[1:])
                             + f"\n\nThe upstream row is nginx sharing CPU {self._load_cpu()} with wrk: its own "
                             "rate, a lower bound. *per full core*: 1 s / CPU time per request of that process. "
                             + self.variants_note() + " " + self.tracing_note() + f" *{ROUTED_LB}*, *{ROUTED_CA}*: "
                             "model `bench` on three upstreams (nginx's one URL three times: each policy chooses "
                             "among three, every answer alike), `routing` least_busy or cache_aware (the prompt's "
                             "affinity key computed per request, its order, the load bound).")
        self.goal("M2", "≥ 100% of pass-through requests/s (per full core; measured)",
                  f"{spread(by_core, '{:.0f}%')}; {spread(measured, '{:.0f}%')}", median(by_core) >= 100)
        limits = [g["cpu_us"] / m["cpu_us"] * 100 for g, m in zip(res[GW], res[PER_MINUTE])]
        self.goal("M2", "per-minute limits on: requests/s per core within noise of kilnproxy without",
                  spread(limits, "{:.0f}%"), None)
        keys = [g["cpu_us"] / k["cpu_us"] * 100 for g, k in zip(res[GW], res[RUNTIME_KEYS])]
        self.goal("M2", f"{RUNTIME_KEY_COUNT:,} runtime keys in the store: requests/s per core within noise of "
                  "kilnproxy with its config key", spread(keys, "{:.0f}%"), None)
        traced = [g["cpu_us"] / t["cpu_us"] * 100 for g, t in zip(res[GW], res[TRACING])]
        traced_measured = [t["rps"] / g["rps"] * 100 for g, t in zip(res[GW], res[TRACING])]
        self.goal("M2", "tracing on (exporting to a local receiver): requests/s within 10% of off "
                  "(per full core; measured)",
                  f"{spread(traced, '{:.0f}%')}; {spread(traced_measured, '{:.0f}%')}", median(traced) >= 90)
        routed = [lb["cpu_us"] / ca["cpu_us"] * 100 for lb, ca in zip(res[ROUTED_LB], res[ROUTED_CA])]
        routed_measured = [ca["rps"] / lb["rps"] * 100 for lb, ca in zip(res[ROUTED_LB], res[ROUTED_CA])]
        self.goal("M2", "routing = \"cache_aware\": requests/s within 3% of least_busy on the same three upstreams "
                  "(per full core; measured)",
                  f"{spread(routed, '{:.1f}%')}; {spread(routed_measured, '{:.1f}%')}", median(routed) >= 97)

    def m3(self) -> None:
        body = request_body(True, model="bench-stream")
        targets = {UP: f"{self.nginx}/sse/v1/completions", PT_LINES: f"{self._pt_lines()}/sse/v1/completions",
                   PT: f"{self.pt_nginx}/sse/v1/completions", GW: f"{self.gw}/v1/completions",
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
        self.goal("M3", "with a no-op transform_event plugin: ≥ 55% of pass-through chunks/s (per full core)",
                  spread(event, "{:.0f}%"), median(event) >= 55)

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

    def m7(self) -> None:
        """Issue 20's shape: 64 clients on an upstream with 4 slots, M4's streams (64 chunks at 5 ms from
        the mock upstream). The time a request waits for a slot is its extra time to first byte over the
        same streams unqueued (4 clients, the upstream as busy: 4 at once), round by round."""
        mocks = {}
        for name in ("slots", "free"):
            port = free_port()
            self.procs.start(f"mock-{name}", [sys.executable, "-m", "kilnproxy", "mock-upstream", "--port", str(port),
                                              "--delay", "0.005"], port=port)
            mocks[name] = f"http://127.0.0.1:{port}"
        gw = self.gateway("kilnproxy-slots", extra={
            "bench-slots": {"url": f"{mocks['slots']}/v1", "max_in_flight": SLOTS, "queue_timeout": 600},
            "bench-free": f"{mocks['free']}/v1"}, sections=m7_fair.SECTIONS)
        targets = {QUEUED: ("bench-slots", QUEUE_STREAMS, QUEUE_CLIENTS),
                   UNQUEUED: ("bench-free", QUEUE_STREAMS // 4, SLOTS)}
        peaks = {}

        def latency(target, warm=False):
            model, n, clients = target
            body = request_body(True, model=model)
            url = f"{gw}/v1/completions"
            if warm or model != "bench-slots":
                return stream_latency(url, body, self.key, clients if warm else n, clients)
            with MetricsPeaks(gw, ("kilnproxy_upstream_queued_requests", "kilnproxy_upstream_slots_busy"),
                              mocks["slots"].split("//")[1]) as sampled:
                out = stream_latency(url, body, self.key, n, clients)
            for name, value in sampled.peaks.items():
                peaks[name] = max(peaks.get(name, 0), value)
            return out
        res = self.rounds(targets, latency, warm=lambda t: latency(t, warm=True))
        max_active = {name: get_json(f"{url}/mock/stats")["max_active"] for name, url in mocks.items()}
        base = [median(r["ttfb_ms"]) for r in res[UNQUEUED]]
        waits = [[t - b for t in r["ttfb_ms"]] for r, b in zip(res[QUEUED], base)]  # per round
        q50 = [percentile(w, 50) for w in waits]
        q99 = [percentile(w, 99) for w in waits]

        expected = [(QUEUE_CLIENTS - SLOTS) / SLOTS * percentile(r["total_ms"], 50) for r in res[UNQUEUED]]
        rate = {k: [len(r["ttfb_ms"]) / r["wall_ms"] * 1000 for r in v] for k, v in res.items()}
        use = [q / u * 100 for q, u in zip(rate[QUEUED], rate[UNQUEUED])]

        def row(name, at_upstream):
            r = res[name]
            cells = [name, spread([percentile(x["ttfb_ms"], 50) for x in r], "{:.1f}"),
                     spread([percentile(x["ttfb_ms"], 99) for x in r], "{:.1f}"),
                     spread([percentile(x["total_ms"], 50) for x in r], "{:.1f}"), spread(rate[name], "{:.2f}")]
            if name == QUEUED:
                cells += [spread(use, "{:.0f}%"), spread(q50, "{:.0f}"), spread(q99, "{:.0f}")]
            else:
                cells += ["", "", ""]
            return cells + [str(at_upstream)]
        rows = [row(QUEUED, max_active["slots"]), row(UNQUEUED, max_active["free"])]
        queued, busy = peaks.get("kilnproxy_upstream_queued_requests", 0), peaks.get("kilnproxy_upstream_slots_busy", 0)
        self.sections.append(
            f"## M7 upstream slots: {QUEUE_CLIENTS} clients, an upstream with max_in_flight = {SLOTS} "
            f"({QUEUE_STREAMS} streams a round, {CHUNKS} chunks at 5 ms, the mock upstream)\n\n" + table(
                ["", "time to first byte p50 ms", "TTFB p99 ms", "total p50 ms", "streams/s",
                 "streams/s, % of unqueued", "time in queue p50 ms", "time in queue p99 ms",
                 "most at the upstream at once"], rows)
            + f"\n\n*time in queue*: a stream's time to first byte minus the median of *{UNQUEUED}* in the "
            f"same round (the same streams with the upstream as busy, {SLOTS} at once, and no wait), from an "
            f"aiohttp client; `queue_timeout = 600`. *most at the upstream at once*: the mock's `/mock/stats` "
            f"`max_active` over the whole measurement, warm-up included. *streams/s*: streams a round / "
            f"the round's time; with the upstream {SLOTS} at once in both, the queued run's share of the "
            f"unqueued one is how well freed slots are handed on (the first and last streams of a round "
            f"run with fewer than {SLOTS} in flight in both). The gateway's `/metrics`, polled "
            f"every 0.1 s: at most {queued:.0f} requests queued and {busy:.0f} slots busy. In a closed loop each "
            f"request, once the first {QUEUE_CLIENTS} have started, waits for the {QUEUE_CLIENTS - SLOTS} ahead of "
            f"it: ({QUEUE_CLIENTS} − {SLOTS}) / {SLOTS} × the stream's total time (unqueued, p50) = "
            f"{spread(expected, '{:.0f}')} ms; the first {QUEUE_CLIENTS} of a round wait from 0 to that.")
        self.goal("M7", f"{QUEUE_CLIENTS} clients on {SLOTS} slots: time in queue p50; p99",
                  f"{spread(q50, '{:.0f} ms')}; {spread(q99, '{:.0f} ms')}", None)
        self.goal("M7", f"{QUEUE_CLIENTS} clients on {SLOTS} slots: streams/s, % of the unqueued run's",
                  spread(use, "{:.0f}%"), None)
        self.goal("M7", f"the upstream never above {SLOTS} at once", f"{max_active['slots']} at most",
                  max_active["slots"] <= SLOTS and busy <= SLOTS)
        m7_fair.measure(self, gw, self.procs.logdir / "kilnproxy-slots.db", mocks["slots"].split("//")[1], request_body(True, model="bench-slots"),
                        QUEUE_CLIENTS, SLOTS, median(base), median(percentile(r["total_ms"], 50) for r in res[UNQUEUED]),
                        median(percentile(r["ttfb_ms"], 99) for r in res[UNQUEUED]))

    def m8(self) -> None:
        """Issue 23's endpoints: /v1/embeddings in M2's shape, the Responses API stream in M3's, the latter
        beside the completions relay of the same run."""
        emb = {UP: f"{self.nginx}/json/v1/embeddings", PT: f"{self.pt_nginx}/json/v1/embeddings",
               GW: f"{self.gw}/v1/embeddings", PT_JSON: f"{self.pt_nginx}/json/v1/completions",
               GW_JSON: f"{self.gw}/v1/completions"}
        completion = request_body(False)
        res = self.wrk_rounds(emb, embeddings_body(), 64, bodies={PT_JSON: completion, GW_JSON: completion})
        rows, measured, by_core = self.throughput_table(res, 1, "requests", base={GW: PT, GW_JSON: PT_JSON})
        rows[0][2:] = ["% of its pass-through", *rows[0][3:6], "% of its pass-through, per core"]
        cpu = {k: [s["cpu_us"] for s in v] for k, v in res.items()}
        extra = [(e - pe) - (c - pc) for e, pe, c, pc in zip(cpu[GW], cpu[PT], cpu[GW_JSON], cpu[PT_JSON])]
        self.sections.append("## M8a embeddings, non-streamed, 64 in flight (wrk -c64)\n\n"
                             + table(rows[0], rows[1:])
                             + f"\n\nOne input, one {EMBEDDING_DIMENSIONS}-float vector back (16 KB of JSON, "
                             "vLLM's shape), nginx's canned answer; the completions rows are M2's, in the same "
                             "run. What kilnproxy adds to an embeddings request (CPU over its pass-through) "
                             "minus what it adds to a completion: "
                             f"{spread(extra, '{:+.0f}')} µs.")
        self.goal("M8", "embeddings: requests/s, % of the pass-through's (per full core; measured)",
                  f"{spread(by_core, '{:.0f}%')}; {spread(measured, '{:.0f}%')}", None)
        streams = {UP: f"{self.nginx}/sse/v1/responses", PT: f"{self.pt_nginx}/sse/v1/responses",
                   GW: f"{self.gw}/v1/responses", GW_COMPLETIONS: f"{self.gw}/v1/completions",
                   PT_COMPLETIONS: f"{self.pt_nginx}/sse/v1/completions"}
        completions = request_body(True, model="bench-stream")
        res = self.wrk_rounds(streams, responses_body(), 32,
                              bodies={PT_COMPLETIONS: completions, GW_COMPLETIONS: completions})
        rows, measured, by_core = self.throughput_table(res, CHUNKS, "chunks",
                                                        base={GW: PT, GW_COMPLETIONS: PT_COMPLETIONS})
        rows[0][2:] = ["% of its pass-through", *rows[0][3:6], "% of its pass-through, per core"]
        core = {k: [CHUNKS * 1e6 / s["cpu_us"] for s in v] for k, v in res.items()}
        relay = [r / c * 100 for r, c in zip(core[GW], core[GW_COMPLETIONS])]
        relay_measured = [r["rps"] / c["rps"] * 100 for r, c in zip(res[GW], res[GW_COMPLETIONS])]
        self.sections.append(f"## M8b the Responses API stream, {CHUNKS} text deltas, 32 in flight (wrk -c32)\n\n"
                             + table(rows[0], rows[1:])
                             + f"\n\nA Responses stream: {RESPONSES_EVENTS} `event:` + `data:` pairs "
                             f"(`response.created` ... {CHUNKS} `response.output_text.delta` ... "
                             "`response.completed` with the usage), no `[DONE]`, 16 KB; the completions "
                             "stream is M3's (13 KB). *chunks*: the text deltas, 64 a stream in both. "
                             "The Responses stream through kilnproxy per core, as a share of the completions "
                             f"relay's in the same run: {spread(relay, '{:.0f}%')} (measured: "
                             f"{spread(relay_measured, '{:.0f}%')}).")
        self.goal("M8", "Responses stream ≥ 80% of the completions relay's chunks/s (per full core; measured)",
                  f"{spread(relay, '{:.0f}%')}; {spread(relay_measured, '{:.0f}%')}", median(relay) >= 80)

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


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
