"""WAITING under policy="fair": one FCFS queue per tenant, served lowest virtual counter
first (engine/core/fair_share.py), the earlier head arrival on a tie.

peek() scans the backlogged tenants, O(tenants): counters change at every step, so a heap
keyed on them would be rebuilt as often as it is read."""
from __future__ import annotations

import itertools
from typing import Iterator

from engine.core.fair_share import VirtualTokenCounter, tenant_of
from engine.core.request import Request
from engine.core.request_queue import FCFSQueue


class FairQueue:
    def __init__(self, counters: VirtualTokenCounter) -> None:
        self._counters = counters
        self._queues: dict[str, FCFSQueue] = {}
        self._len = 0

    def _queue(self, request: Request) -> FCFSQueue:
        tenant = tenant_of(request)
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = FCFSQueue()
        return queue

    def add(self, request: Request) -> None:
        self._queue(request).add(request)
        self._len += 1

    def prepend(self, request: Request) -> None:
        self._queue(request).prepend(request)
        self._len += 1

    def _order(self) -> list[str]:
        counter = self._counters.counter
        return sorted(self._queues, key=lambda t: (counter(t), self._queues[t].peek().arrival_time))

    def peek(self) -> Request:
        if not self._queues:
            raise IndexError("peek from an empty queue")
        counter = self._counters.counter
        tenant = min(self._queues,
                     key=lambda t: (counter(t), self._queues[t].peek().arrival_time))
        return self._queues[tenant].peek()

    def pop(self) -> Request:
        request = self.peek()
        self.remove(request)
        return request

    def remove(self, request: Request) -> None:
        tenant = tenant_of(request)
        queue = self._queues[tenant]
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self._queues[tenant]

    def head(self, count: int) -> list[Request]:
        """Up to `count` requests: the lowest tenant's queue first, then the next one's (the
        order if no counter moved meanwhile is not known ahead; this one is close enough for
        the partial-prefill look-ahead)."""
        out: list[Request] = []
        for tenant in self._order():
            out.extend(self._queues[tenant].head(count - len(out)))
            if len(out) >= count:
                break
        return out

    def waiting_by_tenant(self) -> dict[str, int]:
        return {tenant: len(queue) for tenant, queue in self._queues.items()}

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(list(self._queues.values()))
