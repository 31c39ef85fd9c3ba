"""SamplingParams.prompt_logprobs on the runner's side (vLLM's prompt logprobs): each
prompt position's logits, taken from the prefill's own hidden states, give the logprob
of the prompt token after it (position i -> token i + 1), its rank over the vocabulary
and the top k. The last prompt position's logits are the ones the first token is
sampled from, so a prompt of P tokens has P - 1 such rows.

- The raw model distribution, as vLLM's: log_softmax of the float32 logits, no
  temperature, penalties, grammar or other processors; the rank is the sampler's rule
  (how many logprobs are >= the token's, engine/sample/sampler.py).
- Bounded memory: a step's prompt rows go through the lm_head a slice at a time
  (slice_rows), each slice reduced at once to its few numbers; full-vocabulary logits
  never exist for more than one slice (a 32k-token prompt over a 150k vocabulary would
  be 19 GB of float32).
- Chunked prefill: each chunk fills its positions of the request's pending entry, by
  position, so a preempted request that recomputes its prompt writes the same rows again
  (never twice, never missing). The entry goes to the output once the request samples its
  first token; after that the request is marked delivered and its recomputed prompt
  (after a later preemption) computes no rows.
- Tensor parallelism: the rows travel in StepInputs.prompt_rows and every rank computes
  the same slices (the lm_head's all-gather is a collective); only rank 0 reduces them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.core.sched_output import SchedulerOutput

# Float32 elements of one slice's logits (64 MiB): a slice's working set is that, its
# log_softmax and a byte-wide comparison for the ranks, whatever the prompt's length.
SLICE_ELEMENTS = 1 << 24
# Rows per slice at most: more rows buy nothing once a matmul is this tall.
MAX_SLICE_ROWS = 512


def slice_rows(vocab_size: int) -> int:
    """Prompt rows whose logits are computed at once, for a vocabulary of this size."""
    return max(1, min(MAX_SLICE_ROWS, SLICE_ELEMENTS // max(vocab_size, 1)))


@dataclass(slots=True)
class PromptLogprobs:
    """A request's prompt logprobs, complete: entry j is prompt token j + 1's, from the
    logits at position j (the output processor lays them out as vLLM does)."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]  # k per entry, best first; empty lists when k is 0
    top_values: list[list[float]]


class _Pending:
    """One request's entries so far, indexed by prompt position."""

    __slots__ = ("k", "logprobs", "ranks", "top_ids", "top_values", "filled")

    def __init__(self, num_rows: int, k: int) -> None:
        self.k = k
        self.logprobs = torch.empty(num_rows, dtype=torch.float32)
        self.ranks = torch.empty(num_rows, dtype=torch.int64)
        self.top_ids = torch.empty(num_rows, k, dtype=torch.int64)
        self.top_values = torch.empty(num_rows, k, dtype=torch.float32)
        self.filled = torch.zeros(num_rows, dtype=torch.bool)

    def result(self, prompt_token_ids: list[int]) -> PromptLogprobs:
        if not bool(self.filled.all()):
            missing = (~self.filled).nonzero().squeeze(1)[:5].tolist()
            raise RuntimeError(f"prompt logprobs incomplete: positions {missing} never computed")
        return PromptLogprobs(prompt_token_ids[1:], self.logprobs.tolist(), self.ranks.tolist(),
                              self.top_ids.tolist(), self.top_values.tolist())


@dataclass(slots=True)
class _Segment:
    """A run of one request's positions among the step's prompt rows."""
    pending: _Pending
    first_position: int  # prompt position of its first row
    offset: int          # its first row's index among the step's prompt rows
    count: int


