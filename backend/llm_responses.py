"""Engine outputs -> the `llm` model's output tensors (vllm_backend's contract).

Pure numpy: the engine loop calls `build` on each RequestOutput and gets back the
tensors to send, or None when this step has nothing for the client."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from backend.request_parsing import LLMRequest
from engine.request import RequestOutput


@dataclass(slots=True)
class LLMResponseBuilder:
    request: LLMRequest
    # token id -> text, used only for return_logprobs' "decoded_token".
    decode_token: Callable[[int], str] | None = None

    def build(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        completion = out.outputs[0]
        finished = out.finished
        if self.request.stream:
            # One response per step that produced text; the last one carries FINAL
            # even when the final step produced no text (e.g. it sampled EOS).
            if not completion.delta_text and not finished:
                return None
            # The engine releases tokens with their text: tokens held back mid-character
            # or mid-stop-string are counted with the response that carries their text.
            text = completion.delta_text
            token_ids, logprobs = completion.delta_token_ids, completion.delta_logprobs
        else:
            if not finished:
                return None
            text = completion.text if self.request.exclude_input_in_output else self.request.prompt + completion.text
            token_ids, logprobs = completion.token_ids, completion.logprobs
        num_tokens = len(token_ids)
        tensors = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
        returns = self.request.returns
        if returns.finish_reason:
            # str(None) for unfinished stream responses, as vllm_backend sends.
            tensors["finish_reason"] = np.array([str(completion.finish_reason).encode()], dtype=np.object_)
        if returns.num_input_tokens:
            tensors["num_input_tokens"] = np.array([len(out.prompt_token_ids)], dtype=np.uint32)
        if returns.num_output_tokens:
            tensors["num_output_tokens"] = np.array([num_tokens], dtype=np.uint32)
        if returns.cumulative_logprob:
            value = completion.cumulative_logprob
            tensors["cumulative_logprob"] = np.array([np.nan if value is None else value], dtype=np.float32)
        if returns.logprobs:
            tensors["logprobs"] = np.array([self._logprobs_json(logprobs)], dtype=np.object_)
        return tensors

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
