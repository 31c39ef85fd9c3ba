"""The `llm` model: vllm_backend's text-in/text-out decoupled interface."""
from __future__ import annotations

from typing import Any

from backend import triton_io
from backend.engine_loop import Inflight
from backend.engine_model import EngineModel
from backend.llm_responses import LLMResponseBuilder
from backend.request_parsing import parse_llm_request


class LLMModel(EngineModel):
    def make_inflight(self, request: Any, request_id: str, sender: Any, arrival: float) -> Inflight:
        parsed = parse_llm_request(triton_io.read_inputs(request, self.input_names), request.parameters())
        builder = LLMResponseBuilder(parsed, decode_token=self._decode_token)
        return Inflight(request_id, parsed.prompt, parsed.params, sender, builder.build, arrival)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
