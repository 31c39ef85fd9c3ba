"""Requests the scheduler updated -> the RequestOutputs to hand out: the one place that
decides what a request is sent and when, for every caller (vLLM V1's OutputProcessor),
by the request's RequestOutputKind (engine/sampling_params.py) and the engine's
stream_interval.

- FINAL_ONLY: nothing is built before the request finishes (no text, no list copies); its
  one output holds the whole output.
- DELTA and CUMULATIVE (streamed): an output when the detokenizer releases tokens with
  their text (engine/output/detokenizer.py), and when the request finishes. With
  stream_interval N > 1 the first release goes out at once, later ones once N tokens
  of one sequence are held, the final one always; what is held is merged into the
  output that goes out, so no text, token id or logprob is lost or sent twice.
- n > 1: the children's outputs are merged (engine/output/parallel_sampling.py) before the
  interval applies, which then counts the parent's most advanced sequence: one output
  carries every sequence.

Prompt logprobs (SamplingParams.prompt_logprobs) arrive from the runner once, with the
request's first token (engine/sample/prompt_logprobs.py), and go out with its first
output from then on: DELTA only there, CUMULATIVE in every later output too (vLLM's),
FINAL_ONLY in its one output.

Token timing is stamped here at every step a request samples, whether an output goes out
or not (RequestMetrics.first_token_time / inter_token_latencies)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from engine.core.request import Request
from engine.output.parallel_sampling import ParallelSampling
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE = RequestOutputKind.CUMULATIVE
DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def position_logprobs(token_id: int, lp: Any) -> dict[int, Logprob]:
    """One position's entries from the runner's TokenLogprobs, as vLLM lays them out: the
    sampled token first with its own rank, then the top-k ranked 1..k (the sampled one,
    when among them, keeps its place and takes its top-k rank, the same number)."""
    entries = {token_id: Logprob(lp.sampled, lp.rank)}
    for rank, (top_id, value) in enumerate(lp.top.items(), start=1):
        entries[top_id] = Logprob(value, rank)
    return entries


def prompt_position_logprobs(prompt: Any) -> list[dict[int, Logprob] | None]:
    """The runner's PromptLogprobs as vLLM lays them out: None for the first position,
    then per position the prompt's token first with its own rank, then the top k ranked
    1..k (as position_logprobs)."""
    out: list[dict[int, Logprob] | None] = [None]
    for token_id, value, rank, top_ids, top_values in zip(
            prompt.token_ids, prompt.logprobs, prompt.ranks, prompt.top_ids, prompt.top_values,
            strict=True):
        entries = {token_id: Logprob(value, rank)}
        for top_rank, (top_id, top_value) in enumerate(zip(top_ids, top_values), start=1):
            entries[top_id] = Logprob(top_value, top_rank)
        out.append(entries)
    return out


@dataclass(slots=True)
class _Client:
    """A request as its caller added it (the parent when n > 1)."""
    kind: RequestOutputKind
    # A streamed output not handed out yet (stream_interval), later deltas merged in.
    held: RequestOutput | None = None
    sent: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    def sampled(self, now: float) -> None:
        if self.last_token_time == now:
            return  # a sibling sequence of the same step
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now

    def stamp(self, metrics: RequestMetrics | None) -> RequestMetrics | None:
        """`metrics` with the token timing since the previous output (a copy: a family
        hands the same object to each of its outputs)."""
        gaps, self.inter_token_latencies = self.inter_token_latencies, []
        if metrics is None:
            return None
        return dataclasses.replace(metrics, first_token_time=self.first_token_time,
                                   inter_token_latencies=gaps,
                                   last_token_time=self.last_token_time)


@dataclass(slots=True)
class _Sequence:
    """A scheduled request (a child when n > 1) and what it collects for its outputs."""
    request: Request
    prompt: str | None
    client: _Client
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    # Laid out when the runner hands them over; DELTA drops them once they went out.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class OutputProcessor:
    def __init__(self, stream_interval: int = 1) -> None:
        self.stream_interval = stream_interval
        # Which sequences make up which request; the engine asks it for the ids to abort.
        self.parallel = ParallelSampling()
        self._sequences: dict[str, _Sequence] = {}
        self._clients: dict[str, _Client] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sequences or request_id in self.parallel

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, requests: list[Request]) -> None:
        """`requests`: the sequences scheduled for it, in fan_out's order."""
        client = _Client(params.output_kind)
        self._clients[request_id] = client
        want_logprobs = params.logprobs is not None
        for request in requests:
            self._sequences[request.request_id] = _Sequence(
                request, prompt, client, 0.0 if want_logprobs else None,
                [] if want_logprobs else None)
        self.parallel.track(request_id, prompt, prompt_token_ids, params,
                            [r.request_id for r in requests])

    def process(self, updated: Iterable[Request], logprobs: Mapping[str, Any],
                prompt: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """The outputs due after a step; `updated`: the requests that got tokens in it,
        `logprobs`: the runner's TokenLogprobs by request id, one per new token, `prompt`:
        the prompt logprobs the step completed (engine/sample/prompt_logprobs.py), by
        request id."""
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        prompt = prompt or {}
        for request in updated:
            rid = request.request_id
            seq = self._sequences[rid]
            if rid in prompt:
                seq.prompt_logprobs = prompt_position_logprobs(prompt[rid])
            lps = logprobs.get(rid)
            if lps is not None and seq.logprobs is not None:
                # One per new token; a stop may have dropped the step's later ones.
                ids, base = request.all_token_ids, request.num_prompt_tokens
                for lp in lps[:len(ids) - base - len(seq.logprobs)]:
                    seq.cumulative_logprob += lp.sampled
                    seq.logprobs.append(position_logprobs(ids[base + len(seq.logprobs)], lp))
            seq.client.sampled(now)
            if request.is_finished:
                del self._sequences[rid]
            elif seq.client.kind is FINAL_ONLY:
                continue
            output = self._output(seq)
            if output is not None:
                outputs.append(output)
        return self._due(self.parallel.merge(outputs))

    def abort(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """The final outputs of requests the scheduler has just finished as aborted."""
        outputs = [self._output(self._sequences.pop(r.request_id)) for r in requests
                   if r.request_id in self._sequences]
        return self._due(self.parallel.merge(outputs))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drops failed sequences, and the requests they belong to, without an output."""
        request_ids = list(request_ids)
        for client_id in self.parallel.client_ids(request_ids):
            self._clients.pop(client_id, None)
        for rid in request_ids:
            self._sequences.pop(rid, None)
        self.parallel.forget(request_ids)

    def _output(self, seq: _Sequence) -> RequestOutput | None:
        """The sequence's output now; None when it goes on with nothing released."""
        request = seq.request
        finished = request.is_finished
        detokenizer = request.detokenizer
        delta_text, start, end = detokenizer.take_delta(request.num_output_tokens, finished)
        if start == end and not finished:
            return None
        base = request.num_prompt_tokens
        delta_ids = request.all_token_ids[base + start:base + end]
        logprobs = seq.logprobs
        delta_logprobs = None if logprobs is None else logprobs[start:end]
        if seq.client.kind is CUMULATIVE:
            # What is released so far: a step that gave several tokens (speculative
            # decoding) may end in one whose text is still held.
            text, token_ids = detokenizer.output_text, request.all_token_ids[base:base + end]
            logprobs = None if logprobs is None else logprobs[:end]
        else:  # DELTA, or FINAL_ONLY's one output, whose delta is all of it
            text, token_ids, logprobs = delta_text, delta_ids, delta_logprobs
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            finished_on_stop_token=request.finished_on_stop_token, delta_text=delta_text,
            delta_token_ids=delta_ids, delta_logprobs=delta_logprobs)
        prompt_logprobs = seq.prompt_logprobs
        if seq.client.kind is DELTA:
            seq.prompt_logprobs = None  # sent once
        return RequestOutput(request.request_id, seq.prompt, request.prompt_token_ids,
                             [completion], finished,
                             num_cached_tokens=max(request.num_cached_tokens, 0),
                             metrics=RequestMetrics(request.arrival_time,
                                                    request.first_scheduled_time,
                                                    num_preemptions=request.num_preemptions),
                             prompt_logprobs=prompt_logprobs)

    def _due(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Those of `outputs` to hand out now, with what was held before them; the rest
        is held for a later step."""
        due = []
        for out in outputs:
            client = self._clients[out.request_id]
            if client.held is not None:
                out = _after(client.held, out, client.kind)
                client.held = None
            if (not out.finished and client.sent and max(
                    len(c.delta_token_ids) for c in out.outputs) < self.stream_interval):
                client.held = out
                continue
            client.sent = True
            out.metrics = client.stamp(out.metrics)
            if out.finished:
                del self._clients[out.request_id]
            due.append(out)
        return due


def _after(held: RequestOutput, out: RequestOutput, kind: RequestOutputKind) -> RequestOutput:
    """`out` carrying the deltas of `held` (not handed out) before its own."""
    completions = []
    for old, new in zip(held.outputs, out.outputs, strict=True):
        text = old.delta_text + new.delta_text
        token_ids = old.delta_token_ids + new.delta_token_ids
        logprobs = (None if new.delta_logprobs is None
                    else (old.delta_logprobs or []) + new.delta_logprobs)
        merged = dataclasses.replace(new, delta_text=text, delta_token_ids=token_ids,
                                     delta_logprobs=logprobs)
        if kind is DELTA:
            merged.text, merged.token_ids, merged.logprobs = text, token_ids, logprobs
        completions.append(merged)
    # A held DELTA output may have carried the prompt logprobs, sent once.
    prompt_logprobs = held.prompt_logprobs if out.prompt_logprobs is None else out.prompt_logprobs
    return dataclasses.replace(out, outputs=completions, prompt_logprobs=prompt_logprobs)
