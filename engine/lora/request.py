"""LoRARequest: which adapter a request runs with (vLLM's vllm.lora.request fields).
Torch-free: the scheduler and the prefix-cache hashing read it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`lora_int_id` identifies the adapter (>= 1; vLLM keeps 0 for the base model) and
    must stay unique per adapter; `lora_path` is its PEFT folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be set")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
