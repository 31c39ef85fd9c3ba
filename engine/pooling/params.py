"""PoolingParams: what a pooling request may ask for (vLLM's name). Torch-free, so the
backend can parse a request's JSON with it on any host."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from engine.values import convert

# What a pooling request's JSON may carry (engine_args and sampling keys are refused by
# name, so a client that sends max_tokens to an embedder learns it at once).
FIELDS = ("dimensions", "use_activation", "truncate_prompt_tokens")


@dataclass(slots=True)
class PoolingParams:
    # Matryoshka: keep the first `dimensions` values, then normalise (vLLM's order).
    # Only for a model whose config declares matryoshka_dimensions / is_matryoshka.
    dimensions: int | None = None
    # vLLM 0.32's switch for the pooler's activation: for embeddings the L2
    # normalisation, for a classifier its sigmoid / softmax. None: the model's default
    # (an embedder normalises unless its sentence-transformers folder has no Normalize
    # module; a classifier activates unless its config says otherwise).
    use_activation: bool | None = None
    # Keep at most this many prompt tokens (-1: max_model_len), as vLLM 0.32's
    # tokenization does: text is tokenized with truncation to this length (special
    # tokens kept, the tokenizer's truncation side), token ids are cut on that side.
    # vLLM 0.32 takes it in tokenization_kwargs; PoolingParams held it before 0.11.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) \
                    or self.dimensions < 1:
                raise ValueError(f"PoolingParams.dimensions must be an integer >= 1, "
                                 f"got {self.dimensions!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"PoolingParams.use_activation must be a boolean, "
                             f"got {self.use_activation!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                              or (k < 1 and k != -1)):
            raise ValueError(f"PoolingParams.truncate_prompt_tokens must be -1 or an "
                             f"integer >= 1, got {k!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "PoolingParams":
        """From a request's JSON object (values may be strings, as Triton parameters
        are); an unknown key, a generation parameter included, is refused by name."""
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise ValueError(f"pooling parameters {unknown} are not accepted; a pooling "
                             f"request takes {list(FIELDS)}")
        kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        return cls(**{key: convert(f"PoolingParams.{key}", value, kinds[key])
                      for key, value in values.items()})
