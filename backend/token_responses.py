"""Engine outputs -> the `tensorrt_llm` model's token-id tensors.

Streaming detokenization happens in the stateless `postprocessing` model, which sees
one response at a time. Two things make a per-response decode wrong: a token can end
in the middle of a multi-byte UTF-8 character, and SentencePiece tokenizers drop a
word's leading space when it is decoded on its own. So this builder (which has the
state) holds tokens back while they decode to an incomplete character, and sends
with each batch of new ids `prefix_ids`, the few ids before them (the prompt's tail
for the first batch); postprocessing returns decode(prefix + ids) minus
decode(prefix), which is exactly the text the new ids add."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from backend.token_request_parsing import TokenRequest
from engine.request import RequestOutput

PREFIX_TOKENS = 6
_REPLACEMENT = "\ufffd"


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    """The token-id path's text for `ids`: the engine model (stop words) and
    postprocessing (output text) must decode alike."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def decode_after(decode: Callable[[list[int]], str], prefix: list[int], ids: list[int]) -> str:
    """The text `ids` add after `prefix` (what postprocessing returns)."""
    if not prefix:
        return decode(ids)
    return decode(prefix + ids)[len(decode(prefix)):]


@dataclass(slots=True)
class TokenResponseBuilder:
    request: TokenRequest
    decode: Callable[[list[int]], str]
    _context: list[int] = field(default_factory=list)
    _pending: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._context = self.request.prompt_token_ids[-PREFIX_TOKENS:]

    def build(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        completion = out.outputs[0]
        if self.request.stream:
            self._pending.extend(completion.delta_token_ids)
            if not out.finished:
                if not self._pending or self.decode(self._context + self._pending).endswith(_REPLACEMENT):
                    return None
            ids, prefix = self._pending, self._context
            self._context = (self._context + ids)[-PREFIX_TOKENS:]
            self._pending = []
        else:
            if not out.finished:
                return None
            if self.request.exclude_input_in_output:
                ids, prefix = list(completion.token_ids), self._context
            else:
                ids, prefix = list(out.prompt_token_ids) + list(completion.token_ids), []
        if (out.finished and completion.finish_reason == "stop" and ids
                and not isinstance(completion.stop_reason, str)):
            # Stopped by EOS or end_id (not a stop string): as in TensorRT-LLM, the end
            # token is not part of the output.
            ids = ids[:-1]
        return {
            "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": np.array([[len(ids)]], dtype=np.int32),
            "prefix_ids": np.array(prefix, dtype=np.int32).reshape(1, -1),
        }
