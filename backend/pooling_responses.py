"""A pooling request's one response (vllm_backend's EmbedRequest.create_response): the
vector as JSON text in `text_output`, and the counts its return_* switches ask for. Pure
numpy; the engine loop calls `build` on the request's PoolingRequestOutput."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from backend.pooling_request import PoolingRequest
from engine.api import PoolingRequestOutput


@dataclass(slots=True)
class PoolingResponseBuilder:
    request: PoolingRequest
    # The engine's resolved max_model_len, for return_max_model_len.
    max_model_len: int = 0

    def build(self, out: PoolingRequestOutput) -> dict[str, np.ndarray]:
        # repr of a float round-trips: the client parses back the engine's exact values.
        vector = json.dumps([float(x) for x in out.outputs.data])
        tensors = {"text_output": np.array([vector.encode("utf-8")], dtype=np.object_)}
        returns = self.request.returns
        if "return_finish_reason" in returns:
            tensors["finish_reason"] = np.array([b"stop"], dtype=np.object_)
        if "return_num_input_tokens" in returns:
            tensors["num_input_tokens"] = np.array([len(out.prompt_token_ids)], dtype=np.uint32)
        if "return_num_output_tokens" in returns:
            tensors["num_output_tokens"] = np.array([0], dtype=np.uint32)  # nothing generated
        if "return_num_cached_tokens" in returns:
            tensors["num_cached_tokens"] = np.array([max(out.num_cached_tokens, 0)], dtype=np.uint32)
        if "return_max_model_len" in returns:
            tensors["max_model_len"] = np.array([self.max_model_len], dtype=np.uint32)
        return tensors
