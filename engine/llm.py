"""Offline inference: LLM(model).generate(prompts, params) -> outputs in input order; with
runner="pooling", LLM(model, runner="pooling").embed(prompts) and .score(text_1, text_2)
(engine/pooling/offline.py)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from engine.config import EngineConfig
from engine.faults import FaultPlan
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.offline_run import run_to_completion
from engine.outputs import RequestOutput
from engine.pooling import offline
from engine.pooling.outputs import EmbeddingRequestOutput, ScoringRequestOutput
from engine.pooling.params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, faults: FaultPlan | None = None,
                 **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_dict({"model": model, **engine_args}),
                                    faults=faults)
        self._next_id = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what `generate` samples with when given no SamplingParams, the model's
        generation_config values (engine argument generation_config) over SamplingParams'
        own defaults. A SamplingParams the caller builds starts from SamplingParams' own
        defaults, as in vLLM."""
        return self.llm_engine.sampling_defaults.sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 tenants: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or a list with one per prompt
        (None: the base model), as vLLM's. `tenants`: one per prompt, whose share each
        counts against under policy="fair" (None: the tenant "default")."""
        if self.llm_engine.pooling is not None:
            raise ValueError("LLM.generate() needs runner='generate'; this LLM runs "
                             "runner='pooling' (use LLM.embed() / LLM.score())")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_request entries for {len(prompts)} prompts")
        tenants = [None] * len(prompts) if tenants is None else list(tenants)
        if len(tenants) != len(prompts):
            raise ValueError(f"got {len(tenants)} tenants for {len(prompts)} prompts")
        engine = self.llm_engine
        # Only final outputs are kept here, so none is built before (as vLLM's LLM); the
        # caller's objects stay as they are.
        final_only: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in final_only:
                final_only[id(p)] = dataclasses.replace(
                    p, output_kind=RequestOutputKind.FINAL_ONLY)

        def adder(prompt, p, lora, tenant) -> Callable[[], str]:
            def add() -> str:
                rid = self._new_id()
                engine.add_request(rid, prompt, final_only[id(p)], lora_request=lora,
                                   tenant=tenant)
                return rid
            return add

        return run_to_completion(engine, map(adder, prompts, params, loras, tenants),
                                 "generate", use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool | None = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the assistant prompt) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              use_tqdm: bool | None = None, tokenization_kwargs: dict | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's: one embedding per prompt (`.outputs.embedding`, a list of floats), in
        input order. Needs runner="pooling" and an embedding model. `tokenization_kwargs`:
        {"truncate_prompt_tokens": k}, where vLLM 0.32 takes it."""
        return offline.embed(self.llm_engine, self._new_id, prompts, pooling_params,
                             use_tqdm, tokenization_kwargs)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *,
              use_tqdm: bool | None = None, pooling_params: PoolingParams | None = None,
              tokenization_kwargs: dict | None = None) -> list[ScoringRequestOutput]:
        """vLLM's: a score per pair (1 -> N or N -> N), `.outputs.score`; a cross-encoder
        scores each pair as one input, an embedding model by the embeddings' cosine."""
        return offline.score(self.llm_engine, self._new_id, data_1, data_2, pooling_params,
                             use_tqdm, tokenization_kwargs)

    def _new_id(self) -> str:
        rid = str(self._next_id)
        self._next_id += 1
        return rid
