"""The WAITING queue: insertion order under fcfs, a heap under priority.

Both remove a request in O(1) (amortized): a client that cancels while thousands of
requests wait must not cost a scan of the queue on the engine thread."""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Iterator

from engine.core.request import Request


class FCFSQueue:
    # An OrderedDict is a linked list with a hash index: append at either end, pop the
    # head and delete any member are all O(1), where a deque's remove() scans.
    def __init__(self) -> None:
        self._items: OrderedDict[Request, None] = OrderedDict()

    def add(self, request: Request) -> None:
        self._items[request] = None

    def prepend(self, request: Request) -> None:
        # Preempted requests resume before anything that arrived after them.
        self._items[request] = None
        self._items.move_to_end(request, last=False)

    def peek(self) -> Request:
        for request in self._items:
            return request
        raise IndexError("peek from an empty queue")

    def pop(self) -> Request:
        return self._items.popitem(last=False)[0]

    def remove(self, request: Request) -> None:
        del self._items[request]

    def head(self, count: int) -> list[Request]:
        """The first `count` requests in queue order."""
        return list(itertools.islice(self._items, count))

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class PriorityQueue:
    """Lowest (priority, arrival_time) first; a preempted request re-enters by the same
    key, so it lands ahead of later arrivals of its priority.

    remove() only forgets the request's heap entry (lazy deletion); dead entries are
    skipped when they reach the top and swept out once they outnumber the live ones, so
    removal costs O(1) amortized instead of a scan plus a re-heapify."""

    def __init__(self) -> None:
        # (request, ticket); a request is in the queue while _live maps it to that
        # entry's ticket, so a removed-then-re-added request never revives its old entry.
        self._heap: list[tuple[Request, int]] = []
        self._live: dict[Request, int] = {}
        self._tickets = itertools.count()

    def add(self, request: Request) -> None:
        ticket = next(self._tickets)
        self._live[request] = ticket
        heapq.heappush(self._heap, (request, ticket))

    prepend = add

    def peek(self) -> Request:
        self._drop_dead_top()
        return self._heap[0][0]

    def pop(self) -> Request:
        self._drop_dead_top()
        request, _ = heapq.heappop(self._heap)
        del self._live[request]
        return request

    def remove(self, request: Request) -> None:
        del self._live[request]  # KeyError when absent, as list.remove raises ValueError
        if len(self._heap) > 2 * len(self._live) + 16:
            self._heap = [(r, t) for r, t in self._heap if self._live.get(r) == t]
            heapq.heapify(self._heap)

    def head(self, count: int) -> list[Request]:
        """The first `count` requests in queue order, without disturbing the heap."""
        return heapq.nsmallest(count, self._live)

    def _drop_dead_top(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][0]) != heap[0][1]:
            heapq.heappop(heap)
        if not heap:
            raise IndexError("peek/pop from an empty queue")

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._live))


def make_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
