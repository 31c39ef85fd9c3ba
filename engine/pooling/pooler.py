"""Hidden states -> one vector per request: the pooling method (CLS, LAST, MEAN) across
a prompt's chunks, then the head (an embedding's Matryoshka cut and L2 normalisation, or
a classifier's logits and activation). All in float32, as vLLM's pooler heads run.

A prompt computed in several chunks (chunked prefill, or a prefix-cache hit before it)
pools across them: LAST reads the last chunk's last row, CLS keeps the first chunk's
first row, MEAN keeps a running float32 sum. vLLM 0.32 refuses chunked prefill for CLS
and MEAN on decoders; summing chunk by chunk gives the same vector (within float32
rounding), so here only prefix caching is off for them (a cached prefix has K/V but no
hidden states to pool). A chunk that starts at position 0 resets the request's state, so
a preempted request's recompute starts clean."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.pooling.params import PoolingParams
from engine.pooling.settings import PoolerSettings


class SequencePooler:
    def __init__(self, pooling_type: str) -> None:
        if pooling_type not in ("CLS", "LAST", "MEAN"):
            raise ValueError(f"pooling type must be CLS, LAST or MEAN, got {pooling_type!r}")
        self.pooling_type = pooling_type
        # Request id -> CLS: its first row; MEAN: the float32 sum of its rows so far.
        self._partial: dict[str, torch.Tensor] = {}

    def add(self, request_id: str, rows: torch.Tensor, start: int, done: bool,
            prompt_len: int) -> torch.Tensor | None:
        """`rows` [n, H]: the request's chunk, from prompt position `start`. Returns its
        pooled float32 vector [H] when `done` (the chunk ends the prompt), else None."""
        kind = self.pooling_type
        if kind == "LAST":
            return rows[-1].float() if done else None
        if start == 0:
            self._partial[request_id] = (rows[0].float() if kind == "CLS"
                                         else rows.float().sum(dim=0))
        elif request_id not in self._partial:
            raise RuntimeError(f"request {request_id!r}: chunk from position {start} "
                               f"without its first chunk ({kind} pooling)")
        elif kind == "MEAN":
            self._partial[request_id] += rows.float().sum(dim=0)
        if not done:
            return None
        pooled = self._partial.pop(request_id)
        return pooled / prompt_len if kind == "MEAN" else pooled

    def drop(self, request_ids) -> None:
        for request_id in request_ids:
            self._partial.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._partial)


def embedding_head(pooled: torch.Tensor, params: PoolingParams,
                   settings: PoolerSettings) -> torch.Tensor:
    """vLLM's EmbeddingPoolerHead: the Matryoshka cut, then normalisation."""
    if params.dimensions is not None:
        pooled = pooled[..., :params.dimensions]
    activate = settings.use_activation if params.use_activation is None else params.use_activation
    return F.normalize(pooled, p=2, dim=-1) if activate else pooled


def classifier_head(logits: torch.Tensor, params: PoolingParams,
                    settings: PoolerSettings) -> torch.Tensor:
    activate = settings.use_activation if params.use_activation is None else params.use_activation
    if not activate or settings.classifier_activation == "identity":
        return logits
    if settings.classifier_activation == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
