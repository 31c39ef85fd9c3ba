"""The `llm` model: vllm_backend's text-in/text-out decoupled interface."""
from __future__ import annotations

from typing import Any

from backend import triton_io
from backend.engine_model import EngineModel
from backend.inflight import Inflight
from backend.llm_responses import LLMResponseBuilder
from backend.prompt_limits import check_prompt_size, longest_token_bytes, max_prompt_bytes
from backend.request_parsing import compile_structured_output, parse_llm_request


class LLMModel(EngineModel):
    def initialize(self, args: dict[str, Any]) -> None:
        super().initialize(args)
        self._max_model_len = self.engine.config.scheduler.max_model_len
        self._max_prompt_bytes = max_prompt_bytes(self._max_model_len, longest_token_bytes(self.tokenizer))

    def make_inflight(self, request: Any, request_id: str, sender: Any, arrival: float) -> Inflight:
        inputs = triton_io.read_inputs(request, self.input_names)
        check_prompt_size(inputs.get("text_input"), self._max_prompt_bytes, self._max_model_len)
        # The model's generation_config fills the sampling keys the request left out.
        parsed = parse_llm_request(inputs, request.parameters(), self.engine.sampling_defaults)
        # Tokenized here, on Triton's execute thread, not on the engine thread where every
        # stream would wait for it. The fast tokenizer releases the GIL while it encodes
        # (a spinning Python thread kept running through a 600 KB encode here). The same
        # call as LLMEngine.add_request makes for a text prompt; a rendered chat prompt
        # (add_special_tokens false, as the OpenAI route sends) is taken as it is, as vLLM
        # takes it: its template wrote the BOS already.
        prompt_ids = self.tokenizer.encode(parsed.prompt,
                                           add_special_tokens=parsed.add_special_tokens)
        # Likewise the structured-output spec's limits and parse; its compile (seconds
        # for a large schema) runs later on the compiler's own thread.
        compile_structured_output(self.engine.grammar_compiler, parsed.params)
        lora = (None if parsed.lora_name is None
                else self.lora_request(parsed.lora_name, parsed.lora_path))
        builder = LLMResponseBuilder(parsed, decode_token=self._decode_token)
        return Inflight(request_id, prompt_ids, parsed.params, sender, builder.build, arrival,
                        parsed.priority, lora_request=lora, tenant=parsed.tenant)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