class StepPromptRows:
    """One step's prompt rows: `rows` indexes the forward's hidden states (the batch's
    flattened tokens), `targets` the prompt token each row's logits are scored on."""

    __slots__ = ("rows", "targets", "segments", "max_k")

    def __init__(self, rows: torch.Tensor, targets: torch.Tensor, segments: list[_Segment],
                 max_k: int) -> None:
        self.rows = rows
        self.targets = targets
        self.segments = segments
        self.max_k = max_k

    def reduce(self, start: int, logits: torch.Tensor) -> None:
        """Float32 logits [m, vocab] of rows start .. start + m -> each row's entry,
        written to its request's pending entries."""
        m, vocab = logits.shape
        logprobs = torch.log_softmax(logits, dim=-1)
        del logits
        targets = self.targets[start:start + m].to(logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        # Counted in int32: summing the bool mask into int64 ran 2.3x slower on a CPU
        # (123 vs 53 ms for 341 x 49152), the largest part of the reduction.
        ranks = (logprobs >= chosen).sum(dim=-1, dtype=torch.int32).cpu()
        chosen = chosen.squeeze(1).cpu()
        top_ids = top_values = None
        if self.max_k:
            top = logprobs.topk(min(self.max_k, vocab), dim=-1)
            top_ids, top_values = top.indices.cpu(), top.values.cpu()
        end = start + m
        for seg in self.segments:
            lo, hi = max(start, seg.offset), min(end, seg.offset + seg.count)
            if lo >= hi:
                continue
            pending = seg.pending
            at = slice(seg.first_position + lo - seg.offset, seg.first_position + hi - seg.offset)
            got = slice(lo - start, hi - start)
            pending.logprobs[at] = chosen[got]
            pending.ranks[at] = ranks[got]
            if pending.k:
                pending.top_ids[at] = top_ids[got, :pending.k]
                pending.top_values[at] = top_values[got, :pending.k]
            pending.filled[at] = True


def for_each_slice(rows: torch.Tensor, hidden: torch.Tensor, vocab_size: int,
                   compute_logits, consume=None) -> None:
    """The float32 logits of hidden[rows], a slice at a time, handed to
    `consume(first_row_index, logits)`; None (tensor-parallel workers) computes them only
    for the collectives inside compute_logits."""
    step = slice_rows(vocab_size)
    for start in range(0, rows.shape[0], step):
        logits = compute_logits(hidden[rows[start:start + step]], upcast=True)
        if consume is not None:
            consume(start, logits)
        del logits


class PromptLogprobsTracker:
    """Per request: the pending entries of a prompt being computed, and whether its
    prompt logprobs have gone out. free() on finish or abort, drop() on preemption."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._delivered: set[str] = set()

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._delivered.discard(request_id)

    def drop(self, request_id: str) -> None:
        """A preempted request recomputes its prompt from position 0 (it reads no prefix
        hits, engine/core/kv_cache/manager.py), refilling every entry."""
        self._pending.pop(request_id, None)

    def plan(self, out: SchedulerOutput) -> StepPromptRows | None:
        """The step's prompt rows, in the batch's token order; None when none."""
        rows: list[torch.Tensor] = []
        targets: list[int] = []
        segments: list[_Segment] = []
        max_k = 0
        offset = 0  # the request's first token among the step's flattened tokens
        num_rows = 0
        for request in out.scheduled_requests:
            rid = request.request_id
            n = out.num_scheduled_tokens[rid]
            k = request.sampling_params.prompt_logprobs
            if k is not None and rid not in self._delivered:
                end = request.num_computed_tokens  # already counts this step's tokens
                first = end - n
                last = min(end, request.num_prompt_tokens - 1)  # positions first .. last - 1
                if first < last:
                    pending = self._pending.get(rid)
                    if pending is None:
                        pending = self._pending[rid] = _Pending(request.num_prompt_tokens - 1, k)
                    count = last - first
                    rows.append(torch.arange(offset, offset + count))
                    targets.extend(request.prompt_token_ids[first + 1:last + 1])
                    segments.append(_Segment(pending, first, num_rows, count))
                    num_rows += count
                    max_k = max(max_k, k)
            offset += n
        if not segments:
            return None
        return StepPromptRows(torch.cat(rows), torch.tensor(targets, dtype=torch.int64),
                              segments, max_k)

    def take_completed(self, sampled: list[Request]) -> dict[str, PromptLogprobs]:
        """The prompt logprobs of the requests that sampled their first token in a step
        that succeeded, by request id; each request's once."""
        done: dict[str, PromptLogprobs] = {}
        for request in sampled:
            rid = request.request_id
            k = request.sampling_params.prompt_logprobs
            if k is None or rid in self._delivered:
                continue
            pending = self._pending.pop(rid, None)
            if pending is None:  # a 1-token prompt has no rows
                pending = _Pending(request.num_prompt_tokens - 1, k)
            done[rid] = pending.result(request.prompt_token_ids)
            self._delivered.add(rid)
        return done
