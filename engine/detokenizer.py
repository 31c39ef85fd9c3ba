"""Incremental detokenization with stop strings, for streaming one request's output."""
from __future__ import annotations

from typing import Any

from engine.request import SamplingParams
from engine.stop_strings import StopMatcher

# Prompt tokens decoded ahead of the output so its first token gets its in-context spacing
# (sentencepiece decoders drop a leading space at the start of a decode). vLLM uses 5 too.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# Endings after which transformers' clean_up_tokenization might still delete a space once more
# text arrives: its patterns are " .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're".
_OPEN_CLEANUP_ENDINGS = (" '", " n", " n'", " 'v", " 'r")


class SpaceCleanup:
    """Applies the tokenizer's clean_up_tokenization to a text stream piece by piece, with the
    same result as on the whole text. Every pattern deletes spaces only and starts with a space,
    so text up to a point that no pattern can straddle is final; the rest waits."""

    def __init__(self, clean_up) -> None:
        self._clean_up = clean_up
        self._pending = ""
        self._tail = ""  # last committed characters: enough context to judge a cut

    def push(self, text: str) -> str:
        pending = self._pending + text
        cut = len(pending)
        while cut > 0 and not self._is_final_cut((self._tail + pending[:cut])[-3:]):
            cut -= 1
        return self._commit(pending, cut)

    def flush(self) -> str:
        return self._commit(self._pending, len(self._pending))

    def _commit(self, pending: str, cut: int) -> str:
        self._pending = pending[cut:]
        if not cut:
            return ""
        self._tail = (self._tail + pending[:cut])[-3:]
        return self._clean_up(pending[:cut])

    @staticmethod
    def _is_final_cut(ending: str) -> bool:
        return not ending.endswith(" ") and not ending.endswith(_OPEN_CLEANUP_ENDINGS)


class IncrementalDetokenizer:
    """Decodes a small window of recent tokens per update (prefix_offset/read_offset), so the
    cost does not grow with the output; holds back text until its bytes form whole characters."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        # Built once per request; each character of output_text is then fed to it once.
        self._stop_matcher = StopMatcher(params.stop) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: its bytes would shift the output's
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._cleanup = (SpaceCleanup(tokenizer.clean_up_tokenization)
                         if getattr(tokenizer, "clean_up_tokenization_spaces", False) else None)
        self.output_text = ""
        self.stop_str: str | None = None  # the stop string that ended the text, once matched
        self._sent = 0  # characters of output_text already returned by get_delta

    def update(self, new_token_ids: list[int]) -> str | None:
        """Adds tokens; returns the stop string if one now appears (output_text is cut there)."""
        if self.stop_str is not None or not new_token_ids:
            return None
        self._token_ids.extend(new_token_ids)
        return self._append(self._decode_new(final=False))

    def get_delta(self, finished: bool) -> str:
        """Text since the previous call. Until finished, a tail that may begin a stop string is
        held back; finishing releases it, along with any incomplete trailing bytes."""
        if finished and self.stop_str is None:
            self._append(self._decode_new(final=True), final=True)
        end = len(self.output_text)
        if not finished and self.stop_str is None and self._stop_matcher is not None:
            end -= self._stop_matcher.partial_len
        if end <= self._sent:
            return ""
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        # Cleanup runs on our side (SpaceCleanup): applied per window it could see false patterns.
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def _decode_new(self, final: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # an incomplete UTF-8 sequence: the next token may complete it
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text):]

    def _append(self, raw: str, final: bool = False) -> str | None:
        text = raw
        if self._cleanup is not None:
            text = self._cleanup.push(raw) + (self._cleanup.flush() if final else "")
        if not text:
            return None
        start = len(self.output_text)
        self.output_text += text
        return self._find_stop(start)

    def _find_stop(self, new_start: int) -> str | None:
        if self._stop_matcher is None:
            return None
        match = self._stop_matcher.feed(self.output_text, new_start)
        if match is None:
            return None
        start, end = match
        stop = self.output_text[start:end]
        self.output_text = self.output_text[:end if self._include_stop else start]
        self.stop_str = stop
        return stop
