"""LoRA adapters: the request naming one (torch-free), loading a PEFT folder and the
registry of loaded adapters (engine/lora/adapter.py, registry.py; those need torch)."""
from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
