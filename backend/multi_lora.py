"""multi_lora.json, vllm_backend's map of adapter names to PEFT folders, in the model's
version folder beside model.json; and the lora_name a request sends, resolved against it.
Pure Python (engine.api imports without torch)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from engine.api import LoRARequest

FILE_NAME = "multi_lora.json"


def read_multi_lora(version_dir: Path, lora_modules: str = "",
                    required: bool = True) -> dict[str, LoRARequest]:
    """Adapters by name, ids numbered from 1 in file order as vllm_backend numbers them,
    from multi_lora.json or else the config.pbtxt parameter `lora_modules` (vLLM's
    --lora-modules spelling: `name=path` entries separated by spaces). A relative folder is
    taken from the version folder. Raises ValueError naming the file (or the parameter)
    and the offending entry; with neither, as vllm_backend refuses enable_lora without it,
    unless not `required` (adapters then come at run time: backend/lora_catalog.py)."""
    path = Path(version_dir) / FILE_NAME
    if path.is_file() and lora_modules:
        raise ValueError(f"adapters are given twice: by {path} and by the lora_modules "
                         "parameter; keep one")
    if lora_modules:
        where, data = "parameter 'lora_modules'", _modules_from_text(lora_modules)
    elif not path.is_file() and not required:
        return {}
    elif not path.is_file():
        raise ValueError(f"enable_lora is true but {path} does not exist (a JSON object "
                         "mapping each adapter name to its PEFT folder)")
    else:
        where = str(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: not readable as JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: must hold a non-empty JSON object of adapter name -> folder")
    adapters = {}
    for index, (name, folder) in enumerate(data.items()):
        if not name or not isinstance(folder, str) or not folder:
            raise ValueError(f"{where}: adapter {name!r} must map to a folder path, got {folder!r}")
        adapters[name] = LoRARequest(name, index + 1, str(Path(version_dir) / folder))
    return adapters


def _modules_from_text(text: str) -> dict[str, str]:
    modules: dict[str, str] = {}
    for item in text.split():
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"parameter 'lora_modules': expected name=path entries, got {item!r}")
        if name in modules:
            raise ValueError(f"parameter 'lora_modules': adapter {name!r} is listed twice")
        modules[name] = folder
    return modules


LORA_NOT_ENABLED = "LoRA feature is not enabled."


def resolve_lora_name(adapters: Mapping[str, LoRARequest] | None, name: str) -> LoRARequest:
    """The adapter a request's lora_name selects; ValueError naming it when none does."""
    # vllm_backend's texts word for word (its clients and CI tests compare them whole; they
    # name the adapter and the choice): the adapters in multi_lora.json's order.
    if adapters is None:
        raise ValueError(LORA_NOT_ENABLED)
    adapter = adapters.get(name)
    if adapter is None:
        raise ValueError(f"LoRA {name} is not supported, we currently support {list(adapters)}")
    return adapter
