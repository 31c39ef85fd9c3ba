"""The route's settings beyond where Triton is: one dataclass, built by __main__ from
its flags and handed to create_app."""
from __future__ import annotations

from dataclasses import dataclass, field

from openai_frontend.lora_modules import LoRAModule
from openai_frontend.reasoning import check_parser_name
from openai_frontend.tool_calls import ToolCallConfig


@dataclass(frozen=True, slots=True)
class FrontendOptions:
    # --api-key / VLLM_API_KEY; empty: no authentication.
    api_keys: tuple[str, ...] = ()
    # Triton's admin-key header (backend/restricted_api.py) for its model-config API.
    triton_admin_key: str | None = None
    tool_calls: ToolCallConfig = field(default_factory=ToolCallConfig)
    # --reasoning-parser (openai_frontend/reasoning.py's names); None: no reasoning split.
    reasoning_parser: str | None = None
    # Triton's metrics endpoint, re-exported at /metrics; None: no /metrics route.
    triton_metrics_url: str | None = None
    # For /tokenize's max_model_len; None: the `llm` model's own, the engine's resolved
    # limit (it answers return_max_model_len).
    max_model_len: int | None = None
    # --enable-prompt-tokens-details (vLLM's flag, off there): usage carries
    # prompt_tokens_details.cached_tokens. On here: NVIDIA aiperf reads it and warns
    # without it; --no-enable-prompt-tokens-details leaves it out.
    prompt_tokens_details: bool = True
    # --enable-tokenizer-info-endpoint (vLLM's flag and default): GET /tokenizer_info, the
    # tokenizer's configuration, chat template included; off, as in vLLM, since a
    # deployment's template may be its own.
    tokenizer_info: bool = False
    # --lora-modules: adapters served as model ids beside the base model.
    lora_modules: tuple[LoRAModule, ...] = ()
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    # exist (openai_frontend/runtime_lora.py).
    runtime_lora_updating: bool = False
    # --max-sequences-per-request: prompts x n of one request (a completions batch).
    max_sequences_per_request: int = 256
    # --max-request-bytes: a larger body is refused with 413 before it is held in memory.
    max_request_bytes: int = 4 * 1024 * 1024
    # --stream-idle-timeout: a stream whose client has not taken an event for this long
    # (the send stays blocked) is cancelled; None: never.
    stream_idle_timeout: float | None = 30.0
    # Threads that tokenize and render chat templates, off the event loop.
    tokenizer_threads: int = 2

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            check_parser_name(self.reasoning_parser)  # at startup, not per request
