"""``GET /metrics``: what the gateway is doing, in Prometheus' text format.

Two halves, so that the request path pays almost nothing:

- ``RequestStats.observe(row, record)`` runs once per request, where its usage
  row is built (``Gateway.row_observers``). It adds to plain dicts keyed by
  label tuples: no lock, no metric objects, no formatting.
- ``GatewayCollector`` turns those dicts, and state the gateway already keeps
  (in-flight counts, upstream health, the ledger's queue), into metric
  families when Prometheus scrapes. ``prometheus_client`` writes the format.

Every app has its own ``CollectorRegistry`` (never the global one): several
gateways can run in one process.
"""

from __future__ import annotations

import re
import time
from bisect import bisect_left
from typing import Iterable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..proxy.gateway import Gateway
from ..proxy.request_record import RequestRecord, shown_url

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
MAX_ERROR_CODES = 100  # distinct ``code`` label values; later new codes are counted as OTHER_CODE
OTHER_CODE = "other"
_CODE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # what an error code looks like; anything else is OTHER_CODE


class Histogram:
    """Bucket counts (not cumulative) and a sum; ``observe`` is one bisect and two adds."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class RequestStats:
    """Per-request counters, updated from each finished usage row.

    The ``model`` label is the catalog id, or ``""`` when the request never
    got that far: a client-sent name must not become a label (cardinality).
    The ``code`` label is the error code, the gateway's own or the upstream's
    (which may be made of what the client sent): one that does not look like
    a code (``_CODE``), or a new one once ``MAX_ERROR_CODES`` are labels, is
    counted as ``OTHER_CODE``.
    """

    def __init__(self) -> None:
        self.requests: dict[tuple, _Series] = {}  # (org, model, endpoint, status)
        self.errors: dict[tuple, int] = {}        # (org, model, endpoint, code)
        self.disconnects: dict[tuple, int] = {}   # (org, model, endpoint)
        self.tokens: dict[tuple, list] = {}       # (org, model) -> [prompt, completion, cached, cost]
        self.duration: dict[tuple, Histogram] = {}  # (model, endpoint)
        self.ttft: dict[tuple, Histogram] = {}
        self.commits = Histogram(COMMIT_BUCKETS)
        self.codes: set[str] = set()  # the error codes that are labels

    def observe(self, row: dict, record: RequestRecord) -> None:
        org, model, endpoint = row["org"], record.call.model or "", row["endpoint"]
        series = self.requests.get((org, model, endpoint, row["status"]))
        if series is None:
            series = self._series(org, model, endpoint, row["status"])
        series.n += 1
        if row["error_code"] is not None:
            key = (org, model, endpoint, self._code(row["error_code"]))
            self.errors[key] = self.errors.get(key, 0) + 1
        if row["disconnected"]:
            key = (org, model, endpoint)
            self.disconnects[key] = self.disconnects.get(key, 0) + 1
        sums = series.sums
        if sums is not None:
            sums[0] += row["prompt_tokens"]
            sums[1] += row["completion_tokens"]
            sums[2] += row["cached_tokens"]
            sums[3] += row["cost"]
        series.duration.observe(row["duration_ms"] / 1000)
        ttft = row["ttft_ms"]
        if ttft is not None:
            hist = series.ttft
            if hist is None:  # made at the first time to first token of its (model, endpoint), as listed
                key = (model, endpoint)
                hist = self.ttft.get(key)
                if hist is None:
                    hist = self.ttft[key] = Histogram(TTFT_BUCKETS)
                series.ttft = hist
            hist.observe(ttft / 1000)

    def _series(self, org: str, model: str, endpoint: str, status: int) -> "_Series":
        """The first request of these labels: its count, and the sums and histograms it adds to (made
        now if no request made them, so that each table lists its labels in the order first seen)."""
        sums = None
        if model:
            sums = self.tokens.get((org, model))
            if sums is None:
                sums = self.tokens[(org, model)] = [0, 0, 0, 0.0]
        duration = self.duration.get((model, endpoint))
        if duration is None:
            duration = self.duration[(model, endpoint)] = Histogram(DURATION_BUCKETS)
        series = _Series(sums, duration, self.ttft.get((model, endpoint)))
        self.requests[(org, model, endpoint, status)] = series
        return series

    def _code(self, code: str) -> str:
        """``code`` as a label value: itself, or ``OTHER_CODE``."""
        codes = self.codes
        if code in codes:
            return code
        if len(codes) >= MAX_ERROR_CODES or not _CODE.fullmatch(code):
            return OTHER_CODE
        codes.add(code)
        return code


class _Series:
    """One (org, model, endpoint, status)'s request count, with what its requests add to, found once."""

    __slots__ = ("n", "sums", "duration", "ttft")

    def __init__(self, sums: list | None, duration: Histogram, ttft: Histogram | None):
        self.n = 0
        self.sums = sums  # its (org, model)'s token and cost sums; None without a model
        self.duration = duration  # its (model, endpoint)'s
        self.ttft = ttft  # the same, once there is one


