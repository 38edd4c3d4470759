"""Upstream slots: ``max_in_flight`` per upstream URL, and the queue of requests waiting for one.

A model server such as llama.cpp has a fixed number of slots; sent more, it
queues them out of sight. ``SlotPool`` is one upstream URL's slots in this
process, shared by every model that lists the URL (and kept across a reload,
``kilnproxy.ops.reload``). ``take_slot(upstreams, deadline)`` takes a free
slot on the first of a request's candidate upstreams that has one (the
route gives them in its routing's order: the least loaded first, or the
request's ``cache_aware`` order), or queues the request until one frees or
``deadline`` passes (then ``UpstreamBusy``). A pool's ``load_at(now)`` is
SPEC 13's load: the larger of ``busy`` and the server's own count, when a
``LoadPoller`` read it lately (``polled``, bound by ``kilnproxy.ops.load_poll``).

A waiter queues on each of its candidate pools at once, and a pool hands a
freed slot to the waiter its order puts first (``kilnproxy.proxy.upstream.fair_queue``,
SPEC 14): an interactive request before any of batch priority; among the orgs
whose requests of that priority wait, weighted round robin; within an org,
first come, first served. A batch-priority request (its ``Claim``'s ``batch``)
takes a slot only while no interactive request waits for the pool, and never
one of its last ``reserve`` free slots (``batch_reserve``). A pool with a free
slot never has a live interactive waiter, nor a batch one while more than
``reserve`` slots are free (a slot freed, or a limit raised, grants at once):
so a request finding a free slot for its priority overtakes nobody. The
requests of every model that lists a URL share its one order.
A waiter that is cancelled (its client left) or times out leaves its place
at once; a slot granted to it in that moment is given back. When an upstream
is marked down, the waiters queued on its pool look again (``usable``): they
stop waiting on the pools of upstreams now down for their model, keeping
their place in the others; left with none, they get ``NoUpstreamUp`` at once
rather than a slot on a server marked down, or their ``queue_timeout``. When
an upstream is found up again (``SlotPool.came_up``), the requests waiting
for the other upstreams of a model it serves queue for it too, oldest first.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable, Sequence

from ...errors import GatewayError
from .fair_queue import INTERACTIVE, Claim, FairQueue


class SlotPool:
    """The slots of one upstream URL: ``limit`` (None: no cap) and ``busy``, with their queue; ``reserve``:
    the free slots a batch-priority request leaves (``batch_reserve``)."""

    __slots__ = ("url", "limit", "reserve", "busy", "waiters", "interactive", "batch", "left", "refusal", "polled")

    def __init__(self, url: str, limit: int | None, reserve: int = 0):
        self.url = url
        self.limit = limit
        self.reserve = reserve
        self.busy = 0
        self.waiters: dict[_Waiter, None] = {}  # every waiter queued here, oldest first
        alive = self.waiters.__contains__  # left, served elsewhere or no longer waiting here: not in it
        self.interactive = FairQueue(alive)  # the order of the waiters, by priority
        self.batch = FairQueue(alive)
        self.left = 0  # waiters gone from ``waiters`` whose entries the queues may still hold
        self.refusal: Callable[[], Exception] | None = None  # the gateway is stopping: no slot is taken
        # the server's own load as a LoadPoller reads it (its origin's state: .load, .at, .stale_after), or None
        self.polled = None

    def refuse(self, error: Callable[[], Exception]) -> None:
        """From now on no slot is taken: the waiters, and every request after them, get ``error()``."""
        self.refusal = error
        waiters = list(self.waiters)
        self.waiters.clear()
        self.interactive.clear()
        self.batch.clear()
        self.left = 0
        for waiter in waiters:
            if not waiter.future.done():
                waiter.future.set_exception(error())

    def free(self) -> bool:
        return self.limit is None or self.busy < self.limit

    def open_to(self, claim: Claim) -> bool:
        """Whether a request of ``claim`` may take a slot now: one is free, and for batch priority more
        than ``reserve`` are (then nobody of its priority waits: it overtakes no one)."""
        limit = self.limit
        return limit is None or limit - self.busy > (self.reserve if claim.batch else 0)

    def load(self) -> float:
        """The share of the slots in use (requests in flight when the upstream has no cap)."""
        return self.busy / self.limit if self.limit else float(self.busy)

    def load_at(self, now: float) -> int:
        """SPEC 13's load (``now``: monotonic): the larger of this process's requests in flight here and
        the server's own count as last read, when read within 3 load_poll intervals."""
        busy = self.busy
        polled = self.polled
        if polled is not None:
            server = polled.load
            if server is not None and server > busy and now - polled.at <= polled.stale_after:
                return server
        return busy

    def share_at(self, now: float) -> float:
        """What ``least_busy`` compares: ``load_at(now)`` over the cap (the load itself without one)."""
        load = self.busy  # load_at(now), inline: this runs for each upstream of each request
        polled = self.polled
        if polled is not None:
            server = polled.load
            if server is not None and server > load and now - polled.at <= polled.stale_after:
                load = server
        return load / self.limit if self.limit else float(load)

    def take(self) -> None:
        self.busy += 1

    def give_back(self) -> None:
        self.busy -= 1
        self._grant()

    def set_limit(self, limit: int | None, reserve: int | None = None) -> None:
        """A reload changed ``max_in_flight`` (and ``batch_reserve``): a higher limit serves waiters at once;
        a lower one lets the requests in flight finish and grants no slot until ``busy`` is below it."""
        self.limit = limit
        if reserve is not None:
            self.reserve = reserve
        self._grant()

    def came_up(self) -> None:
        """An upstream at this URL is up again: the requests waiting for a slot of a model it serves
        (their ``usable`` says so) queue here too, oldest first, and a free slot serves them at once."""
        for waiter in list(_waiting):
            if (not waiter.future.done() and waiter.usable is not None and self not in waiter.pools
                    and waiter.usable(self)):
                waiter.pools.append(self)
                self.queue(waiter)
        self._grant()

    def marked_down(self) -> None:
        """An upstream at this URL was marked down (for one model, or for all): its waiters look again."""
        for waiter in list(self.waiters):
            if not waiter.future.done() and waiter.usable is not None:
                waiter.recheck()

    def queued(self) -> int:
        return sum(1 for w in self.waiters if not w.future.done())

    def queue(self, waiter: _Waiter) -> None:
        self.waiters[waiter] = None
        (self.batch if waiter.claim.batch else self.interactive).push(waiter)

    def _grant(self) -> None:
        """Free slots to the waiters, in the queue's order (see the module's docstring)."""
        waiters = self.waiters
        while waiters and self.free():
            queue = self.interactive
            waiter = queue.first()
            if waiter is None:
                if self.limit is not None and self.limit - self.busy <= self.reserve:
                    return  # the last free slots are kept from batch priority
                queue = self.batch
                waiter = queue.first()
                if waiter is None:
                    return
            queue.pop()
            del waiters[waiter]
            if waiter.future.done():
                continue  # left already (its place not yet given up), or served by another of its pools
            self.busy += 1
            waiter.future.set_result(self)


