"""One engine's LoRA state: the model's wrapped layers, the adapters loaded for them, and
each step's rows grouped by adapter for the wrapped layers to read."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from engine.config import LoRAConfig
from engine.core.request import Request
from engine.lora.adapter import AdapterFiles, LoRAAdapter, load_adapter
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoRARequest
from engine.models.lora_linear import LoRAGroup, attach_lora


class LoRARuntime:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.batch, self.targets = attach_lora(model)
        # The native all-layers decode of one sequence reads the base weights past the
        # wrappers: it may run only in steps without adapter rows.
        self._decoder = model.model
        self._fused_decode = model.model.fused_single_decode
        self.registry = LoRARegistry(self._load, config.max_cpu_loras)

    def _load(self, request: LoRARequest, files: AdapterFiles | None) -> LoRAAdapter:
        return load_adapter(request, self.targets, self.config.max_lora_rank, self.dtype,
                            self.device, files)

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        return self.registry.get(request)

    def stage(self, request: LoRARequest) -> None:
        """Any thread: read a not-loaded adapter's files ahead of the engine thread."""
        self.registry.stage(request)

    def set_step(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> None:
        """Group the step's token rows (requests in batch order, `num_tokens` rows each)
        by adapter; base-model rows belong to no group."""
        spans: dict[int, list[list[int]]] = {}
        adapters: dict[int, LoRAAdapter] = {}
        start = 0
        for request, n in zip(requests, num_tokens):
            lora = request.lora_request
            if lora is not None:
                key = lora.lora_int_id
                if key not in adapters:
                    adapters[key] = self.registry.get(lora)
                runs = spans.setdefault(key, [])
                if runs and runs[-1][1] == start:
                    runs[-1][1] = start + n  # adjacent rows of the same adapter: one run
                else:
                    runs.append([start, start + n])
            start += n
        groups = []
        for key, runs in spans.items():
            if len(runs) == 1:
                rows = slice(runs[0][0], runs[0][1])
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in runs]).to(self.device)
            groups.append(LoRAGroup(rows, adapters[key].modules))
        self.batch.groups = groups
        self._decoder.fused_single_decode = self._fused_decode and not groups

    def clear_step(self) -> None:
        self.batch.groups = []