class ReloadStats:
    """Config reloads, counted by ``kilnproxy.ops.reload``."""

    def __init__(self) -> None:
        self.ok = 0
        self.refused = 0
        self.last_ok = time.time()


class GatewayCollector:
    """A ``prometheus_client`` collector that reads the gateway at scrape time."""

    def __init__(self, gw: Gateway, stats: RequestStats, reloads: ReloadStats, checks: dict[str, int]):
        self.gw = gw
        self.stats = stats
        self.reloads = reloads
        self.check_failures = checks  # upstream base URL -> failed active checks (kilnproxy.ops.health)

    def collect(self) -> Iterable[Metric]:
        yield from self._requests()
        yield from self._usage()
        yield from self._in_flight()
        yield from self._upstreams()
        yield from self._ledger()
        yield from self._config()

    def _requests(self) -> Iterable[Metric]:
        s = self.stats
        m = CounterMetricFamily("kilnproxy_requests", "Requests to the completion endpoints, by HTTP status sent.",
                                labels=("org", "model", "endpoint", "status"))
        for (org, model, endpoint, status), series in list(s.requests.items()):
            m.add_metric((org, model, endpoint, str(status)), series.n)
        yield m
        m = CounterMetricFamily("kilnproxy_request_errors", "Requests that ended with an error code "
                                "(mid-stream errors included).", labels=("org", "model", "endpoint", "code"))
        for labels, n in list(s.errors.items()):
            m.add_metric(labels, n)
        yield m
        m = CounterMetricFamily("kilnproxy_client_disconnects", "Requests whose client went away early.",
                                labels=("org", "model", "endpoint"))
        for labels, n in list(s.disconnects.items()):
            m.add_metric(labels, n)
        yield m
        for name, doc, table in (
            ("kilnproxy_request_duration_seconds", "Whole request, as recorded in its usage row.", s.duration),
            ("kilnproxy_time_to_first_token_seconds", "Time to the upstream's first byte.", s.ttft),
        ):
            m = HistogramMetricFamily(name, doc, labels=("model", "endpoint"))
            for labels, hist in list(table.items()):
                m.add_metric(labels, hist.buckets(), hist.total)
            yield m

    def _usage(self) -> Iterable[Metric]:
        families = [
            CounterMetricFamily("kilnproxy_prompt_tokens", "Prompt tokens.", labels=("org", "model")),
            CounterMetricFamily("kilnproxy_completion_tokens", "Completion tokens.", labels=("org", "model")),
            CounterMetricFamily("kilnproxy_cached_prompt_tokens", "Prompt tokens served from the upstream's "
                                "cache.", labels=("org", "model")),
            CounterMetricFamily("kilnproxy_cost_usd", "Cost charged to the org, USD.", labels=("org", "model")),
        ]
        for labels, sums in list(self.stats.tokens.items()):
            for family, value in zip(families, sums):
                family.add_metric(labels, value)
        yield from families
        by_upstream = [
            CounterMetricFamily("kilnproxy_upstream_prompt_tokens", "Prompt tokens, as each upstream reported them.",
                                labels=("model", "upstream")),
            CounterMetricFamily("kilnproxy_upstream_cached_tokens", "Prompt tokens each upstream reported served "
                                "from its prompt cache.", labels=("model", "upstream")),
        ]
        for labels, counts in list(self.gw.upstream_tokens.counts.items()):  # the inspector reads them too
            for family, value in zip(by_upstream, counts):
                family.add_metric(labels, value)
        yield from by_upstream
        credits = self.gw.credits
        m = GaugeMetricFamily("kilnproxy_org_credits_remaining_usd", "Credits left, USD.", labels=("org",))
        granted = GaugeMetricFamily("kilnproxy_org_credits_granted_usd", "Credits granted to the org (config "
                                    "and grants), USD.", labels=("org",))
        for org in self.gw.org_limits:
            m.add_metric((org,), credits.remaining(org))
            granted.add_metric((org,), credits.granted.get(org, 0.0))
        yield m
        yield granted

    def _in_flight(self) -> Iterable[Metric]:
        gw = self.gw
        m = GaugeMetricFamily("kilnproxy_in_flight_requests", "Requests in flight, by org.", labels=("org",))
        for org in sorted(set(gw.org_limits) | set(_counts(gw.admission))):
            m.add_metric((org,), gw.admission.count(org))
        yield m
        m = GaugeMetricFamily("kilnproxy_org_max_in_flight", "The org's in-flight limit.", labels=("org",))
        for org in gw.org_limits:
            m.add_metric((org,), gw.limit_for(org))
        yield m

    def _upstreams(self) -> Iterable[Metric]:
        now = time.monotonic()
        labels = ("model", "upstream")
        up = GaugeMetricFamily("kilnproxy_upstream_up", "1 when the upstream is not marked down.", labels=labels)
        busy = GaugeMetricFamily("kilnproxy_upstream_in_flight_requests", "Requests in flight to the upstream.",
                                 labels=labels)
        failures = CounterMetricFamily("kilnproxy_upstream_failures", "Requests the upstream failed before "
                                       "answering (refused, timed out, 5xx).", labels=labels)
        for route in list(self.gw.routes.values()):
            for u in route.upstreams:
                url = shown_url(u.base_url)  # every upstream label without userinfo, as in the rows
                up.add_metric((route.id, url), 1 if u.is_up(now) else 0)
                busy.add_metric((route.id, url), u.in_flight)
                failures.add_metric((route.id, url), u.failures_total)
        yield from self._slots()
        checks = CounterMetricFamily("kilnproxy_upstream_health_check_failures", "Failed active health checks.",
                                     labels=("upstream",))
        for url, n in list(self.check_failures.items()):
            checks.add_metric((shown_url(url),), n)
        yield from (up, busy, failures, checks)

    def _slots(self) -> Iterable[Metric]:
        pools = {u.slots.url: u.slots for route in list(self.gw.routes.values()) for u in route.upstreams}
        busy = GaugeMetricFamily("kilnproxy_upstream_slots_busy", "Slots of the upstream URL in use, every "
                                 "model's requests counted (this replica).", labels=("upstream",))
        limit = GaugeMetricFamily("kilnproxy_upstream_max_in_flight", "The upstream's max_in_flight (upstreams "
                                  "that have one).", labels=("upstream",))
        queued = GaugeMetricFamily("kilnproxy_upstream_queued_requests", "Requests waiting for a slot of the "
                                   "upstream.", labels=("upstream",))
        load = GaugeMetricFamily("kilnproxy_upstream_load", "The upstream's load as routing last read it: the "
                                 "larger of this replica's requests to it and the server's own count (load_poll).",
                                 labels=("upstream",))
        now = time.monotonic()
        for url, pool in pools.items():
            shown = (shown_url(url),)
            load.add_metric(shown, pool.load_at(now))
            busy.add_metric(shown, pool.busy)
            queued.add_metric(shown, pool.queued())
            if pool.limit is not None:
                limit.add_metric(shown, pool.limit)
        fallbacks = CounterMetricFamily("kilnproxy_fallbacks", "Requests sent to a fallback model, by the model "
                                        "asked for and the fallback.", labels=("from_model", "to_model"))
        for (source, target), n in list(self.gw.fallback_counts.items()):
            fallbacks.add_metric((source, target), n)
        yield from (busy, limit, queued, load, fallbacks)

    def _ledger(self) -> Iterable[Metric]:
        ledger = self.gw.ledger
        yield GaugeMetricFamily("kilnproxy_ledger_queue_depth", "Usage rows waiting for their commit.",
                                value=ledger.queue_depth())
        yield CounterMetricFamily("kilnproxy_ledger_commits", "Group commits of usage rows.", value=ledger.commits)
        stats = ledger.stats()
        if "commit_failures" in stats:
            yield CounterMetricFamily("kilnproxy_ledger_commit_failures", "Commits of usage rows that failed "
                                      "(and were retried).", value=stats["commit_failures"])
        yield GaugeMetricFamily("kilnproxy_store_up", "1 while the store takes usage rows: PostgreSQL answers, "
                                "or the SQLite file has been written within the last seconds.",
                                value=int(ledger.available))
        if "refused_unrecorded" in stats:
            yield CounterMetricFamily("kilnproxy_ledger_refused_unrecorded", "Requests refused with 503 "
                                      "store_unavailable without a usage row: too many rows waited (in memory, "
                                      "or in the spool).",
                                      value=stats["refused_unrecorded"])
        if hasattr(ledger, "spooled"):  # a shared store (PostgreSQL)
            yield GaugeMetricFamily("kilnproxy_store_spooled_rows",
                                    "Usage rows kept in the local spool until the store answers.",
                                    value=ledger.spooled)
            yield CounterMetricFamily("kilnproxy_store_replica_lost_rows",
                                      "Requests of dead replicas recorded as replica_lost by this replica.",
                                      value=ledger.heartbeat.reaped)
        hist = self.stats.commits
        m = HistogramMetricFamily("kilnproxy_ledger_commit_seconds", "Time to write and commit one batch of rows.")
        m.add_metric((), hist.buckets(), hist.total)
        yield m

    def _config(self) -> Iterable[Metric]:
        m = CounterMetricFamily("kilnproxy_config_reloads", "Config reloads, by result.", labels=("result",))
        m.add_metric(("ok",), self.reloads.ok)
        m.add_metric(("refused",), self.reloads.refused)
        yield m
        yield GaugeMetricFamily("kilnproxy_config_last_reload_success_timestamp_seconds",
                                "When the config in force was loaded (Unix time).", value=self.reloads.last_ok)
        yield GaugeMetricFamily("kilnproxy_maintenance", "1 while maintenance mode is on.",
                                value=int(self.gw.config.maintenance.enabled))
        exporter = getattr(self.gw.tracer, "exporter", None)  # [tracing] on (kilnproxy.ops.tracing.export)
        if exporter is not None:
            yield CounterMetricFamily("kilnproxy_trace_spans_exported", "Spans sent to the OTLP endpoint.",
                                      value=exporter.exported)
            yield CounterMetricFamily("kilnproxy_trace_spans_dropped", "Spans dropped: the OTLP endpoint did not "
                                      "take them, or the queue to it was full.", value=exporter.dropped)


def _counts(inflight) -> dict[str, int]:
    snapshot = getattr(inflight, "snapshot", None)
    return snapshot() if snapshot is not None else {}


def build_registry(gw: Gateway, stats: RequestStats, reloads: ReloadStats, checks: dict[str, int],
                   ) -> CollectorRegistry:
    """This gateway's registry: its collector and the process' own (memory, CPU, open files)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gw, stats, reloads, checks))
    ProcessCollector(registry=registry)
    _time_commits(gw, stats.commits)
    return registry


def _time_commits(gw: Gateway, hist: Histogram) -> None:
    """Observe each group commit's duration, chained on the ledger's commit listener."""
    ledger = gw.ledger
    if not hasattr(ledger, "last_commit_seconds") or not hasattr(ledger, "on_commit"):
        return
    listener = ledger.on_commit

    def committed(rows):
        hist.observe(ledger.last_commit_seconds)
        if listener is not None:
            listener(rows)

    ledger.on_commit = committed
