"""SchedulerOutput -> batch tensors -> model forward -> sampled tokens.

KV-cache groups (engine/core/kv_cache/groups.py): the cache is `group_size` slot tensors
and layer l uses its slot's tensor through its group's block table. A model of one group
(Llama, Mistral) gets one AttentionMetadata for every layer, as before groups existed
(the fused single-sequence decode and the CUDA graphs read it); a hybrid one gets one per
layer, each its group's (block tables and slot mapping per group; query_start_loc and
seq_lens shared).

Over 300 lines: a step's batch tensors, per-group metadata, forward and sampling share
the runner's persistent buffers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from engine.core.kv_cache.groups import KVCacheLayout
from engine.core.request import Request
from engine.core.sched_output import SchedulerOutput
from engine.faults import FaultPlan, InjectedFailure
from engine.models import AttentionMetadata
from engine.models.layers import Linear
from engine.models.loader import LoadedModel
from engine.sample.prompt_logprobs import (PromptLogprobs, PromptLogprobsTracker,
                                           StepPromptRows, for_each_slice)
from engine.sample.draft_rows import expand_rows
from engine.sample.rejection import accept_one_hot, accept_with_probs
from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.worker import host_memory
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.kv_pool import kv_layout
from engine.worker.prefill_batch import chunk_inputs, padded_table
from kernels import dispatch

if TYPE_CHECKING:
    from engine.lora.runtime import LoRARuntime, LoRAStepPlan


@dataclass(slots=True)
class TokenLogprobs:
    sampled: float
    top: dict[int, float]  # top-k alternatives, best first (may include the sampled one)
    rank: int = 1  # the sampled token's, over the vocabulary


@dataclass(slots=True)
class RunnerOutput:
    # Per request its new tokens: one, or with speculative decoding the accepted drafts
    # and one more (engine/sample/rejection.py).
    sampled_token_ids: dict[str, list[int]]
    # Per request asking for logprobs, one entry per new token.
    logprobs: dict[str, list[TokenLogprobs]]
    # SamplingParams.prompt_logprobs completed in the step, by request id
    # (engine/sample/prompt_logprobs.py): handed over once, with the first sampled token.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


@dataclass(slots=True)
class StepInputs:
    """What one forward needs, already on the model's device: the part of a step that
    rank 0 broadcasts to tensor-parallel workers (engine/distributed/)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    # One AttentionMetadata for a model of one KV-cache group, else one per group.
    meta: AttentionMetadata | tuple[AttentionMetadata, ...]
    # Rows whose logits are computed; None when no request samples this step.
    sample_rows: torch.Tensor | None
    # enable_lora: the step's rows by adapter (every rank applies it to its shards).
    lora: "LoRAStepPlan | None" = None
    # Rows whose logits give prompt logprobs (engine/sample/prompt_logprobs.py); every
    # rank computes them, a slice at a time, since the lm_head's gather is a collective.
    prompt_rows: torch.Tensor | None = None

    def to(self, device: torch.device) -> "StepInputs":
        if isinstance(self.meta, AttentionMetadata):
            meta = _meta_to(self.meta, device)
        else:
            meta = tuple(_meta_to(m, device) for m in self.meta)
        rows = None if self.sample_rows is None else self.sample_rows.to(device)
        prompt_rows = None if self.prompt_rows is None else self.prompt_rows.to(device)
        return StepInputs(self.input_ids.to(device), self.positions.to(device), meta, rows,
                          self.lora, prompt_rows)


