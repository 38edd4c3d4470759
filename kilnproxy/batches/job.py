"""``BatchJob``: one batch run by this replica's runner while it holds the batch's lease.

validating: the input checked (``input_check``); a bad one turns the batch ``failed``, else its lines
are stored and it is ``in_progress``. Then lines are taken in order as the runner's slots free
(``[batches] max_in_flight`` across the replica's batches), each sent through the whole request path
(``line_sender``) under the generation id it was marked ``sent`` with; a 429 or 503 sends it back to
``pending`` with a backoff, any other answer is final and recorded with the batch's counts. When no
line is left: ``finalizing``, the files written, ``completed``. A cancel (``cancelling``): no line is
taken any more, those in flight finish, then ``cancelled`` with the files of what finished. Past
``expires_at``: the same, the lines not run go to the error file (``batch_expired``), ``expired``.

A line found ``sent`` that this job did not send (its gateway stopped or was killed, or its lease
passed to us) is resolved from its usage row: none (and, on PostgreSQL, no hold of a replica that may
still write one): it was not charged and runs again; a 429 or 503: it runs again; any other: it was
charged, and it ends in the error file (``batch_answer_lost``) rather than be charged twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..proxy.request_path import new_generation_id
from ..tasks import woken
from . import outcomes
from .input_check import check_input
from .line_sender import LineNotSent

log = logging.getLogger("kilnproxy.batches")

RETRIED = (429, 503)
POLL_SECONDS = 1.0  # how often a job reads its batch's status (a cancel made on another replica)
MAX_BACKOFF = 60.0


def backoff(attempts: int, headers: dict[str, str]) -> float:
    """Seconds before a refused line runs again: its ``Retry-After`` (seconds), else 0.25 s doubling per
    attempt; at most ``MAX_BACKOFF``."""
    after = headers.get("Retry-After", "")
    if after.isdigit():
        return min(float(after), MAX_BACKOFF)
    return min(0.25 * 2 ** max(attempts - 1, 0), MAX_BACKOFF)


class BatchJob:
    def __init__(self, runner, batch_id: str):
        self.runner = runner
        self.svc = runner.svc
        self.batch_id = batch_id
        self.changed = asyncio.Event()  # a line ended, a slot freed, the runner woke us
        self.lost = False  # the lease passed to another runner: stop taking lines
        self.in_flight: set[asyncio.Task] = set()
        self.unresolved = False  # a line of ours failed before an answer: resolve it from its row

    async def run(self) -> None:
        svc = self.svc
        batch = await svc.batches.get(None, self.batch_id)
        if batch["status"] == "validating" and not await self._validate(batch):
            return
        batch = await svc.batches.get(None, self.batch_id)
        self.runner.credential.running[self.batch_id] = batch["key_id"]
        try:
            if batch["status"] in ("in_progress", "cancelling") and batch["in_progress_at"] is not None:
                await self._resolve(await svc.lines.sent(self.batch_id))
                await self._run_lines(batch["endpoint"])
                if self._stopping():
                    return
            await self._conclude()
        finally:
            await self._settle_in_flight()
            self.runner.credential.running.pop(self.batch_id, None)

    def _stopping(self) -> bool:
        return self.runner.stopping or self.lost or self.svc.gw.draining  # draining: SIGTERM came

    async def _validate(self, batch: dict[str, Any]) -> bool:
        total, errors = await check_input(self.svc, batch)
        if errors:
            await self.svc.batches.fail(self.batch_id, errors)
            log.info("batch %s failed its input check: %d error(s)", self.batch_id, len(errors))
            return False
        await self.svc.batches.move(self.batch_id, "in_progress", when=("validating",), total=total)
        return True

    # -- the lines -----------------------------------------------------------------------------

    async def _run_lines(self, endpoint: str) -> None:
        svc, batch_id = self.svc, self.batch_id
        while not self._stopping():
            self.changed.clear()
            now = time.time()
            status, expires_at = await svc.batches.state(batch_id)
            if now >= expires_at or status != "in_progress":
                break
            taken = []
            free = self.runner.capacity.take(self.runner.config.batches.max_in_flight)
            if free:
                try:
                    taken = await svc.lines.take(batch_id, free, new_generation_id)
                finally:  # the slots no line took (all of them, when the store failed)
                    self.runner.capacity.give_back(free - len(taken))
            for line in taken:
                task = asyncio.create_task(self._run_line(endpoint, line),
                                           name=f"batch-line-{batch_id}-{line['line']}")
                self.in_flight.add(task)
                task.add_done_callback(self.in_flight.discard)
            wait = min(POLL_SECONDS, max(expires_at - now, 0))
            if not taken and not self.in_flight:
                due = await svc.lines.next_due(batch_id)
                if due is None:
                    if not self.unresolved:
                        return  # every line ended
                    self.unresolved = False
                    await self._resolve(await svc.lines.sent(batch_id))
                    if self.unresolved:  # a hold of a lost replica, not reaped yet: look again later
                        await woken(self.changed, wait)
                    continue
                wait = min(wait, max(due - now, 0.0))
            await woken(self.changed, wait)
        await self._settle_in_flight()

    async def _settle_in_flight(self) -> None:
        while self.in_flight:
            await asyncio.wait(list(self.in_flight))

    async def _run_line(self, endpoint: str, line: dict[str, Any]) -> None:
        svc, generation_id = self.svc, line["generation_id"]
        try:
            status, body, headers = await self.runner.sender.send(self.batch_id, endpoint, line)
            if status in RETRIED:
                self.runner.count("retried")
                await svc.lines.retry_later(self.batch_id, line["line"], generation_id,
                                            backoff(line["attempts"] + 1, headers))
            else:
                ok = 200 <= status < 300
                if await svc.lines.finish(self.batch_id, line["line"], generation_id, ok,
                                          outcomes.answered(line["custom_id"], status, generation_id, body)):
                    self.runner.count("completed" if ok else "failed")
        except LineNotSent as exc:
            self.unresolved = True
            log.warning("batch %s line %d: no answer (%s); resolved from its usage row", self.batch_id,
                        line["line"], exc)
        except Exception:
            self.unresolved = True
            log.exception("batch %s line %d: its outcome was not recorded", self.batch_id, line["line"])
        finally:
            self.runner.capacity.give_back(1)

    async def _resolve(self, sent: list[dict[str, Any]]) -> None:
        """Lines marked ``sent`` by a run that did not record their outcome (see the module's docstring)."""
        svc = self.svc
        for line in sent:
            generation_id = line["generation_id"]
            row = await svc.gw.ledger.get(generation_id)
            if row is None:
                if await svc.lines.held(generation_id):
                    self.unresolved = True  # a replica's hold: its row comes (settled, or reaped)
                    continue
                await svc.lines.retry_later(self.batch_id, line["line"], generation_id, 0.0)
                continue
            if row.get("batch_id") is None:
                await svc.lines.own_row(generation_id, self.batch_id)
            if row["status"] in RETRIED:
                await svc.lines.retry_later(self.batch_id, line["line"], generation_id, 0.0)
            elif await svc.lines.finish(self.batch_id, line["line"], generation_id, False,
                                        outcomes.lost(line["custom_id"], row["status"], generation_id)):
                self.runner.count("failed")

    # -- the end -------------------------------------------------------------------------------

    async def _conclude(self) -> None:
        svc, batch_id = self.svc, self.batch_id
        batch = await svc.batches.get(None, batch_id)
        status = batch["status"]
        if status == "in_progress" and time.time() >= batch["expires_at"]:
            await svc.lines.expire(batch_id)
            final, when = "expired", ("in_progress",)
        elif status == "in_progress":
            if not await svc.batches.move(batch_id, "finalizing", when=("in_progress",)):
                return await self._conclude()  # cancelled at this moment
            final, when = "completed", ("finalizing",)
        elif status == "finalizing":
            final, when = "completed", ("finalizing",)
        elif status == "cancelling":
            final, when = "cancelled", ("cancelling",)
        else:
            return
        files = await outcomes.write_files(svc, batch)
        if await svc.batches.conclude(batch_id, final, when, files["files"], output_file_id=files["output_file_id"],
                                      error_file_id=files["error_file_id"]):
            log.info("batch %s %s", batch_id, final)
        else:
            for file_id, _ in files["files"]:
                await svc.files.discard(file_id)
            await self._conclude()
