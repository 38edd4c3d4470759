"""The Batch API's part of ``/metrics``: lines ended by outcome, the batch queue's depth, batches run.

Read from this replica's runner (``kilnproxy.batches.runner``) at scrape time; nothing before the
runner has started (the server listens first).
"""

from __future__ import annotations

from typing import Iterable

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..batches.service import BATCHES


class BatchCollector:
    def __init__(self, app: web.Application):
        self.app = app

    def collect(self) -> Iterable[Metric]:
        svc = self.app.get(BATCHES)
        runner = None if svc is None else svc.runner
        if runner is None:
            return
        lines = CounterMetricFamily("kilnproxy_batch_lines", "Lines of batches ended on this replica, by outcome "
                                    "(completed: answered 2xx; failed: any other final answer; retried: a 429 or 503, "
                                    "tried again later).", labels=("outcome",))
        for outcome, n in sorted(runner.counts.items()):
            lines.add_metric((outcome,), n)
        yield lines
        yield GaugeMetricFamily("kilnproxy_batch_queue_depth", "Lines waiting to run in the batches this replica "
                                "runs (read every poll of its runner).", value=runner.queue_depth)
        yield GaugeMetricFamily("kilnproxy_batch_lines_in_flight", "Lines of batches this replica runs now.",
                                value=runner.config.batches.max_in_flight - runner.capacity.free)
        yield GaugeMetricFamily("kilnproxy_batches_running", "Batches whose lease this replica holds.",
                                value=len(runner.jobs))