def _meta_to(m: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(m.slot_mapping.to(device), m.block_tables.to(device),
                             m.query_start_loc.to(device), m.seq_lens.to(device),
                             m.max_query_len, m.max_seq_len)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_kv_blocks: int, block_size: int,
                 seed: int = 0, faults: FaultPlan = FaultPlan(),
                 send_step: Callable[[StepInputs], None] | None = None,
                 lora: "LoRARuntime | None" = None, batch_invariant: bool = False,
                 layout: KVCacheLayout | None = None) -> None:
        """`layout`: the KV-cache groups the scheduler allocates for; None: the loaded
        model's (engine.worker.kv_pool.kv_layout)."""
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.vocab_size = loaded.vocab_size
        self.device = next(self.model.parameters()).device
        self.layout = layout = layout or kv_layout(loaded)
        if layout.num_layers != loaded.num_layers:
            raise ValueError(f"KV-cache layout of {layout.num_layers} layers for a model of "
                             f"{loaded.num_layers}")
        self.num_groups = layout.num_groups
        shape = (num_kv_blocks, block_size, loaded.num_kv_heads, loaded.head_dim)
        slots = [(host_memory.zeros(shape, loaded.dtype, self.device),
                  host_memory.zeros(shape, loaded.dtype, self.device))
                 for _ in range(layout.group_size)]
        # Per layer, as the model takes it; layers in the same slot of different groups
        # share tensors (with one group, slot l is layer l).
        self.kv_caches = [slots[slot] for slot in layout.layer_slot]
        # batch_invariant: each request's row sampled alone (engine/sample/sampler.py).
        self.sampler = Sampler(seed, batch_invariant=batch_invariant)
        self.fail_at_step = faults.model_step
        self.num_steps = 0
        self.decode_graphs: DecodeGraphs | None = None
        # Tensor parallelism: hands each step's inputs to the workers before this rank
        # runs it, since every rank's forward joins the same collectives.
        self.send_step = send_step
        # Per-step metadata is built on the host; on a GPU it goes up from page-locked
        # memory without blocking (torch's caching host allocator reuses those pages, and
        # keeps each until its copy is done).
        self._pinned = self.device.type == "cuda"
        # enable_lora: groups each step's rows by adapter for the wrapped layers.
        self.lora = lora
        # SamplingParams.prompt_logprobs: per request, the prompt rows computed so far.
        self.prompt_logprobs = PromptLogprobsTracker()
        # Speculative decoding's num_speculative_tokens (set at start-up; 0: off): a
        # drafting request samples up to this many rows more.
        self.num_spec_tokens = 0

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """Decode-only steps run through DecodeGraphs: captured CUDA graphs when `capture`
        (a GPU), the same padded batches eagerly otherwise (what the tests check on CPU)."""
        graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs, max_model_len,
                              self.block_size, self.device,
                              None if self.num_groups == 1 else self.layout.layer_group)
        if capture:
            with torch.inference_mode():
                graphs.capture()
        self.decode_graphs = graphs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        # First, as vLLM V1's runner: a finished id may come back as a new request now.
        for request_id in out.finished_req_ids:
            self.sampler.free(request_id)
            self.prompt_logprobs.free(request_id)
        for request_id in out.preempted_req_ids:
            self.prompt_logprobs.drop(request_id)
        requests = out.scheduled_requests
        if not requests:
            return RunnerOutput({}, {})
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise InjectedFailure(f"injected model failure at engine step {self.num_steps}")
        input_ids, positions, meta, sample_rows, sample_reqs = self._prepare(out)
        plan = None if self.lora is None else self.lora.plan_step(
            requests, [out.num_scheduled_tokens[r.request_id] for r in requests])
        prompt_rows = self.prompt_logprobs.plan(out)
        inputs = StepInputs(input_ids, positions, meta, sample_rows if sample_reqs else None,
                            plan, None if prompt_rows is None else self._upload(prompt_rows.rows))
        if self.send_step is not None:
            self.send_step(inputs)
        logits = self.forward(inputs, prompt_rows)
        if logits is None:
            return RunnerOutput({}, {})
        drafts = out.scheduled_spec_decode_tokens
        metadata = self.sampler.prepare(expand_rows(sample_reqs, drafts), self.vocab_size,
                                        self.device)
        result = self.sampler(logits, metadata)
        token_ids = result.sampled_token_ids.tolist()
        # Per request, its new tokens and the row of its first one.
        sampled: dict[str, list[int]] = {}
        first_rows: list[int] = []
        row = 0
        for request in sample_reqs:
            proposed = drafts.get(request.request_id) if drafts else None
            first_rows.append(row)
            if not proposed:
                sampled[request.request_id] = [token_ids[row]]
                row += 1
                continue
            if request.spec_token_probs is None:
                sampled[request.request_id] = accept_one_hot(token_ids, row, proposed)
            else:
                sampled[request.request_id] = self._accept_with_probs(
                    request, proposed, logits[row:row + len(proposed)],
                    token_ids[row + len(proposed)])
            row += len(proposed) + 1
        # Only once sampling succeeded: a failed step's requests sample again later.
        prompt_logprobs = self.prompt_logprobs.take_completed(sample_reqs)
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if result.sampled_logprobs is not None:
            chosen = result.sampled_logprobs.tolist()
            ranks = result.sampled_ranks.tolist()
            top_ids = result.topk_token_ids.tolist() if result.topk_token_ids is not None else None
            top_vals = result.topk_logprobs.tolist() if result.topk_logprobs is not None else None
            for first, request in zip(first_rows, sample_reqs):
                k = request.sampling_params.logprobs
                if k is None:
                    continue
                rows = range(first, first + len(sampled[request.request_id]))
                logprobs[request.request_id] = [TokenLogprobs(
                    chosen[r], dict(zip(top_ids[r][:k], top_vals[r][:k])) if top_ids and k
                    else {}, ranks[r]) for r in rows]
        return RunnerOutput(sampled, logprobs, prompt_logprobs)

    def _accept_with_probs(self, request: Request, proposed: list[int], logits: torch.Tensor,
                           bonus: int) -> list[int]:
        """A draft model's drafts with probabilities: the target's distributions at the
        drafted positions (the rows as sampled, engine/sample/draft_rows.py), weighed
        against the draft's (engine/sample/rejection.py)."""
        rows = expand_rows([request], {request.request_id: proposed})[:len(proposed)]
        target = self.sampler.target_probs(
            logits, self.sampler.prepare(rows, self.vocab_size, self.device))
        seed = request.sampling_params.seed
        generator = (self.sampler.shared_generator(self.device) if seed is None
                     else self.sampler.state.generator(request.request_id, seed, self.device))
        return accept_with_probs(target, request.spec_token_probs[:len(proposed)].to(
            target.device), proposed, bonus, generator)

    def forward(self, inputs: StepInputs, prompt_rows: StepPromptRows | None = None
                ) -> torch.Tensor | None:
        """The model's part of a step (what every tensor-parallel rank runs): logits of
        the sampled rows, or None when none samples. The logits of inputs.prompt_rows are
        computed too and reduced into `prompt_rows` (rank 0; workers pass None)."""
        if self.lora is None or inputs.lora is None:
            return self._forward(inputs, prompt_rows)
        self.lora.apply(inputs.lora)
        try:
            return self._forward(inputs, prompt_rows)
        finally:
            self.lora.clear_step()

    def _forward(self, inputs: StepInputs, prompt_rows: StepPromptRows | None
                 ) -> torch.Tensor | None:
        hidden = None
        meta = inputs.meta
        one_group = isinstance(meta, AttentionMetadata)
        first = meta if one_group else meta[0]
        if self.decode_graphs is not None and first.max_query_len == 1:
            hidden = self.decode_graphs.run(inputs.input_ids, inputs.positions, meta)
        if hidden is None:
            layer_meta = meta if one_group else [meta[g] for g in self.layout.layer_group]
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, layer_meta)
        # The sampled rows' logits in one call of their own, as without prompt rows, so
        # the sampled tokens stay what they were (batch_invariant included).
        logits = (None if inputs.sample_rows is None
                  else self.model.compute_logits(hidden[inputs.sample_rows], upcast=False))
        if inputs.prompt_rows is not None:
            for_each_slice(inputs.prompt_rows, hidden, self.vocab_size,
                           self.model.compute_logits,
                           None if prompt_rows is None else prompt_rows.reduce)
        return logits

    def _prepare(self, out: SchedulerOutput):
        requests = out.scheduled_requests
        num_scheduled = out.num_scheduled_tokens
        block_ids = out.block_ids
        bs = self.block_size
        token_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        one_group = self.num_groups == 1
        # Per group, each request's block table (one group: the one list, as before).
        tables: list[list[int]] = []
        group_tables = [tables] if one_group else [[] for _ in range(self.num_groups)]
        sample_reqs: list[Request] = []
        # Per request, how many of its last rows are sampled: 1, or with k drafts k + 1.
        sample_counts: list[int] = []
        drafts = out.scheduled_spec_decode_tokens
        for request in requests:
            n = num_scheduled[request.request_id]
            end = request.num_computed_tokens  # already counts this step's tokens
            proposed = drafts.get(request.request_id) if drafts else None
            if proposed:  # the last n - len(proposed) known tokens, then the drafts
                token_ids.extend(request.all_token_ids[end - n:end - len(proposed)])
                token_ids.extend(proposed)
            elif n == 1:
                token_ids.append(request.all_token_ids[end - 1])
            else:
                token_ids.extend(request.all_token_ids[end - n:end])
            query_lens.append(n)
            seq_lens.append(end)
            if one_group:
                tables.append(block_ids[request.request_id][0])
            else:
                for group, table in zip(group_tables, block_ids[request.request_id]):
                    group.append(table)
            done = end >= request.num_tokens
            sample_counts.append(len(proposed) + 1 if proposed else int(done))
            if done:
                sample_reqs.append(request)

        device = self.device
        num_seqs = len(requests)
        block_tables = [padded_table(t) for t in group_tables]
        if len(token_ids) == num_seqs == len(sample_reqs):
            # Decodes only (one token a sequence, every one sampled; a 1-token prefill
            # chunk that is not a prompt's last is not sampled): the tensor recipe
            # below costs ~20 small ops, 0.3 ms a step, ~3% of a single stream's token.
            positions_list = [end - 1 for end in seq_lens]
            query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
            seq_lens_t = self._upload(torch.tensor(seq_lens, dtype=torch.int32))
            metas = []
            for tabs, block_table in zip(group_tables, block_tables):
                slots = [table[pos // bs] * bs + pos % bs
                         for table, pos in zip(tabs, positions_list)]
                metas.append(AttentionMetadata(
                    slot_mapping=self._upload(torch.tensor(slots, dtype=torch.int64)),
                    block_tables=self._upload(block_table),
                    query_start_loc=query_start_loc, seq_lens=seq_lens_t,
                    max_query_len=1, max_seq_len=max(seq_lens)))
            return (self._upload(torch.tensor(token_ids, dtype=torch.int64)),
                    self._upload(torch.tensor(positions_list, dtype=torch.int64)),
                    metas[0] if one_group else tuple(metas),
                    torch.arange(num_seqs, device=device), sample_reqs)
        positions, qsl, metas = chunk_inputs(query_lens, seq_lens, block_tables, bs,
                                             self._upload)
        counts = torch.tensor(sample_counts, dtype=torch.int64)
        if drafts:  # a drafting request samples its last k + 1 rows
            # Row r of a request sampling c rows is c - r rows before its end.
            back = (torch.repeat_interleave(torch.cumsum(counts, 0), counts)
                    - torch.arange(int(counts.sum())))
            sample_rows = torch.repeat_interleave(qsl[1:], counts) - back
        else:
            sample_rows = (qsl[1:] - 1)[counts.bool()]
        input_ids = self._upload(torch.tensor(token_ids, dtype=torch.int64))
        return (input_ids, self._upload(positions), metas[0] if one_group else tuple(metas),
                self._upload(sample_rows), sample_reqs)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if not self._pinned:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def build_matmul_primitives(self, max_num_tokens: int, max_num_seqs: int) -> int:
        """oneDNN's primitive for every row count a step can give each prepacked matmul
        (dispatch.build_matmul_primitives): the layers see up to a step's tokens, the
        lm_head one row per sequence sampled (k + 1 for a drafting one)."""
        weights = [(module.prepared, max_num_tokens) for module in self.model.modules()
                   if isinstance(module, Linear) and module.prepared is not None]
        lm_head = getattr(self.model, "lm_head_prepared", None)
        if lm_head is not None:
            weights.append((lm_head, min(max_num_tokens,
                                         max_num_seqs * (1 + self.num_spec_tokens))))
        return dispatch.build_matmul_primitives(weights)

    def warm_up(self, max_num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """Run a small prefill and a full batch of decodes through `execute` once, before
        serving (as vLLM's dummy run): the first step of a process paid ~0.8 s of MKL and
        oneDNN set-up plus the native kernels' load (fp32, AVX2 EPYC), and the first
        users of a fresh server paid it. The requests exist only here; their K/V lands in
        blocks that no request owns yet, so it is never read. On a GPU every attention
        kernel variant reachable within the limits is compiled first."""
        dispatch.warm_up(self.kv_caches[0][0], self.loaded.num_heads, max_model_len,
                         max_num_tokens)
        self.build_matmul_primitives(max_num_tokens, max_num_seqs)
        bs = self.block_size
        # A FaultPlan counts serving steps only.
        fail_at, self.fail_at_step = self.fail_at_step, 0
        prefill_len = min(max_num_tokens, 4 * bs)
        num_decodes = max(1, min(max_num_seqs, max_num_tokens - prefill_len))
        prefill = [Request("warm-up-prefill", [0] * prefill_len)]
        decodes = [Request(f"warm-up-{i}", [0] * bs, SamplingParams(
            temperature=0.0 if i % 2 else 1.0, top_p=0.9, top_k=50, seed=i, logprobs=1))
            for i in range(num_decodes)]
        for batch, num_tokens in ((prefill, prefill_len), (decodes, 1)):
            for request in batch:
                request.num_computed_tokens = request.num_tokens  # counts this step's tokens
            self.execute(SchedulerOutput(
                batch, {r.request_id: num_tokens for r in batch}, num_tokens * len(batch),
                block_ids={r.request_id: tuple(list(range(-(-r.num_tokens // bs)))
                                               for _ in range(self.num_groups))
                           for r in batch}))
            for request in batch:
                self.sampler.free(request.request_id)
        self.num_steps, self.fail_at_step = 0, fail_at
