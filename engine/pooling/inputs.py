"""A pooling prompt and its parameters -> checked token ids (vLLM's renderer and
PoolingParams.verify for the pooling runner). Every check that can refuse a request runs
here, before anything is queued; a ValueError names what is wrong."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.pooling.params import PoolingParams
from engine.pooling.settings import PoolerSettings

# A text, token ids, or a (text, text_pair) pair for a cross-encoder.
PoolingPrompt = str | list[int] | tuple[str, str]


@dataclass(slots=True)
class TokenizedPrompt:
    token_ids: list[int]
    # A pair's second segment starts here (token type 1 from here on); None: one text.
    segment_start: int | None = None


class PoolingInputs:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 settings: PoolerSettings, embedding_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._max_model_len = max_model_len
        self._settings = settings
        self._embedding_size = embedding_size

    def check_params(self, params: PoolingParams | None) -> PoolingParams:
        """The request's PoolingParams, checked against this model (vLLM's verify)."""
        if params is None:
            return PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"a pooling request takes PoolingParams, got "
                             f"{type(params).__name__} (the engine runs runner='pooling')")
        settings, dims = self._settings, params.dimensions
        if dims is not None:
            if settings.task != "embed":
                raise ValueError("PoolingParams.dimensions applies to embeddings; this "
                                 f"model's task is {settings.task!r}")
            if not settings.is_matryoshka:
                raise ValueError(f"PoolingParams.dimensions={dims}: the model does not "
                                 "support Matryoshka embeddings (its config declares no "
                                 "matryoshka_dimensions / is_matryoshka); leave it unset")
            if dims > self._embedding_size:
                raise ValueError(f"PoolingParams.dimensions={dims}: the model's embeddings "
                                 f"have {self._embedding_size} values")
            allowed = settings.matryoshka_dimensions
            if allowed is not None and dims not in allowed:
                raise ValueError(f"PoolingParams.dimensions={dims}: the model supports "
                                 f"Matryoshka dimensions {list(allowed)}")
        k = params.truncate_prompt_tokens
        if k is not None and k > self._max_model_len:
            raise ValueError(f"PoolingParams.truncate_prompt_tokens={k} is greater than "
                             f"max_model_len={self._max_model_len}")
        return params

    def tokenize(self, prompt: PoolingPrompt, params: PoolingParams) -> TokenizedPrompt:
        k = params.truncate_prompt_tokens
        if k == -1:
            k = self._max_model_len
        tok = self._tokenizer
        # vLLM 0.32: text is tokenized with truncation to k (special tokens kept, the
        # tokenizer's truncation side); token ids are cut on that side.
        cut = {} if k is None else {"truncation": True, "max_length": k}
        if isinstance(prompt, str):
            result = TokenizedPrompt(tok.encode(prompt, **cut))
        elif isinstance(prompt, tuple):
            result = self._pair(prompt, cut)
        elif isinstance(prompt, list):
            ids = list(prompt)
            if k is not None and len(ids) > k:
                ids = ids[-k:] if getattr(tok, "truncation_side", "right") == "left" else ids[:k]
            result = TokenizedPrompt(ids)
        else:
            raise ValueError(f"a pooling prompt is a string, a list of token ids or a "
                             f"(text, text_pair) tuple, got {type(prompt).__name__}")
        ids = result.token_ids
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) > self._max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len="
                             f"{self._max_model_len} (PoolingParams.truncate_prompt_tokens "
                             "cuts it)")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {self._vocab}): {bad[:5]}")
        return result

    def _pair(self, prompt: tuple, cut: dict) -> TokenizedPrompt:
        if len(prompt) != 2 or not all(isinstance(t, str) for t in prompt):
            raise ValueError("a pair prompt is a (text, text_pair) tuple of two strings")
        if self._settings.task != "classify":
            raise ValueError("text pairs are a cross-encoder's input; this model's task is "
                             f"{self._settings.task!r}")
        encoded = self._tokenizer(prompt[0], prompt[1], **cut)
        types = encoded.get("token_type_ids")
        if not types or 1 not in types:
            return TokenizedPrompt(list(encoded["input_ids"]))
        second = types.index(1)
        if any(t != 1 for t in types[second:]):
            raise ValueError("token type ids must be zeros then ones")
        return TokenizedPrompt(list(encoded["input_ids"]), second)
