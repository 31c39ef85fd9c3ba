"""The draft_model method: a smaller model with the target's tokenizer proposes the next k
tokens by greedy decoding (vLLM's draft_sample_method "greedy", its default: the drafts
are one-hot, verified as engine/sample/rejection.py verifies them), or, "probabilistic",
by sampling its own distribution where the request samples (drafts with probabilities).

The draft keeps its K/V in the target's blocks: tensors of its own shape
([num_kv_blocks, block_size, its kv heads, its head_dim] per layer) addressed by the
request's block table, so the pool's sizing counts both models' bytes per block
(engine/worker/kv_pool.py) and the scheduler keeps k lookahead slots past each request's
tokens for the positions a draft writes before the target has scheduled them.

Between steps, per request: the draft first computes the positions whose K/V it lacks
(a new request's whole prompt; after a verified draft, the tokens it did not propose),
then decodes k - 1 more positions, batched across requests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from engine.core.request import Request
from engine.models import load_model
from engine.sample.metadata import GREEDY_TEMPERATURE_EPS
from engine.worker import host_memory
from engine.worker.prefill_batch import chunk_inputs, padded_table
from kernels import dispatch

if TYPE_CHECKING:
    from engine.config.speculative import SpeculativeConfig
    from engine.models.loader import LoadedModel


def load_draft(spec: "SpeculativeConfig", target: "LoadedModel", max_model_len: int,
               batch_invariant: bool = False) -> "LoadedModel":
    """The draft, in the target's dtype on its device; refused (naming
    speculative_config.model) unless it shares the target's vocabulary and can reach
    max_model_len."""
    device = next(target.model.parameters()).device
    draft = load_model(spec.model, target.dtype, device=str(device),
                       quantization=spec.quantization, batch_invariant=batch_invariant)
    what = f"speculative_config.model {spec.model!r}"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{what}: its vocabulary has {draft.vocab_size} tokens, the target's "
                         f"{target.vocab_size}; a draft must share the target's tokenizer")
    mine, theirs = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        raise ValueError(f"{what}: its tokenizer differs from the target's ({differ} "
                         "entries differ); a draft must share the target's tokenizer")
    if any(w is not None for w in draft.sliding_windows):
        raise ValueError(f"{what}: a draft with sliding-window layers is not supported")
    context = spec.max_model_len or draft.max_position_embeddings
    if context < max_model_len:
        raise ValueError(f"{what}: its context ({context}) is shorter than max_model_len "
                         f"({max_model_len}); lower max_model_len")
    return draft


def draft_block_bytes(draft: "LoadedModel", block_size: int) -> int:
    return draft.kv_cache_bytes_per_token() * block_size


@dataclass(slots=True)
class _Drafted:
    """What the draft last did for a request: its tokens then, and the drafts it gave."""
    num_tokens: int
    drafts: list[int]
    num_preemptions: int


class DraftModelProposer:
    def __init__(self, draft: "LoadedModel", num_kv_blocks: int, block_size: int,
                 block_table: Callable[[str], list[int]], sample_method: str = "greedy",
                 seed: int = 0) -> None:
        """`block_table(request_id)`: the request's blocks (the scheduler's, one group).
        `sample_method` "probabilistic": a request that samples (temperature > 0) gets
        drafts drawn from softmax(draft logits / its temperature), and the runner weighs
        them with those probabilities (take_probs); greedy requests get the argmax."""
        self.loaded = draft
        self.model = draft.model
        self.device = next(self.model.parameters()).device
        self.probabilistic = sample_method == "probabilistic"
        # Unseeded requests' draws; a seeded request draws from its own generator.
        self._shared = torch.Generator(device=self.device)
        self._shared.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._probs: dict[str, list[torch.Tensor]] = {}
        self.block_size = block_size
        shape = (num_kv_blocks, block_size, draft.num_kv_heads, draft.head_dim)
        self.kv_caches = [(host_memory.zeros(shape, draft.dtype, self.device),
                           host_memory.zeros(shape, draft.dtype, self.device))
                          for _ in range(draft.num_layers)]
        self.block_table = block_table
        self._last: dict[str, _Drafted] = {}

    def _valid(self, request: Request) -> int:
        """Leading positions whose draft K/V holds the request's own tokens."""
        last = self._last.get(request.request_id)
        if last is None or last.num_preemptions != request.num_preemptions:
            return 0  # new, or its blocks were freed since
        valid = last.num_tokens  # every token it had then ...
        tokens = request.all_token_ids
        # ... and the drafts it fed back (all but the last) that the target kept.
        for draft in last.drafts[:-1]:
            if valid >= len(tokens) or tokens[valid] != draft:
                break
            valid += 1
        return min(valid, request.num_tokens - 1)  # the last token is always fed

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        tables = [self.block_table(r.request_id) for r in requests]
        starts = [self._valid(r) for r in requests]
        token_ids: list[int] = []
        for request, start in zip(requests, starts):
            token_ids.extend(request.all_token_ids[start:])
        lengths = [r.num_tokens for r in requests]
        firsts = self._forward(requests, token_ids, [n - s for n, s in zip(lengths, starts)],
                               lengths, tables)
        drafts = [[t] for t in firsts]
        for step in range(1, max(limits)):
            active = [i for i, limit in enumerate(limits) if limit > step]
            if not active:
                break
            nexts = self._forward([requests[i] for i in active],
                                  [drafts[i][-1] for i in active], [1] * len(active),
                                  [lengths[i] + step for i in active], [tables[i] for i in active])
            for i, token in zip(active, nexts):
                drafts[i].append(token)
        for request, proposed in zip(requests, drafts):
            self._last[request.request_id] = _Drafted(request.num_tokens, proposed,
                                                      request.num_preemptions)
        return drafts

    def _forward(self, requests: Sequence[Request], token_ids: list[int],
                 query_lens: list[int], seq_lens: list[int], tables: list[list[int]]
                 ) -> list[int]:
        """Each sequence's tokens through the draft; the token it proposes after the last
        one: its argmax, or a draw (probabilistic, for a request that samples)."""
        device = self.device
        positions, qsl, metas = chunk_inputs(query_lens, seq_lens, [padded_table(tables)],
                                             self.block_size, lambda t: t.to(device))
        hidden = self.model(torch.tensor(token_ids, dtype=torch.int64, device=device),
                            positions.to(device), self.kv_caches, metas[0])
        logits = self.model.compute_logits(hidden[(qsl[1:] - 1).to(device)], upcast=False)
        tokens = dispatch.argmax_rows(logits).tolist()
        if self.probabilistic:
            for row, request in enumerate(requests):
                temperature = request.sampling_params.temperature
                if temperature >= GREEDY_TEMPERATURE_EPS:
                    tokens[row] = self._draw(request, logits[row].float() / temperature)
        return tokens

    def _draw(self, request: Request, logits: torch.Tensor) -> int:
        """A token from softmax(logits), whose row is kept for the verification."""
        probs = torch.softmax(logits, dim=-1)
        seed = request.sampling_params.seed
        generator = self._shared
        if seed is not None:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = self._generators[request.request_id] = torch.Generator(
                    device=probs.device)
                generator.manual_seed(seed)
        self._probs.setdefault(request.request_id, []).append(probs)
        return int(torch.multinomial(probs, 1, generator=generator))

    def take_probs(self, request: Request) -> torch.Tensor | None:
        """The draft's distribution at each position it just proposed for `request`
        ([k, vocab]); None for argmax drafts (one-hot)."""
        rows = self._probs.pop(request.request_id, None)
        return None if rows is None else torch.stack(rows)

    def finished(self, requests: Sequence[Request]) -> None:
        for request in requests:
            self._last.pop(request.request_id, None)
            self._generators.pop(request.request_id, None)
            self._probs.pop(request.request_id, None)
