"""A batch's sampling parameters gathered into tensors, once per step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from engine.structured_output.bitmask import BitmaskFiller
from engine.core.request import Request
from engine.sample.draft_rows import DraftPosition
from engine.structured_output.grammar import RequestGrammar

# Below this a temperature is treated as greedy: dividing by it would overflow the logits.
GREEDY_TEMPERATURE_EPS = 1e-5
# Validation admits any finite float, but these tensors are float32, where 1e-46 is 0 and
# 1e300 is inf: a top_p of 0 made the nucleus gather index -1 for the whole batch, and an
# inf temperature turned a min_tokens mask's -inf into nan. Parameters are clamped into
# float32's normal range, so none is 0 or inf.
_F32 = torch.finfo(torch.float32)


class _GrowingTokenIds:
    """A request's output ids as a tensor, extended by the new tokens only."""

    __slots__ = ("buffer", "length")

    def __init__(self) -> None:
        self.buffer = torch.empty(64, dtype=torch.long)
        self.length = 0

    def sync(self, request: Request) -> torch.Tensor:
        total = request.num_output_tokens
        if total < self.length:  # outputs never shrink in practice; rebuild if they ever do
            self.length = 0
        if total > self.length:
            new = request.all_token_ids[request.num_prompt_tokens + self.length:]
            if total > self.buffer.numel():
                grown = torch.empty(max(total, 2 * self.buffer.numel()), dtype=torch.long)
                grown[:self.length] = self.buffer[:self.length]
                self.buffer = grown
            self.buffer[self.length:total] = torch.tensor(new, dtype=torch.long)
            self.length = total
        return self.buffer[:total]


@dataclass(slots=True)
class SamplerState:
    """Per-request data kept across steps: seeded generators and token-id tensors."""

    generators: dict[str, torch.Generator] = field(default_factory=dict)
    prompt_ids: dict[str, torch.Tensor] = field(default_factory=dict)
    output_ids: dict[str, _GrowingTokenIds] = field(default_factory=dict)
    bitmask_filler: BitmaskFiller = field(default_factory=BitmaskFiller)

    def prompt_tensor(self, request: Request) -> torch.Tensor:
        ids = self.prompt_ids.get(request.request_id)
        if ids is None:
            ids = torch.tensor(request.prompt_token_ids, dtype=torch.long)
            self.prompt_ids[request.request_id] = ids
        return ids

    def output_tensor(self, request: Request | DraftPosition) -> torch.Tensor:
        if isinstance(request, DraftPosition):  # the request's output, then its drafts so far
            return torch.cat((self.output_tensor(request.request),
                              torch.tensor(request.prefix, dtype=torch.long)))
        ids = self.output_ids.get(request.request_id)
        if ids is None:
            ids = self.output_ids[request.request_id] = _GrowingTokenIds()
        return ids.sync(request)

    def generator(self, request_id: str, seed: int, device: torch.device) -> torch.Generator:
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self.generators[request_id] = gen
        return gen

    def free(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.prompt_ids.pop(request_id, None)
        self.output_ids.pop(request_id, None)


@dataclass(slots=True)
class PenaltyTensors:
    # Token ids padded with vocab_size (a scratch column the sampler drops).
    prompt_token_ids: torch.Tensor  # [N, Lp] int64; rows without repetition penalty are all padding
    output_token_ids: torch.Tensor  # [N, Lo] int64; rows without penalties are all padding
    repetition_penalty: torch.Tensor  # [N] float32, 1.0 = off
    presence_penalty: torch.Tensor  # [N] float32, 0.0 = off
    frequency_penalty: torch.Tensor  # [N] float32, 0.0 = off
    any_repetition: bool  # lets the sampler skip the whole-vocab passes a batch does not need
    any_presence_or_frequency: bool


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    requests: list[Request]  # row order; lets the sampler re-run one row to find a culprit
    # Fast path: every row greedy with nothing that changes the logits and no logprobs.
    argmax_only: bool
    all_greedy: bool
    temperature: torch.Tensor | None  # [N] float32; 1.0 on greedy rows (they are argmaxed instead)
    greedy_rows: torch.Tensor | None  # [N] bool; None when no row, or every row, is greedy
    top_k: torch.Tensor | None  # [N] int64, vocab_size = off; None when no row uses it
    top_p: torch.Tensor | None  # [N] float32, 1.0 = off
    min_p: torch.Tensor | None  # [N] float32, 0.0 = off
    # (row, generator) of random rows with a seed. Made here, not while sampling, so a
    # seed torch refuses fails before any row's generator has advanced.
    seeded_rows: list[tuple[int, torch.Generator]]
    penalties: PenaltyTensors | None
    # (row, token) pairs to mask with -inf: EOS/stop ids of rows still below min_tokens.
    min_tokens_rows: torch.Tensor | None  # [M] int64
    min_tokens_token_ids: torch.Tensor | None  # [M] int64
    max_num_logprobs: int | None  # None: no row asks for logprobs
    # Structured-output rows (ascending) and the tokens their grammars allow next: int32
    # [N, ceil(vocab/32)], filled at those rows only. None when no row is constrained.
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None

    @classmethod
    def build(cls, requests: list[Request | DraftPosition], vocab_size: int,
              device: torch.device | str, state: SamplerState | None = None
              ) -> "SamplingMetadata":
        """Rows in the order of `requests` (a drafting request's later rows are
        DraftPositions). Pass the sampler's `state` to reuse cached token tensors."""
        state = state if state is not None else SamplerState()
        n = len(requests)
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        greedy_flags: list[bool] = []
        seeded: list[tuple[int, torch.Generator]] = []
        penalty_rows: list[int] = []
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        max_logprobs: int | None = None
        grammar_rows: list[int] = []
        grammars: list[RequestGrammar] = []
        # Per grammar row, the drafts its matcher must accept first (None: none).
        grammar_prefixes: list[list[int] | None] = []
        any_random = any_greedy = use_top_k = use_top_p = use_min_p = False

        for row, req in enumerate(requests):
            p = req.sampling_params
            greedy = p.temperature < GREEDY_TEMPERATURE_EPS
            greedy_flags.append(greedy)
            any_greedy |= greedy
            any_random |= not greedy
            temps.append(1.0 if greedy else float(p.temperature))
            k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            top_ks.append(k)
            top_ps.append(float(p.top_p))
            min_ps.append(float(p.min_p))
            if not greedy:
                use_top_k |= k < vocab_size
                use_top_p |= p.top_p < 1.0
                use_min_p |= p.min_p > 0.0
                if p.seed is not None:
                    seeded.append((row, state.generator(req.request_id, p.seed, device)))
            if p.has_penalties:
                penalty_rows.append(row)
            if p.logprobs is not None:
                max_logprobs = max(max_logprobs or 0, p.logprobs)
            if req.grammar is not None:
                # The grammar alone decides where the output may end: under min_tokens
                # its EOS, once the only token it allows, would leave nothing to sample.
                grammar_rows.append(row)
                grammars.append(req.grammar)
                grammar_prefixes.append(req.prefix if isinstance(req, DraftPosition) else None)
            elif p.min_tokens and req.num_output_tokens < p.min_tokens:
                for tok in req.stop_token_ids:
                    if 0 <= tok < vocab_size:
                        mask_rows.append(row)
                        mask_ids.append(tok)

        all_greedy = not any_random
        argmax_only = all_greedy and not penalty_rows and not mask_rows and max_logprobs is None
        bitmask = (state.bitmask_filler.fill(grammars, grammar_rows, n, vocab_size,
                                             grammar_prefixes) if grammars else None)
        grammar = dict(grammar_rows=grammar_rows or None, grammar_bitmask=bitmask)
        if argmax_only:
            return cls(n, vocab_size, list(requests), True, True, None, None, None, None, None, [],
                       None, None, None, None, **grammar)

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            requests=list(requests),
            argmax_only=False,
            all_greedy=all_greedy,
            # A huge temperature saturates: a near-uniform row.
            temperature=None if all_greedy else f32(temps).clamp_(max=_F32.max),
            greedy_rows=(torch.tensor(greedy_flags, dtype=torch.bool, device=device)
                         if any_greedy and any_random else None),
            top_k=torch.tensor(top_ks, dtype=torch.long, device=device) if use_top_k else None,
            # A top_p below float32's resolution keeps the top token (and its ties) only.
            top_p=f32(top_ps).clamp_(min=_F32.tiny) if use_top_p else None,
            min_p=f32(min_ps) if use_min_p else None,
            seeded_rows=seeded,
            penalties=(_build_penalties(requests, penalty_rows, vocab_size, device, state)
                       if penalty_rows else None),
            min_tokens_rows=torch.tensor(mask_rows, dtype=torch.long, device=device) if mask_rows else None,
            min_tokens_token_ids=(torch.tensor(mask_ids, dtype=torch.long, device=device)
                                  if mask_rows else None),
            max_num_logprobs=max_logprobs,
            **grammar,
        )


