"""Engine outputs -> the `llm` model's output tensors (vllm_backend's contract).

Pure numpy: the engine loop calls `build` on each RequestOutput and gets back the
tensors to send, or None when this step has nothing for the client."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from backend.request_parsing import LLMRequest
from engine.outputs import RequestOutput


@dataclass(slots=True)
class _Held:
    """Streamed deltas not sent yet, one entry per sequence (stream_interval > 1)."""
    texts: list[str]
    token_ids: list[list[int]]
    logprobs: list[list | None]

    def add(self, completions) -> None:
        for i, c in enumerate(completions):
            self.texts[i] += c.delta_text
            self.token_ids[i].extend(c.delta_token_ids)
            if c.delta_logprobs is not None:
                self.logprobs[i] = (self.logprobs[i] or []) + list(c.delta_logprobs)


@dataclass(slots=True)
class LLMResponseBuilder:
    request: LLMRequest
    # token id -> text, used only for return_logprobs' "decoded_token".
    decode_token: Callable[[int], str] | None = None
    # Streaming: send the first text at once, then once this many tokens are held, and
    # the final response (vLLM's stream_interval; 1 = every step with text).
    stream_interval: int = 1
    _held: _Held | None = None
    _sent: bool = False

    def build(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        """One entry per sequence (n > 1: index i in entry i), as vllm_backend sends;
        num_input_tokens stays one value."""
        completions = out.outputs
        finished = out.finished
        if self.request.stream:
            # One response per step that produced text; the last one carries FINAL
            # even when the final step produced no text (e.g. it sampled EOS). A sequence
            # with nothing new this step gets an empty entry.
            if self.stream_interval > 1:
                texts, token_ids, logprobs = self._hold(completions, finished)
                if texts is None:
                    return None
            else:
                if not finished and not any(c.delta_text for c in completions):
                    return None
                # The engine releases tokens with their text: tokens held back mid-character
                # or mid-stop-string are counted with the response that carries their text.
                texts = [c.delta_text for c in completions]
                token_ids = [c.delta_token_ids for c in completions]
                logprobs = [c.delta_logprobs for c in completions]
        else:
            if not finished:
                return None
            prefix = "" if self.request.exclude_input_in_output else self.request.prompt
            texts = [prefix + c.text for c in completions]
            token_ids = [c.token_ids for c in completions]
            logprobs = [c.logprobs for c in completions]
        tensors = {"text_output": _strings(texts)}
        returns = self.request.returns
        if returns.finish_reason:
            # str(None) for unfinished stream responses, as vllm_backend sends.
            tensors["finish_reason"] = _strings([str(c.finish_reason) for c in completions])
        if returns.num_input_tokens:
            tensors["num_input_tokens"] = np.array([len(out.prompt_token_ids)], dtype=np.uint32)
        if returns.num_output_tokens:
            tensors["num_output_tokens"] = np.array([len(ids) for ids in token_ids], dtype=np.uint32)
        if returns.cumulative_logprob:
            tensors["cumulative_logprob"] = np.array(
                [np.nan if c.cumulative_logprob is None else c.cumulative_logprob for c in completions],
                dtype=np.float32)
        if returns.logprobs:
            tensors["logprobs"] = np.array([self._logprobs_json(lp) for lp in logprobs], dtype=np.object_)
        return tensors

    def _hold(self, completions, finished: bool):
        """Adds this step's deltas to the held ones; returns them (and starts over) when
        they are due, else (None, None, None)."""
        if self._held is None:
            n = len(completions)
            self._held = _Held([""] * n, [[] for _ in range(n)], [None] * n)
        held = self._held
        held.add(completions)
        if not finished:
            if not any(held.texts):
                return None, None, None
            if self._sent and max(len(ids) for ids in held.token_ids) < self.stream_interval:
                return None, None, None
        self._held, self._sent = None, True
        return held.texts, held.token_ids, held.logprobs

    def _logprobs_json(self, logprobs: list[dict[int, float]] | None) -> bytes:
        payload = []
        for position in logprobs or []:
            item = {}
            for token_id, logprob in position.items():
                info = {"logprob": float(logprob)}
                if self.decode_token is not None:
                    info["decoded_token"] = self.decode_token(int(token_id))
                item[str(int(token_id))] = info
            payload.append(item)
        return json.dumps(payload).encode("utf-8")


def _strings(texts: list[str]) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
