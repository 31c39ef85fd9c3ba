"""The `llm` model: vllm_backend's text-in/text-out decoupled interface, plus prompts given
as token ids (`prompt_token_ids`); on a pooling engine (runner="pooling"), vllm_backend's
`embedding_request` instead (backend/pooling_request.py)."""
from __future__ import annotations

from typing import Any

import numpy as np

from backend import triton_io
from backend.engine_model import EngineModel
from backend.inflight import Inflight
from backend.llm_responses import LLMResponseBuilder
from backend.pooling_request import EMBEDDING_REQUEST, parse_pooling_request
from backend.pooling_responses import PoolingResponseBuilder
from backend.prompt_limits import (check_prompt_ids_length, check_prompt_logprobs_size,
                                   check_prompt_size, longest_token_bytes, max_prompt_bytes)
from backend.request_parsing import (InvalidRequest, asks_limits_only, compile_structured_output,
                                     parse_llm_request)


class LLMModel(EngineModel):
    def initialize(self, args: dict[str, Any]) -> None:
        super().initialize(args)
        # The engine's resolved values: max_model_len as the scheduler enforces it (from
        # the parameters, model.json or the model's context), and the rows of the
        # embedding table every prompt id must index.
        self._max_model_len = self.engine.config.scheduler.max_model_len
        self._vocab_size = self.engine.loaded.vocab_size
        self._max_prompt_bytes = max_prompt_bytes(self._max_model_len, longest_token_bytes(self.tokenizer))
        # vLLM's: one kind of request per engine, "generate" or "pooling".
        self._runner = self.engine.runner_type

    def make_inflight(self, request: Any, request_id: str, sender: Any, arrival: float) -> Inflight | None:
        inputs = triton_io.read_inputs(request, self.input_names)
        if asks_limits_only(inputs, request.parameters()) and inputs.get(EMBEDDING_REQUEST) is None:
            # No prompt, only return_max_model_len: answered here, the engine untouched.
            self.answer_now(sender, {"max_model_len": np.array([self._max_model_len],
                                                               dtype=np.uint32)})
            return None
        if self._runner == "pooling":
            return self._pooling_inflight(inputs, request, request_id, sender, arrival)
        if inputs.get(EMBEDDING_REQUEST) is not None:
            raise InvalidRequest(f"{EMBEDDING_REQUEST}: model {self.model_name!r} serves "
                                 "runner='generate' (text generation); embeddings and scores "
                                 "need a model loaded with runner='pooling'")
        check_prompt_size(inputs.get("text_input"), self._max_prompt_bytes, self._max_model_len)
        check_prompt_ids_length(inputs.get("prompt_token_ids"), self._max_model_len)
        # The model's generation_config fills the sampling keys the request left out.
        parsed = parse_llm_request(inputs, request.parameters(), self.engine.sampling_defaults,
                                   self._vocab_size)
        prompt_text = parsed.prompt
        if parsed.prompt_token_ids is not None:
            prompt_ids = parsed.prompt_token_ids
            # Only exclude_input_in_output=false shows the prompt: then the ids decoded as
            # /detokenize decodes them (special tokens kept), as vLLM echoes a token prompt.
            if not parsed.exclude_input_in_output:
                prompt_text = self.tokenizer.decode(prompt_ids)
        else:
            # Tokenized here, on Triton's execute thread, not on the engine thread where
            # every stream would wait for it. The fast tokenizer releases the GIL while it
            # encodes (a spinning Python thread kept running through a 600 KB encode here).
            # The same call as LLMEngine.add_request makes for a text prompt; a rendered
            # chat prompt (add_special_tokens false, as the OpenAI route sends) is taken as
            # it is, as vLLM takes it: its template wrote the BOS already.
            prompt_ids = self.tokenizer.encode(parsed.prompt,
                                               add_special_tokens=parsed.add_special_tokens)
        check_prompt_logprobs_size(len(prompt_ids), parsed.params.prompt_logprobs,
                                   self.options.max_prompt_logprobs_entries, parsed.params.n)
        # Likewise the structured-output spec's limits and parse; its compile (seconds
        # for a large schema) runs later on the compiler's own thread.
        compile_structured_output(self.engine.grammar_compiler, parsed.params)
        lora = (None if parsed.lora_name is None
                else self.lora_request(parsed.lora_name, parsed.lora_path))
        builder = LLMResponseBuilder(parsed, decode_token=self._decode_token,
                                     prompt_text=prompt_text, max_model_len=self._max_model_len)
        return Inflight(request_id, prompt_ids, parsed.params, sender, builder.build, arrival,
                        parsed.priority, lora_request=lora, tenant=parsed.tenant)

    def _pooling_inflight(self, inputs: dict, request: Any, request_id: str, sender: Any,
                          arrival: float) -> Inflight:
        if inputs.get(EMBEDDING_REQUEST) is None:
            raise InvalidRequest(f"model {self.model_name!r} serves runner='pooling' (one vector "
                                 f"per prompt): send {EMBEDDING_REQUEST}, not a generation "
                                 "request (text_input / prompt_token_ids)")
        parsed = parse_pooling_request(inputs, request.parameters(), self._vocab_size,
                                       self._max_model_len, self._max_prompt_bytes)
        # The engine tokenizes a text (with the request's truncation) in add_request.
        builder = PoolingResponseBuilder(parsed, max_model_len=self._max_model_len)
        return Inflight(request_id, parsed.prompt, parsed.params, sender, builder.build, arrival,
                        parsed.priority)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
