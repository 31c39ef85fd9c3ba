"""The LoRA adapters the route serves as model ids, and what a request for one sends the
`llm` model: --lora-modules' adapters by name (the Triton model's multi_lora.json names
them), runtime ones (/v1/load_lora_adapter) by name and folder, which a model with
allow_runtime_lora_updating loads on first use (backend/lora_catalog.py)."""
from __future__ import annotations

from typing import Any, Iterator

from openai_frontend.lora_modules import LoRAModule


class ServedAdapters:
    def __init__(self, modules: tuple[LoRAModule, ...] = ()) -> None:
        # name -> (module, loaded at run time); insertion order is /v1/models' order.
        self._adapters: dict[str, tuple[LoRAModule, bool]] = {
            m.name: (m, False) for m in modules}

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._adapters))

    def get(self, name: str) -> LoRAModule:
        return self._adapters[name][0]

    def sampling(self, name: str) -> dict[str, Any]:
        """vllm_backend's lora_name, and the folder of a runtime adapter."""
        module, runtime = self._adapters[name]
        return {"lora_name": name, "lora_path": module.path} if runtime else {"lora_name": name}

    def add(self, module: LoRAModule) -> None:
        self._adapters[module.name] = (module, True)

    def remove(self, name: str) -> None:
        del self._adapters[name]
