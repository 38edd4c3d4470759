"""``BatchRunner``: this replica's runner of batches, one task, started with the gateway.

It takes the lease of each open batch no live runner holds (``BatchStore.claimable``, ``lease``), runs
each as a ``BatchJob`` and renews their leases every ``POLL_SECONDS`` (a lease lasts ``[storage]
replica_timeout_seconds``: a runner lost, its batches are taken over after that). On SQLite, the file's
one gateway frees every lease at start-up: they were a stopped process's. A lease it cannot renew
stops its job from taking lines. ``stop`` (the app's shutdown) stops taking lines; the lines in flight
finish through the server's own grace period, then the leases are released.

``capacity``: the replica's ``[batches] max_in_flight`` lines at once, across its batches. ``counts``:
lines ended here by outcome (``completed``, ``failed``, ``retried``), and ``queue_depth``, the lines
waiting in the batches it runs (``/metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import os

from ..proxy.tenancy.changes import is_store_outage
from ..tasks import cancelled, woken
from .job import BatchJob
from .line_sender import LineSender

log = logging.getLogger("kilnproxy.batches")

POLL_SECONDS = 1.0
STOP_SECONDS = 5.0  # how long a stop waits for a job's last writes
MAX_JOBS = 64  # batches one replica runs at once (their lines share its max_in_flight)


class Capacity:
    """Lines this replica may still start (``[batches] max_in_flight`` at most in flight)."""

    def __init__(self, size: int, freed):
        self.free = size
        self._freed = freed

    def take(self, wanted: int) -> int:
        taken = min(wanted, self.free)
        self.free -= taken
        return taken

    def give_back(self, count: int) -> None:
        if count:
            self.free += count
            self._freed()


class BatchRunner:
    def __init__(self, svc, base_url: str):
        self.svc = svc
        self.config = svc.config
        self.id = f"runner-{os.urandom(8).hex()}"
        self.credential = svc.gw.batch_credential
        self.sender = LineSender(self.credential, base_url, self.config.batches.max_in_flight)
        self.capacity = Capacity(self.config.batches.max_in_flight, self._wake_jobs)
        self.lease_seconds = self.config.storage.replica_timeout_seconds
        self.poll = min(POLL_SECONDS, self.lease_seconds / 3)
        self.jobs: dict[str, tuple[BatchJob, asyncio.Task]] = {}
        self.stopping = False
        self.counts = {"completed": 0, "failed": 0, "retried": 0}
        self.queue_depth = 0
        self._woken = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kilnproxy-batch-runner")

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1

    def wake(self) -> None:
        """Look for work now (a batch created or cancelled here)."""
        self._woken.set()
        self._wake_jobs()

    def _wake_jobs(self) -> None:
        for job, _ in self.jobs.values():
            job.changed.set()

    async def _run(self) -> None:
        svc = self.svc
        while not self.stopping:
            try:
                if not svc.shared:
                    await svc.batches.free_all_leases()
                await svc.files.sweep()
                break
            except Exception as exc:
                self._log(exc, "could not prepare the batches")
            await woken(self._woken, self.poll)
        while not self.stopping:
            self._woken.clear()
            try:
                await self._renew()
                await self._claim()
                self.queue_depth = await svc.lines.pending(list(self.jobs))
            except Exception as exc:
                self._log(exc, "could not look for batches")
            await woken(self._woken, self.poll)

    def _log(self, exc: Exception, what: str) -> None:
        if is_store_outage(exc):
            log.warning("%s: the store is out of reach (%s); trying again", what, exc)
        else:
            log.exception(what)

    async def _claim(self) -> None:
        if len(self.jobs) >= MAX_JOBS:
            return
        for batch_id in await self.svc.batches.claimable(self.id, MAX_JOBS):
            if batch_id in self.jobs or self.stopping or len(self.jobs) >= MAX_JOBS:
                continue
            if await self.svc.batches.lease(batch_id, self.id, self.lease_seconds):
                job = BatchJob(self, batch_id)
                task = asyncio.create_task(self._job(job), name=f"kilnproxy-batch-{batch_id}")
                self.jobs[batch_id] = job, task

    async def _job(self, job: BatchJob) -> None:
        try:
            await job.run()
        except Exception as exc:
            self._log(exc, f"batch {job.batch_id} stopped")
        finally:
            self.jobs.pop(job.batch_id, None)
            if not job.lost:
                try:
                    await self.svc.batches.release(job.batch_id, self.id)
                except Exception as exc:
                    self._log(exc, f"could not release the lease of batch {job.batch_id}")
            self._woken.set()  # anything left to do is taken up again

    async def _renew(self) -> None:
        for batch_id, (job, _) in list(self.jobs.items()):
            if not await self.svc.batches.lease(batch_id, self.id, self.lease_seconds):
                log.warning("batch %s: its lease passed to another runner; this one stops taking its lines",
                            batch_id)
                job.lost = True
                job.changed.set()

    def stop_taking_lines(self) -> None:
        self.stopping = True
        self.wake()

    async def stop(self) -> None:
        """Stop taking lines, let those in flight end (the server's grace period has ended their requests),
        release the leases. The loop that looks for batches is cancelled at once (it only reads, and renews
        leases); a job still busy with the store after ``STOP_SECONDS`` (a database out of reach) is
        cancelled too: its lines marked sent are resolved from their usage rows at the next start."""
        self.stop_taking_lines()
        await cancelled(self._task)
        jobs = [task for _, task in self.jobs.values()]
        if jobs:
            _, late = await asyncio.wait(jobs, timeout=STOP_SECONDS)
            for task in late:
                task.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        await self.sender.close()
