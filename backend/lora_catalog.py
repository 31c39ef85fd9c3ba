"""The adapters an engine model's requests may run with: multi_lora.json's, by name, and
with `allow_runtime_lora_updating`, any PEFT folder a request names beside its lora_name
(`lora_path`, as vLLM's LoRARequest carries its path). That is how the OpenAI route's
/v1/load_lora_adapter serves a new adapter without reloading the model. Pure Python."""
from __future__ import annotations

import itertools
import os
from typing import Mapping

from backend.model_json import ALLOW_RUNTIME_LORA_UPDATING
from backend.multi_lora import resolve_lora_name
from engine.api import LoRARequest


class LoRACatalog:
    def __init__(self, configured: Mapping[str, LoRARequest], allow_runtime: bool = False) -> None:
        self.configured = dict(configured)
        self.allow_runtime = allow_runtime
        # One id per (name, folder) for the model's life: the id keys the engine's loaded
        # weights (engine/lora/registry.py), so a name pointed at a new folder gets a new
        # id and never the old folder's weights. Triton calls execute on one thread per
        # instance, the only caller.
        self._runtime: dict[tuple[str, str], LoRARequest] = {}
        first = max((a.lora_int_id for a in self.configured.values()), default=0) + 1
        self._ids = itertools.count(first)

    def resolve(self, name: str, path: str | None = None) -> LoRARequest:
        """The adapter a request's lora_name (and lora_path) select; ValueError naming the
        field at fault otherwise."""
        if path is None:
            return resolve_lora_name(self.configured, name)
        if not self.allow_runtime:
            raise ValueError(f"lora_path is refused: this model serves only its configured "
                             f"adapters (set {ALLOW_RUNTIME_LORA_UPDATING}=true in config.pbtxt or "
                             "model.json to let requests name adapter folders)")
        if not os.path.isabs(path):
            raise ValueError(f"lora_path must be an absolute folder path, got {path!r}")
        path = os.path.normpath(path)
        known = self.configured.get(name)
        if known is not None:
            if os.path.normpath(known.lora_path) != path:
                raise ValueError(f"lora_name {name!r} is a configured adapter ({known.lora_path}); "
                                 f"lora_path {path!r} cannot point it at another folder")
            return known
        adapter = self._runtime.get((name, path))
        if adapter is None:
            adapter = LoRARequest(name, next(self._ids), path)
            self._runtime[(name, path)] = adapter
        return adapter
