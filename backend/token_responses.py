"""Engine outputs -> the `tensorrt_llm` model's token-id tensors.

Streaming detokenization happens in the stateless `postprocessing` model, which sees
one response at a time. Two things make a per-response decode wrong: a token can end
in the middle of a multi-byte UTF-8 character, and SentencePiece tokenizers drop a
word's leading space when it is decoded on its own. The engine releases output only
where every token so far decodes to whole characters (a DELTA output's `token_ids`), and this
builder sends with each chunk `prefix_ids`, the CONTEXT_TOKENS ids before it (the
prompt's tail for the first chunk); postprocessing returns decode(prefix + ids) minus
decode(prefix), which is exactly the text the new ids add. What is sent when is the
engine's (engine/output/output_processor.py, stream_interval included); this only
translates."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from backend.token_request_parsing import TokenRequest
from engine.api import CONTEXT_TOKENS, RequestOutput


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
    _context: list[int] = field(default_factory=list)  # the ids before the next chunk

    def __post_init__(self) -> None:
        self._context = self.request.prompt_token_ids[-CONTEXT_TOKENS:]

    def build(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """A stream's outputs are DELTA (the ids released since the previous response),
        a non-streaming request's one output FINAL_ONLY (all of them)."""
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        if self.request.stream:
            prefix = self._context
            self._context = (prefix + ids)[-CONTEXT_TOKENS:]
        elif self.request.exclude_input_in_output:
            prefix = self._context
        else:
            ids, prefix = list(out.prompt_token_ids) + ids, []
        if completion.finished_on_stop_token and ids:
            # As in TensorRT-LLM, the end token (EOS or end_id) is not part of the output.
            ids = ids[:-1]
        return {
            "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": np.array([[len(ids)]], dtype=np.int32),
            "prefix_ids": np.array(prefix, dtype=np.int32).reshape(1, -1),
        }
