"""Workload traces (opt-in `trace_path`): JSON Lines the replay and the tuner read
(tune/ package). Never text or token ids: a request is its lengths, its prompt's chained
block hashes (which prompts share prefixes, and how far), its limits and what happened
to it; a step is what it scheduled and how long it took.

Records, one JSON object a line, times in seconds since the trace began:
  {"type": "header", "version", "block_size", "model", "dtype", "host", "engine_args"}
  {"type": "request", "id", "arrival", "prompt_len", "block_hashes", "max_tokens",
   "min_tokens", "priority", "output_len", "first_token", "finish", "finish_reason",
   "cancel" (time of the abort, or null), "num_cached_tokens", "num_preemptions",
   "lora_name" (its LoRA adapter, or null for the base model), "tenant" (or null),
   speculative decoding: "num_drafts", "draft_tokens", "accepted_tokens" (its drafts
   verified, their tokens, the tokens of them it kept)}
  {"type": "step", "start", "wall", "prefill_tokens", "decode_tokens", "num_prefills",
   "batch_size", "context_tokens", "preemptions",
   speculative decoding: "num_drafts", "draft_tokens", "accepted_tokens" (the requests
   whose draft the step verified, the draft positions it computed, the ones kept),
   "expert_tokens" (mixture-of-experts models only: per MoE layer, in layer order, the
   token slots the router sent each expert in the step; each layer's list sums to the
   step's tokens times top_k)}
A request is written when it ends. decode_tokens counts the positions a decode computed:
a request verifying d draft tokens adds 1 + d (prefill_tokens + decode_tokens is the
step's forward size). The speculative fields are on every record of a trace whose
engine_args carry a speculative_config (its dataclass's fields, vLLM's keys), and on any
record with a draft otherwise; absent means 0. Version 1 throughout: the fields are
additive. The file is size-capped: past max_bytes it is moved to
`<path>.1` (replacing an older one) and a new file with the same header begins.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.kv_cache import BlockHasher, external_hash
from engine.core.kv_cache.hashing import lora_extra_key
from engine.core.request import Request
from engine.core.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from engine.models.moe import ExpertLoad

logger = logging.getLogger(__name__)

TRACE_VERSION = 1
_FALLBACK_HASHER = BlockHasher()


def prompt_block_hashes(request: Request, block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (what prefix caching keys on), as the
    64-bit integers KV events carry, so any hash algorithm writes JSON numbers."""
    count = request.num_prompt_tokens // block_size
    hashes = request.block_hashes[:count]
    if len(hashes) < count:  # prefix caching off: nothing hashed them
        hashes = _FALLBACK_HASHER.chain(request.prompt_token_ids, block_size, request.cache_salt,
                                        lora_key=lora_extra_key(request))
    return [external_hash(h) if isinstance(h, bytes) else h for h in hashes]


def speculative_args(config: Any) -> dict[str, Any] | None:
    """engine_args' "speculative_config": the SpeculativeConfig's fields (vLLM's keys, JSON
    values), None without speculation."""
    return None if config is None else dataclasses.asdict(config)


def step_features(out: SchedulerOutput) -> dict[str, int]:
    """What a step's time depends on, from its schedule, read before update_from_output
    (num_computed_tokens already counts the step's tokens, num_tokens not yet the
    sampled one). A decode is one token that completes its sequence, plus the draft
    tokens it verifies (all its positions count as decode tokens); anything else is a
    prefill chunk. With drafts scheduled: their count and the drafting requests'."""
    prefill = decode = num_prefills = context = 0
    drafts = out.scheduled_spec_decode_tokens
    draft_tokens = 0
    for request in out.scheduled_requests:
        n = out.num_scheduled_tokens[request.request_id]
        d = len(drafts.get(request.request_id, ())) if drafts else 0
        draft_tokens += d
        context += request.num_computed_tokens
        if n - d == 1 and request.num_computed_tokens - d >= request.num_tokens:
            decode += n
        else:
            prefill += n
            num_prefills += 1
    features = {"prefill_tokens": prefill, "decode_tokens": decode,
                "num_prefills": num_prefills, "batch_size": len(out.scheduled_requests),
                "context_tokens": context}
    if draft_tokens:
        features.update(num_drafts=sum(1 for ids in drafts.values() if ids),
                        draft_tokens=draft_tokens)
    return features


