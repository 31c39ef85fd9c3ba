"""What a pooling request hands back, in vLLM's shapes (vllm/outputs.py): the engine's
step yields PoolingRequestOutput (the pooled vector); LLM.embed and LLM.score wrap it as
EmbeddingRequestOutput (`.outputs.embedding`) and ScoringRequestOutput (`.outputs.score`).
Vectors are plain lists of floats, so this module stays torch-free."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar


@dataclass(slots=True)
class PoolingOutput:
    """The pooled vector of one request: an embedding (normalised unless the request or
    the model says not to), or a classifier's per-label scores."""
    data: list[float]


O = TypeVar("O")


class PoolingRequestOutput(Generic[O]):
    """vLLM's fields. `outputs` is None only for a request aborted before it finished."""

    __slots__ = ("request_id", "outputs", "prompt_token_ids", "num_cached_tokens", "finished")

    def __init__(self, request_id: str, outputs: O, prompt_token_ids: list[int],
                 num_cached_tokens: int, finished: bool = True) -> None:
        self.request_id = request_id
        self.outputs = outputs
        self.prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.finished = finished

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(request_id={self.request_id!r}, "
                f"outputs={self.outputs!r}, prompt_token_ids={self.prompt_token_ids}, "
                f"num_cached_tokens={self.num_cached_tokens}, finished={self.finished})")


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    __slots__ = ()

    @staticmethod
    def from_base(output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return EmbeddingRequestOutput(output.request_id, EmbeddingOutput(output.outputs.data),
                                      output.prompt_token_ids, output.num_cached_tokens,
                                      output.finished)


@dataclass(slots=True)
class ScoringOutput:
    score: float


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    __slots__ = ()

    @staticmethod
    def from_base(output: PoolingRequestOutput) -> "ScoringRequestOutput":
        """A cross-encoder's one label (vLLM's Scoring API takes num_labels == 1 only)."""
        data = output.outputs.data
        if len(data) != 1:
            raise ValueError(f"a score is one value; the model gave {len(data)}")
        return ScoringRequestOutput(output.request_id, ScoringOutput(data[0]),
                                    output.prompt_token_ids, output.num_cached_tokens,
                                    output.finished)
