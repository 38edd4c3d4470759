"""Background tasks of the gateway's own (health checks, checkpoints, heartbeats)."""

from __future__ import annotations

import asyncio


async def cancelled(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and return once it has ended; returns ``None`` to assign back."""
    if task is None:
        return None
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None
