"""Engine outputs -> the `llm` model's output tensors (vllm_backend's contract).

Pure numpy, and translation only: the engine decides what a request is handed and when
(engine/output/output_processor.py: DELTA for a stream, FINAL_ONLY otherwise, the
stream_interval), and the engine loop calls `build` on each RequestOutput it hands out."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from backend.request_parsing import LLMRequest
from engine.api import Logprob, RequestOutput


@dataclass(slots=True)
class LLMResponseBuilder:
    request: LLMRequest
    # token id -> text, used only for return_logprobs' "decoded_token".
    decode_token: Callable[[int], str] | None = None
    # What exclude_input_in_output=false puts before the text: the text_input, or an id
    # prompt detokenized (the model's make_inflight decodes it); None: request.prompt.
    prompt_text: str | None = None
    # The engine's resolved max_model_len, for return_max_model_len.
    max_model_len: int = 0

    def build(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """One entry per sequence (n > 1: index i in entry i), as vllm_backend sends;
        num_input_tokens stays one value. A stream's outputs are DELTA: each carries what
        is new (a sequence without news an empty entry; the final one FINAL even when it
        adds no text), and num_output_tokens counts the tokens that came with its text."""
        completions = out.outputs
        # Streaming requires exclude_input_in_output: the prompt goes before a whole text.
        prefix = ""
        if not self.request.exclude_input_in_output:
            prefix = self.prompt_text if self.prompt_text is not None else self.request.prompt or ""
        tensors = {"text_output": _strings([prefix + c.text for c in completions])}
        returns = self.request.returns
        if returns.finish_reason:
            # str(None) for unfinished stream responses, as vllm_backend sends.
            tensors["finish_reason"] = _strings([str(c.finish_reason) for c in completions])
        if returns.num_input_tokens:
            tensors["num_input_tokens"] = np.array([len(out.prompt_token_ids)], dtype=np.uint32)
        if returns.num_cached_tokens:
            # Known from the first output on (the prefix-cache look-up at admission).
            tensors["num_cached_tokens"] = np.array([max(out.num_cached_tokens, 0)], dtype=np.uint32)
        if returns.max_model_len:
            tensors["max_model_len"] = np.array([self.max_model_len], dtype=np.uint32)
        if returns.num_output_tokens:
            tensors["num_output_tokens"] = np.array([len(c.token_ids) for c in completions],
                                                    dtype=np.uint32)
        if returns.cumulative_logprob:
            tensors["cumulative_logprob"] = np.array(
                [np.nan if c.cumulative_logprob is None else c.cumulative_logprob for c in completions],
                dtype=np.float32)
        if returns.logprobs:
            # null without a "logprobs" sampling parameter, as vllm_backend sends (vLLM
            # hands it no logprobs then).
            tensors["logprobs"] = np.array(
                [self._logprobs_json(c.logprobs) if self.request.logprobs_asked else b"null"
                 for c in completions], dtype=np.object_)
        if out.prompt_logprobs is not None and self.request.params.prompt_logprobs is not None:
            # Once, with the request's first output; the prompt is the sequences' shared
            # one, so each of n's entries carries the same text.
            text = self._logprobs_json(out.prompt_logprobs)
            tensors["prompt_logprobs"] = np.array([text] * len(completions), dtype=np.object_)
        return tensors

    def _logprobs_json(self, logprobs: list[dict[int, Logprob] | None] | None) -> bytes:
        """vllm_backend's items: {"<token id>": {"logprob", "rank", "decoded_token"}} per
        position, sampled token first (prompt logprobs: the prompt's token first, and
        null for the first position, which nothing precedes)."""
        payload = []
        for position in logprobs or []:
            if position is None:
                payload.append(None)
                continue
            item = {}
            for token_id, entry in position.items():
                info = {"logprob": float(entry.logprob), "rank": entry.rank}
                if self.decode_token is not None:
                    info["decoded_token"] = self.decode_token(int(token_id))
                item[str(int(token_id))] = info
            payload.append(item)
        return json.dumps(payload).encode("utf-8")


def _strings(texts: list[str]) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
