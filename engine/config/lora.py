"""LoRAConfig: multi-LoRA serving limits, with vLLM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config.checks import check_positive

# vLLM's MaxLoRARanks.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(slots=True)
class LoRAConfig:
    enable_lora: bool = False
    # Distinct adapters among the running requests of one step.
    max_loras: int = 1
    max_lora_rank: int = 16
    # Adapters kept loaded (least recently used evicted past it); None: max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_positive("max_loras", self.max_loras)
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= "
                             f"max_loras ({self.max_loras})")
