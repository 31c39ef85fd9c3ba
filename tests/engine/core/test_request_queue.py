"""Admission control pieces that need no server: the text_input byte limit and the
WAITING queue's O(1) removal (a cancel while thousands wait)."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from backend.prompt_limits import check_prompt_size, longest_token_bytes, max_prompt_bytes
from backend.request_parsing import InvalidRequest
from engine.core.request import Request
from engine.core.request_queue import FCFSQueue, PriorityQueue


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.models.gguf_cache import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def test_byte_limit_never_refuses_a_prompt_that_fits(tokenizer):
    longest = longest_token_bytes(tokenizer)
    max_model_len = 64
    limit = max_prompt_bytes(max_model_len, longest)
    # The worst case that still fits: every token is the vocabulary's longest text.
    widest = max((tokenizer.decode([i]) for i in tokenizer.get_vocab().values()),
                 key=lambda t: len(t.encode()))
    text = widest * (max_model_len - 1)
    assert len(tokenizer.encode(text)) < max_model_len
    check_prompt_size(np.array([text.encode()], dtype=np.object_), limit, max_model_len)
    with pytest.raises(InvalidRequest, match=r"text_input is \d+ bytes.*max_model_len=64"):
        check_prompt_size(np.array([b"x" * (limit + 1)], dtype=np.object_), limit, max_model_len)


def test_byte_limit_leaves_odd_inputs_to_the_parser():
    check_prompt_size(None, 10, 4)
    check_prompt_size(np.array([b"x" * 100, b"y"], dtype=np.object_), 10, 4)
    with pytest.raises(InvalidRequest):
        check_prompt_size(np.array(["é" * 6], dtype=np.object_), 10, 4)  # 12 bytes as UTF-8


def requests(n: int, priorities: bool = False) -> list[Request]:
    rng = random.Random(0)
    return [Request(f"r{i}", [1], priority=rng.randrange(4) if priorities else 0, arrival_time=float(i))
            for i in range(n)]


@pytest.mark.parametrize("queue_cls", [FCFSQueue, PriorityQueue])
def test_removal_keeps_order_and_length(queue_cls):
    reqs = requests(50, priorities=queue_cls is PriorityQueue)
    queue = queue_cls()
    for r in reqs:
        queue.add(r)
    gone = set(reqs[::3])
    for r in gone:
        queue.remove(r)
    kept = [r for r in reqs if r not in gone]
    expected = kept if queue_cls is FCFSQueue else sorted(kept)
    assert len(queue) == len(kept) and list(queue) == expected
    queue.prepend(reqs[0])  # a removed request may come back (preempted, re-queued)
    assert queue.peek() is (reqs[0] if queue_cls is FCFSQueue else min(expected + [reqs[0]]))
    popped = [queue.pop() for _ in range(len(queue))]
    assert sorted(popped) == sorted(kept + [reqs[0]]) and not queue
    with pytest.raises(IndexError):
        queue.peek()


@pytest.mark.parametrize("queue_cls", [FCFSQueue, PriorityQueue])
def test_priority_and_fcfs_match_a_reference_under_random_operations(queue_cls):
    rng = random.Random(1)
    pool = requests(200, priorities=True)
    queue, model = queue_cls(), []
    for _ in range(2000):
        op = rng.random()
        absent = [r for r in pool if r not in model]
        if op < 0.45 and absent:
            r = rng.choice(absent)
            queue.add(r)
            model.append(r)
        elif op < 0.7 and model:
            r = rng.choice(model)
            queue.remove(r)
            model.remove(r)
        elif model:
            head = model[0] if queue_cls is FCFSQueue else min(model)
            assert queue.pop() is head
            model.remove(head)
        assert len(queue) == len(model)


@pytest.mark.parametrize("queue_cls", [FCFSQueue, PriorityQueue])
def test_removing_many_waiting_requests_is_fast(queue_cls):
    # 20k removals from 40k: 0.01-0.02 s here; the scanning remove() it replaces needed
    # 4 ms (deque) and 47 ms (list.remove + heapify) per removal, i.e. 80 s and 15 min.
    reqs = requests(40_000, priorities=queue_cls is PriorityQueue)
    queue = queue_cls()
    for r in reqs:
        queue.add(r)
    doomed = reqs[::2]
    random.Random(2).shuffle(doomed)
    start = time.perf_counter()
    for r in doomed:
        queue.remove(r)
    assert time.perf_counter() - start < 2.0
    assert len(queue) == 20_000
