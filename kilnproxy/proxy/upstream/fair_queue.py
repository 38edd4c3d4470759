"""The order of a pool's queue (SPEC 14's fair queues): a request's ``Claim``, and ``FairQueue``, one priority's waiters.

A request waiting for an upstream slot carries a ``Claim``: its org, its
``weight`` and whether it runs at batch priority. The request path makes it
once per request from the authenticated key (``Gateway.claim_of``); a
``KeyConfig`` whose ``priority`` is ``"batch"`` (the Batch API's runner
authenticates its lines as ``dataclasses.replace(key, priority="batch")``)
gives a batch claim.

``FairQueue`` is the waiters of one priority on one pool (``SlotPool`` keeps
two: interactive and batch). Between orgs it is weighted round robin by
virtual time (start-time fair queueing): each org waiting has ``served``, the
slots it was granted while it waited, each counted ``1 / weight`` of the
request served; the next slot goes to the oldest waiter of the org with the
least ``served`` (ties: the org that began waiting first). An org that begins
to wait starts at the queue's ``clock`` (the ``served`` of the org granted
last, before that grant), not at zero: it is served next, then takes turns
with the others, and cannot claim the slots the others had before it came.
Within an org, first come, first served. One heap entry per org waiting:
``first`` and ``pop`` cost O(log orgs), skipping waiters that have left.

A waiter is live while ``alive(waiter)`` says so (the pool's own record of
who is queued on it): a waiter that left, was served by another pool, or
stopped waiting here (marked down) is dropped when it reaches the front, so
leaving costs O(1).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Callable


class Claim:
    """What a request asks of the queue: its ``org`` (the unit of fair shares), its ``weight`` (> 0) and
    ``batch`` (True: batch priority)."""

    __slots__ = ("org", "weight", "batch")

    def __init__(self, org: str, weight: float = 1.0, batch: bool = False):
        self.org = org
        self.weight = weight
        self.batch = batch

    def __repr__(self) -> str:
        return f"Claim({self.org!r}, {self.weight!r}, {'batch' if self.batch else 'interactive'})"


INTERACTIVE = Claim("")  # a request of no org in particular (tests, tools): interactive, weight 1


class _Flow:
    """One org's waiters in one queue, and the slots (over weight) it had while it waited."""

    __slots__ = ("org", "waiters", "served", "seq")

    def __init__(self, org: str, served: float, seq: int):
        self.org = org
        self.waiters: deque[Any] = deque()
        self.served = served
        self.seq = seq

    def __lt__(self, other: "_Flow") -> bool:  # the heap's order: least served, then first to wait
        return (self.served, self.seq) < (other.served, other.seq)


class FairQueue:
    """The waiters of one priority on one pool, in the order they are to be granted slots."""

    __slots__ = ("flows", "heap", "clock", "seq", "alive")

    def __init__(self, alive: Callable[[Any], bool]):
        self.flows: dict[str, _Flow] = {}  # the orgs in the heap
        self.heap: list[_Flow] = []
        self.clock = 0.0
        self.seq = 0
        self.alive = alive

    def push(self, waiter: Any) -> None:
        """Queue ``waiter`` (with its ``claim``) last of its org's waiters."""
        org = waiter.claim.org
        flow = self.flows.get(org)
        if flow is None:
            self.seq += 1
            flow = self.flows[org] = _Flow(org, self.clock, self.seq)
            heapq.heappush(self.heap, flow)
        flow.waiters.append(waiter)

    def first(self) -> Any | None:
        """The waiter to be granted the next slot (left in place), or None when none is live."""
        heap, alive = self.heap, self.alive
        while heap:
            flow = heap[0]
            waiters = flow.waiters
            while waiters:
                if alive(waiters[0]):
                    return waiters[0]
                waiters.popleft()
            heapq.heappop(heap)
            del self.flows[flow.org]
        return None

    def pop(self) -> None:
        """Take the waiter ``first`` returned off the queue: a slot was granted to it."""
        flow = self.heap[0]
        waiter = flow.waiters.popleft()
        self.clock = flow.served
        flow.served += 1.0 / waiter.claim.weight
        if flow.waiters:
            heapq.heapreplace(self.heap, flow)
        else:
            heapq.heappop(self.heap)
            del self.flows[flow.org]

    def compact(self) -> None:
        """Drop every entry of a waiter no longer live (each org keeps its place and its ``served``)."""
        alive = self.alive
        for org, flow in list(self.flows.items()):
            flow.waiters = deque(w for w in flow.waiters if alive(w))
            if not flow.waiters:
                del self.flows[org]
        self.heap = list(self.flows.values())
        heapq.heapify(self.heap)

    def clear(self) -> None:
        self.flows.clear()
        self.heap.clear()