def anyone_waiting() -> bool:
    return bool(_waiting)


class _Waiter:
    __slots__ = ("future", "pools", "usable", "claim")

    def __init__(self, pools: Sequence[SlotPool], usable: Callable[[SlotPool], bool] | None, claim: Claim) -> None:
        self.future: asyncio.Future[SlotPool] = asyncio.get_running_loop().create_future()
        self.pools = list(pools)  # the pools it is queued on
        self.usable = usable
        self.claim = claim

    def recheck(self) -> None:
        """Stop waiting on the pools no longer ``usable``; with none left, ``NoUpstreamUp``."""
        keep = [p for p in self.pools if self.usable(p)]
        if len(keep) == len(self.pools):
            return
        for pool in self.pools:
            if pool not in keep:
                _remove(pool, self)
        self.pools = keep
        if not keep:
            self.future.set_exception(NoUpstreamUp())


_waiting: dict[_Waiter, None] = {}  # every request waiting for a slot, oldest first (came_up)


class UpstreamBusy(Exception):
    """Every slot of the candidate upstreams stayed busy past the wait allowed."""


class NoUpstreamUp(Exception):
    """Every upstream a request was waiting for was marked down while it waited."""


def upstream_busy(model: str, retry_after: float) -> GatewayError:
    seconds = max(1, int(retry_after + 0.999))
    return GatewayError(503, "upstream_busy",
                        f"Every upstream slot of model `{model}` is busy. Retry after {seconds} s.",
                        type="service_unavailable", headers={"Retry-After": str(seconds)})


def first_free(pools: Iterable[SlotPool], claim: Claim = INTERACTIVE) -> SlotPool | None:
    """The first pool with a slot ``claim`` may take now, or None when none has."""
    for pool in pools:
        if pool.open_to(claim):
            return pool
    return None


async def take_slot(pools: Sequence[SlotPool], deadline: float | None,
                    usable: Callable[[SlotPool], bool] | None = None, claim: Claim = INTERACTIVE) -> SlotPool:
    """A slot on one of ``pools`` for a request of ``claim`` (its org, weight and priority): free now (the
    first such one, in their order), or the first granted to it before ``deadline`` (loop time; None or
    past: no waiting). The caller gives it back with ``pool.give_back()``. Raises ``UpstreamBusy``, or a
    pool's ``refusal``, or (with ``usable``, which says whether the upstream behind a pool may still be
    sent the request) ``NoUpstreamUp`` once every pool waited on was marked down; cancelled, it leaves
    nothing taken."""
    for p in pools:
        if p.refusal is not None:
            raise p.refusal()
    pool = first_free(pools, claim)  # nobody of its priority waits where it may take a slot now
    if pool is not None:
        pool.take()
        return pool
    if deadline is None or deadline <= asyncio.get_running_loop().time():
        raise UpstreamBusy()
    waiter = _Waiter(pools, usable, claim)
    for p in pools:
        p.queue(waiter)
    _waiting[waiter] = None
    try:
        async with asyncio.timeout_at(deadline):
            pool = await asyncio.shield(waiter.future)
        for p in waiter.pools:
            if p is not pool:
                _remove(p, waiter)
        return pool
    except TimeoutError:
        _leave(waiter)
        raise UpstreamBusy() from None
    except BaseException:
        _leave(waiter)
        raise
    finally:
        del _waiting[waiter]


def _leave(waiter: _Waiter) -> None:
    """A waiter gives up its place; a slot granted to it in that same moment is given back."""
    if waiter.future.done():
        if not waiter.future.cancelled() and waiter.future.exception() is None:
            waiter.future.result().give_back()
    else:
        waiter.future.cancel()
    for pool in waiter.pools:
        _remove(pool, waiter)


def _remove(pool: SlotPool, waiter: _Waiter) -> None:
    """Not queued on ``pool`` any more: its entry in the pool's order is dropped when reached, or when the
    entries of those gone outnumber the waiters (a server stuck while requests time out), all at once."""
    if pool.waiters.pop(waiter, False) is None:
        pool.left += 1
        if pool.left > 2 * len(pool.waiters) + 64:
            pool.interactive.compact()
            pool.batch.compact()
            pool.left = 0
