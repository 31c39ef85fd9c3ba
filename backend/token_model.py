"""The `tensorrt_llm` model: token ids in, token ids out (decoupled), under
TensorRT-LLM's tensor names so its ensemble and clients work unchanged."""
from __future__ import annotations

from typing import Any

from backend import triton_io
from backend.engine_model import EngineModel
from backend.inflight import Inflight
from backend.token_request_parsing import parse_token_request
from backend.token_responses import TokenResponseBuilder


class TokenIdModel(EngineModel):
    def make_inflight(self, request: Any, request_id: str, sender: Any, arrival: float) -> Inflight:
        parsed = parse_token_request(triton_io.read_inputs(request, self.input_names),
                                     self.engine.sampling_defaults)
        lora = None if parsed.lora_name is None else self.lora_request(parsed.lora_name)
        builder = TokenResponseBuilder(parsed)
        return Inflight(request_id, parsed.prompt_token_ids, parsed.params, sender, builder.build,
                        arrival, parsed.priority, lora_request=lora, tenant=parsed.tenant)
