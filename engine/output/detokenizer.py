"""Incremental detokenization with stop strings, and the one record of what of a
request's output has been handed out (text and tokens, released together)."""
from __future__ import annotations

from collections import deque
from typing import Any

from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.output.stop_strings import StopMatcher

# Tokens decoded ahead of new ones so they get their in-context spacing (sentencepiece
# decoders drop a leading space at the start of a decode). vLLM uses 5 too. The token path
# sends as many ids before each chunk (prefix_ids) for postprocessing to decode after.
CONTEXT_TOKENS = 5
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

    @property
    def pending(self) -> bool:
        return bool(self._pending)

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
    cost does not grow with the output.

    One hold-back rule for every consumer: output is released in (tokens, text) pairs that
    line up, at points where every token fed so far has decoded to whole characters, and
    never past a tail that may begin a stop string; nothing else is held (a bare space
    goes out at once). So a stream of released tokens can be
    decoded chunk by chunk (the token path's postprocessing), and a text stream counts its
    tokens exactly. Finishing releases everything."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        # Built once per request; each character of output_text is then fed to it once.
        self._stop_matcher = StopMatcher(params.stop) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: its bytes would shift the output's
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._streamed = params.output_kind is not RequestOutputKind.FINAL_ONLY
        # A whole text (FINAL_ONLY) is cleaned up as tokenizer.decode cleans it. A stream is
        # not, as vLLM's detokenizer (and the token path's postprocessing) never cleans:
        # cleaning a stream means holding back every text that ends in a space (" ." may
        # follow), so a bare-space token would ride with the next one, where vLLM streams
        # ' ' then '1'.
        self._cleanup = (SpaceCleanup(tokenizer.clean_up_tokenization)
                         if getattr(tokenizer, "clean_up_tokenization_spaces", False)
                         and not self._streamed else None)
        self.output_text = ""
        self.stop_str: str | None = None  # the stop string that ended the text, once matched
        self._num_fed = 0  # output tokens fed
        # (output tokens, characters) at which tokens and text line up, not yet released;
        # not kept for a FINAL_ONLY request, whose one take_delta is the finishing one.
        self._aligned: deque[tuple[int, int]] = deque()
        self._released_tokens = 0
        self._released_chars = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Adds tokens; returns the stop string if one now appears (output_text is cut there)."""
        if self.stop_str is not None or not new_token_ids:
            return None
        self._token_ids.extend(new_token_ids)
        self._num_fed += len(new_token_ids)
        stop = self._append(self._decode_new(final=False))
        if (self._streamed and stop is None and self._read_offset == len(self._token_ids)
                and (self._cleanup is None or not self._cleanup.pending)):
            self._aligned.append((self._num_fed, len(self.output_text)))
        return stop

    def take_delta(self, num_output_tokens: int, finished: bool) -> tuple[str, int, int]:
        """(text, start, end): the text released since the previous call and the range of
        output tokens it belongs to. Finishing releases all `num_output_tokens` (also those
        never fed, such as a stop id left out of the text) with any held-back text."""
        start_tokens, start_chars = self._released_tokens, self._released_chars
        if finished:
            if self.stop_str is None:
                self._append(self._decode_new(final=True), final=True)
            end_tokens, end_chars = num_output_tokens, len(self.output_text)
            self._aligned.clear()
        else:
            limit = len(self.output_text)
            if self._stop_matcher is not None and self.stop_str is None:
                limit -= self._stop_matcher.partial_len
            end_tokens, end_chars = start_tokens, start_chars
            aligned = self._aligned
            while aligned and aligned[0][1] <= limit:
                end_tokens, end_chars = aligned.popleft()
        self._released_tokens, self._released_chars = end_tokens, end_chars
        return self.output_text[start_chars:end_chars], start_tokens, end_tokens

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