def _build_penalties(requests: list[Request], rows: list[int], vocab_size: int,
                     device: torch.device | str, state: SamplerState) -> PenaltyTensors:
    empty = torch.empty(0, dtype=torch.long)
    prompts = [empty] * len(requests)
    outputs = [empty] * len(requests)
    rep = [1.0] * len(requests)
    pres = [0.0] * len(requests)
    freq = [0.0] * len(requests)
    for row in rows:
        req = requests[row]
        p = req.sampling_params
        rep[row], pres[row], freq[row] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        # Only the repetition penalty looks at the prompt.
        if p.repetition_penalty != 1.0:
            prompts[row] = state.prompt_tensor(req)
        outputs[row] = state.output_tensor(req)
    # A trailing padding column keeps every row non-empty, so pad_sequence never sees width 0.
    pad = torch.full((1,), vocab_size, dtype=torch.long)
    prompt_ids = pad_sequence([torch.cat((t, pad)) for t in prompts], batch_first=True,
                              padding_value=vocab_size)
    output_ids = pad_sequence([torch.cat((t, pad)) for t in outputs], batch_first=True,
                              padding_value=vocab_size)
    return PenaltyTensors(
        prompt_token_ids=prompt_ids.to(device),
        output_token_ids=output_ids.to(device),
        # Never 0 or inf: 0 / 0 and 0 * inf are nan.
        repetition_penalty=torch.tensor(rep, dtype=torch.float32, device=device).clamp_(
            _F32.tiny, _F32.max),
        presence_penalty=torch.tensor(pres, dtype=torch.float32, device=device),
        frequency_penalty=torch.tensor(freq, dtype=torch.float32, device=device),
        any_repetition=any(r != 1.0 for r in rep),
        any_presence_or_frequency=any(x != 0.0 for x in pres + freq),
    )
