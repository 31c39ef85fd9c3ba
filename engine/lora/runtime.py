"""One engine's LoRA state: the model's wrapped layers, the adapters loaded for them, and
each step's rows grouped by adapter for the wrapped layers to read."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
from torch import nn

from engine.config import LoRAConfig
from engine.core.request import Request
from engine.lora.adapter import AdapterFiles, LoRAAdapter, load_adapter
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoRARequest
from engine.models.lora_linear import attach_lora
from kernels.dispatch import LoRAWeights, make_segments


@dataclass(frozen=True, slots=True)
class LoRAStepPlan:
    """A step's token rows by adapter, as plain data: rank 0 hands it to the
    tensor-parallel workers with the step's inputs, and each rank applies it to its own
    (sharded) adapters. Base-model rows are in no group."""
    groups: tuple[tuple[LoRARequest, tuple[tuple[int, int], ...]], ...]


class LoRARuntime:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device,
                 shard: Callable[[str, LoRAWeights], LoRAWeights] | None = None) -> None:
        """`shard`: under tensor parallelism, cuts a whole adapter layer (by the wrapped
        layer's name) to this rank's slice (engine/distributed/lora_sharding.py)."""
        self.config = config
        self.shard = shard
        self.dtype = dtype
        self.device = device
        self.batch, self.targets = attach_lora(model)
        # The native all-layers decode of one sequence reads the base weights past the
        # wrappers: it may run only in steps without adapter rows.
        self._decoder = model.model
        self._fused_decode = model.model.fused_single_decode
        self.registry = LoRARegistry(self._load, config.max_cpu_loras)

    def _load(self, request: LoRARequest, files: AdapterFiles | None) -> LoRAAdapter:
        adapter = load_adapter(request, self.targets, self.config.max_lora_rank, self.dtype,
                               self.device, files)
        if self.shard is None:
            return adapter
        return replace(adapter, modules={name: self.shard(name, module)
                                         for name, module in adapter.modules.items()})

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        return self.registry.get(request)

    def stage(self, request: LoRARequest) -> None:
        """Any thread: read a not-loaded adapter's files ahead of the engine thread."""
        self.registry.stage(request)

    def plan_step(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> LoRAStepPlan:
        """Group the step's token rows (requests in batch order, `num_tokens` rows each)
        by adapter, adjacent rows of one adapter as one run."""
        spans: dict[int, tuple[LoRARequest, list[list[int]]]] = {}
        start = 0
        for request, n in zip(requests, num_tokens):
            lora = request.lora_request
            if lora is not None:
                runs = spans.setdefault(lora.lora_int_id, (lora, []))[1]
                if runs and runs[-1][1] == start:
                    runs[-1][1] = start + n
                else:
                    runs.append([start, start + n])
            start += n
        return LoRAStepPlan(tuple((lora, tuple((a, b) for a, b in runs))
                                  for lora, runs in spans.values()))

    def apply(self, plan: LoRAStepPlan) -> None:
        """Hand the wrapped layers this step's groups (loading an adapter not loaded)."""
        if not plan.groups:
            self.clear_step()
            self._decoder.fused_single_decode = self._fused_decode
            return
        self.batch.segments = make_segments([runs for _, runs in plan.groups], self.device)
        self.batch.modules = [self.registry.get(lora).modules for lora, _ in plan.groups]
        self._decoder.fused_single_decode = False

    def set_step(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> None:
        self.apply(self.plan_step(requests, num_tokens))

    def clear_step(self) -> None:
        self.batch.segments = None
        self.batch.modules = []
