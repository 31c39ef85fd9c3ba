"""A fake model runner for driving the real Scheduler without torch.

It 'computes' KV by writing, into each slot, a fingerprint of the whole prefix up to
that token; before sampling it checks that every slot a request reads holds that
request's own prefix. So a wrong prefix-cache hit, a block shared or freed too early,
or stale KV after preemption shows up as an assertion, not as a silent pass. Sampled
tokens are a pure function of the sequence so far, like greedy decoding; proposed tokens
(speculative decoding) are verified as greedy decoding verifies them.

With KV-cache groups (`windows`, one per group: None for full attention, else the window
W), each group's table is written and read on its own, a slot remembering which group
wrote it (a block id means the same bytes in every group); a windowed group reads only
the positions its queries see, p - W + 1 .. p, so the blocks behind may be gone."""
from __future__ import annotations

from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import Scheduler


def prefix_fingerprints(token_ids: list[int]) -> list[int]:
    out, h = [], 0
    for t in token_ids:
        h = hash((h, t))
        out.append(h)
    return out


def next_token(token_ids: list[int], vocab_size: int) -> int:
    return hash(tuple(token_ids[-8:]) + (len(token_ids),)) % vocab_size


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.windows = tuple(windows)
        # (group, fingerprint) per slot.
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        bs = self.block_size
        for request in out.scheduled_requests:
            n = out.num_scheduled_tokens[request.request_id]
            end = request.num_computed_tokens
            start = end - n
            tables = out.block_ids[request.request_id]
            assert len(tables) == len(self.windows), "one block table per KV-cache group"
            # Speculative decoding: the proposed tokens follow the request's own, and the
            # last n - 1 positions are theirs.
            proposed = out.scheduled_spec_decode_tokens.get(request.request_id, [])
            assert not proposed or len(proposed) == n - 1
            tokens = request.all_token_ids + proposed
            fingerprints = prefix_fingerprints(tokens[:end])
            for group, (window, block_ids) in enumerate(zip(self.windows, tables)):
                assert len(block_ids) * bs >= end, "block table too short for scheduled tokens"
                for pos in range(start, end):
                    self.slots[block_ids[pos // bs] * bs + pos % bs] = (group, fingerprints[pos])
                first = 0 if window is None else max(0, start - window + 1)
                for pos in range(first, end):
                    got = self.slots[block_ids[pos // bs] * bs + pos % bs]
                    assert got == (group, fingerprints[pos]), (
                        f"{request.request_id}: KV at position {pos} (group {group}) is not "
                        f"this request's prefix")
            if proposed:  # greedy verification: the agreeing drafts, then one more
                base = request.num_tokens
                accepted = []
                for j in range(len(proposed) + 1):
                    accepted.append(next_token(tokens[:base + j], self.vocab_size))
                    if j == len(proposed) or accepted[-1] != proposed[j]:
                        break
                sampled[request.request_id] = accepted
            elif end >= request.num_tokens:
                sampled[request.request_id] = [next_token(request.all_token_ids, self.vocab_size)]
        return sampled


def run_to_completion(scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 100_000,
                      on_step=None) -> int:
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if on_step is not None:
            on_step(scheduler, out)
        scheduler.update_from_output(out, runner.execute(out))
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps
