"""n > 1 (parallel sampling, vLLM V1's ParentRequest): one request becomes n child
requests that the scheduler treats like any other, and their outputs are merged back
into one RequestOutput per step with n CompletionOutputs (index i = child i).

Prefill once: the children share the prompt and cache salt, so their full prompt blocks
hash alike, and the engine adds them one after another. The first admitted child
registers its full blocks in the prefix cache at allocation, before the forward, and the
siblings admitted after it (in the same step, or later) hit them; the runner writes a
whole batch's K/V before attention, so a same-step hit is safe (engine/core/scheduler.py).
Each child computes only the prompt's tail that is not a full block (at least its last
token, whose logits it samples from). Without prefix caching each child prefills alone.

Seeds follow vLLM: child i samples with seed + i when a seed is given; without a seed
every child draws from the engine's generator.

Prompt logprobs: only child 0 asks for them (the prompt is the same for all): it
recomputes the whole prompt (a request with prompt_logprobs reads no prefix hits), and
the siblings still hit its blocks. The parent's outputs carry them from child 0's first
output on, by the parent's output kind (as a single request's, output_processor.py).

Output kinds (engine/sampling_params.py RequestOutputKind) hold per family: a FINAL_ONLY
parent gets its one output once every child has finished; a child with no news in a
streamed parent output is empty in DELTA and its output so far in CUMULATIVE."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SEED_MAX, RequestOutputKind, SamplingParams


def child_request_id(index: int, request_id: str) -> str:
    # Index first, as vLLM: the backend's ids end in a per-request counter ("tid#k"), so
    # "{i}_tid#k" can only collide with another request holding the same k.
    return f"{index}_{request_id}"


def child_seed(seed: int | None, index: int) -> int | None:
    if seed is None:
        return None
    # Past SEED_MAX, wrap modulo 2**64 as torch's manual_seed does for negative seeds.
    child = seed + index
    return child if child <= SEED_MAX else child - 2 ** 64


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The (request id, params) of each sequence to schedule: the request itself for n = 1."""
    if params.n == 1:
        return [(request_id, params)]
    if params.seed is None:
        shared = dataclasses.replace(params, n=1, prompt_logprobs=None)
        first = (shared if params.prompt_logprobs is None
                 else dataclasses.replace(params, n=1))
        return [(child_request_id(i, request_id), first if i == 0 else shared)
                for i in range(params.n)]
    return [(child_request_id(i, request_id),
             dataclasses.replace(params, n=1, seed=child_seed(params.seed, i),
                                 prompt_logprobs=params.prompt_logprobs if i == 0 else None))
            for i in range(params.n)]


@dataclass(slots=True)
class _Family:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    child_ids: list[str]
    kind: RequestOutputKind
    # Each child's latest completion (index set to the child's), with its full text so far.
    completions: list[CompletionOutput]
    finished: list[bool]
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = None
    # Child 0's, once its output brought them; DELTA drops them once they went out.
    prompt_logprobs: list | None = None

    def record(self, index: int, out: RequestOutput) -> CompletionOutput:
        completion = dataclasses.replace(out.outputs[0], index=index)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.completions[index] = completion
        self.finished[index] = out.finished
        # The parent reports what its first admission found: the smallest hit, and the
        # earliest admission (its queue time ends with its first scheduled sequence).
        if self.num_cached_tokens is None or out.num_cached_tokens < self.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        seen = out.metrics
        if seen is not None and (self.metrics is None or _earlier(seen, self.metrics)):
            self.metrics = seen
        return completion

    @property
    def due(self) -> bool:
        return self.kind is not RequestOutputKind.FINAL_ONLY or all(self.finished)

    def output(self, fresh: dict[int, CompletionOutput]) -> RequestOutput:
        completions = [fresh.get(i) or _quiet(c, self.kind) for i, c in enumerate(self.completions)]
        prompt_logprobs = self.prompt_logprobs
        if self.kind is RequestOutputKind.DELTA:
            self.prompt_logprobs = None  # sent once
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             all(self.finished), num_cached_tokens=self.num_cached_tokens or 0,
                             metrics=self.metrics, prompt_logprobs=prompt_logprobs)


def _earlier(a: RequestMetrics, b: RequestMetrics) -> bool:
    if a.first_scheduled_time is None:
        return False
    return b.first_scheduled_time is None or a.first_scheduled_time < b.first_scheduled_time


def _quiet(completion: CompletionOutput, kind: RequestOutputKind) -> CompletionOutput:
    """The completion as of now, with nothing new since the previous output."""
    if kind is RequestOutputKind.FINAL_ONLY:
        return completion  # its one output: everything is new
    no_logprobs = None if completion.logprobs is None else []
    if kind is RequestOutputKind.DELTA:
        return dataclasses.replace(completion, text="", token_ids=[], logprobs=no_logprobs,
                                   delta_text="", delta_token_ids=[], delta_logprobs=no_logprobs)
    return dataclasses.replace(completion, delta_text="", delta_token_ids=[],
                               delta_logprobs=no_logprobs)


@dataclass(slots=True)
class ParallelSampling:
    """The requests in flight with n > 1, by parent id; children map to (parent, index)."""
    _families: dict[str, _Family] = field(default_factory=dict, init=False)
    _parent_of: dict[str, tuple[str, int]] = field(default_factory=dict, init=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._families or request_id in self._parent_of

    def track(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
              params: SamplingParams, child_ids: list[str]) -> None:
        if params.n == 1:
            return
        want_logprobs = params.logprobs is not None
        empty = [CompletionOutput(i, "", [], cumulative_logprob=0.0 if want_logprobs else None,
                                  logprobs=[] if want_logprobs else None,
                                  delta_logprobs=[] if want_logprobs else None)
                 for i in range(params.n)]
        self._families[request_id] = _Family(request_id, prompt, prompt_token_ids,
                                             list(child_ids), params.output_kind, empty,
                                             [False] * params.n)
        for index, child_id in enumerate(child_ids):
            self._parent_of[child_id] = (request_id, index)

    def sequence_ids(self, request_ids: Iterable[str]) -> list[str]:
        """The scheduler's ids behind these ids: a parent's or a child's whole family
        (one failed or aborted sequence ends its request), others as they are."""
        out: list[str] = []
        seen: set[str] = set()
        for request_id in request_ids:
            family = self._family(request_id)
            for rid in family.child_ids if family is not None else (request_id,):
                if rid not in seen:
                    seen.add(rid)
                    out.append(rid)
        return out

    def client_ids(self, request_ids: Iterable[str]) -> list[str]:
        """The ids the caller added, for scheduler ids (children -> their parent)."""
        return list(dict.fromkeys(self._parent_of.get(r, (r, 0))[0] for r in request_ids))

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            family = self._family(request_id)
            if family is not None:
                self._drop(family)

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Child outputs -> one output per parent (at its first child's place), the
        children without news this step included with empty deltas; other outputs pass.
        A parent is finished, and forgotten, once every child is; a FINAL_ONLY parent
        has no output before."""
        if not self._families:
            return outputs
        merged: list[RequestOutput | _Family] = []
        fresh: dict[str, dict[int, CompletionOutput]] = {}
        for out in outputs:
            link = self._parent_of.get(out.request_id)
            if link is None:
                merged.append(out)
                continue
            parent_id, index = link
            family = self._families[parent_id]
            if parent_id not in fresh:
                fresh[parent_id] = {}
                merged.append(family)
            fresh[parent_id][index] = family.record(index, out)
        return [item if isinstance(item, RequestOutput) else self._parent_output(item, fresh)
                for item in merged if isinstance(item, RequestOutput) or item.due]

    def _parent_output(self, family: _Family, fresh: dict[str, dict[int, CompletionOutput]]
                       ) -> RequestOutput:
        out = family.output(fresh[family.request_id])
        if out.finished:
            self._drop(family)
        return out

    def _family(self, request_id: str) -> _Family | None:
        link = self._parent_of.get(request_id)
        return self._families.get(link[0] if link is not None else request_id)

    def _drop(self, family: _Family) -> None:
        self._families.pop(family.request_id, None)
        for child_id in family.child_ids:
            self._parent_of.pop(child_id, None)
