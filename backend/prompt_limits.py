"""A byte limit on `text_input`, checked before the prompt is decoded or tokenized, and a
length limit on `prompt_token_ids`, checked before its ids are read.

Tokenizing costs time linear in the text (~0.4 ms per KiB here), so a multi-megabyte
prompt that can never fit max_model_len must be refused on its size alone. The limit is
derived so that it never refuses a prompt that could fit: no token stands for more text
than the vocabulary's longest entry, so max_model_len tokens hold at most
max_model_len * longest bytes. An id prompt is refused on its length alone, with the
engine's own rule (a prompt of max_model_len tokens leaves no room for output), before
its ids are scanned against the vocabulary. Pure Python."""
from __future__ import annotations

from typing import Any

import numpy as np

from backend.input_values import InvalidRequest

# Normalizers run before the vocabulary is matched and may shrink the text: NFC composes
# up to three code points (a Hangul syllable from its jamo, 9 bytes -> 3) into one.
NORMALIZER_SHRINK_MARGIN = 4


def longest_token_bytes(tokenizer: Any) -> int:
    """UTF-8 length of the longest text one token decodes to (+1: SentencePiece drops the
    leading space of a lone piece). ~0.1 s for a 49k vocabulary, once at load."""
    pieces = tokenizer.convert_ids_to_tokens(list(tokenizer.get_vocab().values()))
    longest = max(len(tokenizer.convert_tokens_to_string([piece]).encode("utf-8")) for piece in pieces)
    return longest + 1


def max_prompt_bytes(max_model_len: int, longest_token: int) -> int:
    return max_model_len * longest_token * NORMALIZER_SHRINK_MARGIN


def check_prompt_size(text_input: np.ndarray | None, limit: int, max_model_len: int,
                      name: str = "text_input") -> None:
    """Raises InvalidRequest when the raw text_input tensor is over `limit` bytes. Absent
    or oddly shaped inputs pass: the request parser reports those."""
    if text_input is None or text_input.size != 1:
        return
    value = text_input.reshape(-1)[0]
    if isinstance(value, (bytes, np.bytes_)):
        size = len(value)
    elif isinstance(value, str):
        size = len(value.encode("utf-8"))
    else:
        return
    if size > limit:
        raise InvalidRequest(f"{name} is {size} bytes, more than {limit} bytes could ever fit in "
                             f"max_model_len={max_model_len} tokens")


def check_prompt_ids_length(prompt_token_ids: np.ndarray | None, max_model_len: int) -> None:
    """Raises InvalidRequest when the prompt_token_ids tensor holds max_model_len ids or
    more (the engine refuses such a prompt too, after the request was built)."""
    if prompt_token_ids is None or prompt_token_ids.size < max_model_len:
        return
    raise InvalidRequest(f"prompt_token_ids is {prompt_token_ids.size} ids long, which leaves no "
                         f"room for output within max_model_len={max_model_len}")


def check_prompt_logprobs_size(num_prompt_tokens: int, prompt_logprobs: int | None,
                               max_entries: int, n: int = 1) -> None:
    """Raises InvalidRequest when the prompt_logprobs output would hold more than
    `max_entries` entries (prompt tokens x (k + 1): the prompt's own token and the top k
    at each position; x n, each sequence entry holding a copy), before the request is
    queued. 0: no limit."""
    if prompt_logprobs is None or not max_entries:
        return
    entries = num_prompt_tokens * (prompt_logprobs + 1) * max(1, n)
    if entries > max_entries:
        copies = f" x n={n}" if n > 1 else ""
        raise InvalidRequest(f"prompt_logprobs={prompt_logprobs} on a {num_prompt_tokens}-token "
                             f"prompt{copies} asks {entries} logprob entries, more than this model's "
                             f"MAX_PROMPT_LOGPROBS_ENTRIES={max_entries}; ask a smaller k or "
                             "send a shorter prompt")