class TraceRecorder:
    def __init__(self, path: str | os.PathLike, max_bytes: int, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.block_size = header["block_size"]
        self._origin = time.monotonic()
        self._header = {"type": "header", "version": TRACE_VERSION,
                        "origin_wall_time": time.time(), **header}
        self._file = None
        # The model's MoE blocks' counters (engine/startup.py sets them once the file is
        # open); None: a dense model, and no expert_tokens in the steps.
        self.expert_load: ExpertLoad | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()  # an unwritable path raises here: open_trace turns tracing off
        self._first_token: dict[str, float] = {}
        self._step_start = 0.0
        self._step_preemptions = 0
        self._step_features: dict[str, Any] | None = None
        # Speculative decoding: the step's drafting requests (request, draft tokens, its
        # num_tokens before the update), and per request [drafts, draft tokens, accepted].
        self._speculative = bool(header.get("engine_args", {}).get("speculative_config"))
        self._drafting: list[tuple[Request, int, int]] = []
        self._spec_totals: dict[str, list[int]] = {}

    def _open(self) -> None:
        # Line-buffered: a live reader (python -m tuning.tune --server) sees each record
        # as it is written, idle or not; one write per step is noise beside the step.
        self._file = open(self.path, "w", encoding="utf-8", buffering=1)
        self._write(self._header)

    @property
    def off(self) -> bool:
        return self._file is None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            if self._file.tell() > self.max_bytes:
                self._file.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self._open()
        except OSError as exc:
            # A full disk or a vanished folder must not fail the step that wrote the
            # record: the trace is a side product, the requests are the product.
            self._switch_off(exc)

    def _switch_off(self, exc: OSError) -> None:
        logger.error("workload trace %s: %s; tracing switched off, requests are unaffected",
                     self.path, exc)
        file, self._file = self._file, None
        if self.expert_load is not None:  # nothing will read the counts any more
            self.expert_load.stop()
            self.expert_load = None
        try:
            if file is not None:
                file.close()
        except OSError:
            pass  # the buffered records that failed to flush are the ones just reported

    def now(self) -> float:
        return time.monotonic() - self._origin

    # One engine step, in its order: started -> scheduled (before update_from_output,
    # which step_features must not see) -> updated -> ended. A step that scheduled
    # nothing is not recorded.
    def step_started(self, num_preemptions_total: int) -> None:
        if self.off:
            return
        self._step_start = self.now()
        self._step_preemptions = num_preemptions_total
        self._step_features = None
        self._drafting = []
        if self.expert_load is not None:
            self.expert_load.take()  # forwards outside a step: warm-up, a failed step

    def step_scheduled(self, out: SchedulerOutput) -> None:
        """After the step's forward: its expert counts are complete."""
        if self.off:
            return
        self._step_features = step_features(out)
        drafts = out.scheduled_spec_decode_tokens
        self._drafting = [(r, len(drafts[r.request_id]), r.num_tokens)
                          for r in out.scheduled_requests if drafts.get(r.request_id)]
        if self._speculative or self._drafting:
            self._step_features.setdefault("num_drafts", 0)
            self._step_features.setdefault("draft_tokens", 0)
            self._step_features["accepted_tokens"] = 0
        if self.expert_load is not None:
            self._step_features["expert_tokens"] = self.expert_load.take()

    def requests_updated(self, requests: list[Request]) -> None:
        if self.off:
            return
        if self._drafting:
            self._settle_drafts()
        for request in requests:
            self._first_token.setdefault(request.request_id, self.now())
            if request.is_finished:
                self.finished(request)

    def _settle_drafts(self) -> None:
        """What each verified draft kept: the tokens its request really gained, less the
        target's own (tokens past a stop are dropped, so they are not counted; a request
        that got no token kept nothing)."""
        step_accepted = 0
        for request, num_draft, tokens_before in self._drafting:
            accepted = min(max(request.num_tokens - tokens_before - 1, 0), num_draft)
            step_accepted += accepted
            totals = self._spec_totals.setdefault(request.request_id, [0, 0, 0])
            totals[0] += 1
            totals[1] += num_draft
            totals[2] += accepted
        self._drafting = []
        if self._step_features is not None:
            self._step_features["accepted_tokens"] = step_accepted

    def step_ended(self, num_preemptions_total: int) -> None:
        """The step's time includes building its outputs."""
        if self._step_features is None:
            return
        start = self._step_start
        self._write({"type": "step", "start": round(start, 6),
                     "wall": round(self.now() - start, 6), **self._step_features,
                     "preemptions": num_preemptions_total - self._step_preemptions})
        self._step_features = None

    def finished(self, request: Request, cancelled: bool = False) -> None:
        if self.off:
            return
        now = self.now()
        params = request.sampling_params
        spec = self._spec_totals.pop(request.request_id, None)
        if spec is None and self._speculative:
            spec = [0, 0, 0]
        self._write({
            "type": "request", "id": request.request_id,
            "arrival": round(request.arrival_time - self._origin, 6),
            "prompt_len": request.num_prompt_tokens,
            "block_hashes": prompt_block_hashes(request, self.block_size),
            "max_tokens": request.max_tokens, "min_tokens": params.min_tokens,
            "priority": request.priority, "output_len": request.num_output_tokens,
            "first_token": _rounded(self._first_token.pop(request.request_id, None)),
            "finish": round(now, 6), "finish_reason": request.finish_reason,
            "cancel": round(now, 6) if cancelled else None,
            "num_cached_tokens": max(request.num_cached_tokens, 0),
            "num_preemptions": request.num_preemptions,
            "lora_name": None if request.lora_request is None else request.lora_request.lora_name,
            "tenant": request.tenant,
            **({} if spec is None else {"num_drafts": spec[0], "draft_tokens": spec[1],
                                        "accepted_tokens": spec[2]})})

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            try:
                self._file.close()
            except OSError as exc:
                self._switch_off(exc)


class NullTrace:
    """Tracing off: the engine calls the same hooks, which do nothing."""

    def step_started(self, num_preemptions_total: int) -> None:
        pass

    def step_scheduled(self, out: SchedulerOutput) -> None:
        pass

    def requests_updated(self, requests: list[Request]) -> None:
        pass

    def step_ended(self, num_preemptions_total: int) -> None:
        pass

    def finished(self, request: Request, cancelled: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
