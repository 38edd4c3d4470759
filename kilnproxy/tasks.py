"""Background tasks of the gateway's own (health checks, checkpoints, heartbeats).

Their loops wait with ``woken``, never ``asyncio.wait_for(event.wait(), t)``: on
Python 3.11, ``wait_for`` returns the inner wait's result when the event is set in
the same loop turn as a cancellation, and the loop, its cancellation lost, would
run on while ``cancelled`` waited for it to end.
"""

from __future__ import annotations

import asyncio

STOP_RETRY_SECONDS = 1.0


async def woken(event: asyncio.Event, seconds: float | None) -> bool:
    """Wait until ``event`` is set (True) or ``seconds`` pass (False; ``None``: no limit).
    A cancellation always raises here."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancelled(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and return once it has ended; returns ``None`` to assign back.

    A task whose code (or a library's) swallowed the cancellation is cancelled again every
    ``STOP_RETRY_SECONDS`` until it ends: a stop never hangs on it. An exception the task
    ended with is raised here."""
    if task is None:
        return None
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=STOP_RETRY_SECONDS)
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc
    return None
