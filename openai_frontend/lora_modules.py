"""vLLM's --lora-modules: each adapter is served as its own model id, and a request whose
`model` names one runs on the Triton model with that adapter (its multi_lora.json name)."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> tuple[LoRAModule, ...]:
    """vLLM's two spellings: `name=path`, or a JSON object with name, path and optionally
    base_model_name. Raises ValueError naming the entry."""
    modules: list[LoRAModule] = []
    for item in values or ():
        if "=" in item and "," not in item and not item.lstrip().startswith("{"):
            name, path = item.split("=", 1)
            module = LoRAModule(name.strip(), path.strip())
        else:
            try:
                data = json.loads(item)
                module = LoRAModule(**data)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object "
                                 f"with name, path and optionally base_model_name ({exc})") from None
        if not module.name or not module.path:
            raise ValueError(f"--lora-modules {item!r}: name and path must both be set")
        if any(m.name == module.name for m in modules):
            raise ValueError(f"--lora-modules: adapter {module.name!r} is listed twice")
        modules.append(module)
    return tuple(modules)
