"""Stopping the gateway's background loops: a stop never hangs on a loop that missed its cancellation."""

from __future__ import annotations

import asyncio

from kilnproxy.store.tenancy.watch import ChangeWatch
from kilnproxy.tasks import cancelled, woken

LIMIT = 10.0  # a stop that hangs fails here instead of hanging the suite


async def turns(n: int) -> None:
    """Let the loop run ``n`` turns (the other tasks' next steps), without waiting on the clock."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_watch_nudged_in_the_turn_of_its_stop_still_stops():
    seen = asyncio.Event()

    async def on_change() -> None:
        seen.set()

    watch = ChangeWatch(on_change)  # SQLite's: no connection, the loop goes straight to its wait
    watch.start()
    watch.nudge()
    await asyncio.wait_for(seen.wait(), LIMIT)
    seen.clear()
    await turns(3)  # back in its wait for the next nudge
    watch.nudge()  # a change (a NOTIFY) arrives in the same turn as the stop
    async with asyncio.timeout(LIMIT) as limit:
        await watch.stop()
    assert not limit.expired() and not seen.is_set()


async def test_woken_says_whether_the_event_came_and_never_loses_a_cancellation():
    event = asyncio.Event()
    assert await woken(event, 0.01) is False
    event.set()
    assert await woken(event, LIMIT) is True
    event.clear()
    task = asyncio.create_task(woken(event, LIMIT))
    await turns(2)
    event.set()
    task.cancel()
    async with asyncio.timeout(LIMIT):
        await asyncio.wait((task,))
    assert task.cancelled()


async def test_a_task_that_swallows_a_cancellation_is_cancelled_until_it_ends():
    caught = []

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            caught.append(1)  # swallowed, as a library might
        await asyncio.Event().wait()

    task = asyncio.create_task(stubborn())
    await turns(2)
    async with asyncio.timeout(LIMIT) as limit:
        assert await cancelled(task) is None
    assert not limit.expired() and task.cancelled() and caught == [1]


async def test_a_task_that_failed_raises_its_exception_at_its_stop():
    async def broken() -> None:
        raise ValueError("bug")

    task = asyncio.create_task(broken())
    await turns(2)
    try:
        await cancelled(task)
    except ValueError as exc:
        assert str(exc) == "bug"
    else:
        raise AssertionError("the task's exception was not raised")
