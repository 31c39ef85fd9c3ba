"""Where one Triton model instance's engine runs, from what Triton tells the instance.

instance_group count N gives N instances, each its own stub process and engine; Triton
spreads requests over them. Each is a data-parallel rank in vLLM's sense: its index
tags and offsets its KV events, and with KIND_GPU it runs on the device Triton gave it."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from engine.api import EngineConfig

_TRAILING_INDEX = re.compile(r"_(\d+)$")


def instance_rank(instance_name: str) -> int:
    """Triton names instances `<group>_<index>` (llm_0_0, llm_0_1, ...)."""
    match = _TRAILING_INDEX.search(instance_name or "")
    return int(match.group(1)) if match else 0


def place_instance(config: EngineConfig, args: dict[str, Any]) -> EngineConfig:
    rank = instance_rank(args.get("model_instance_name", ""))
    device = config.device
    if args.get("model_instance_kind") == "GPU" and device == "auto":
        device = f"cuda:{int(args.get('model_instance_device_id', 0))}"
    if rank == config.data_parallel_rank and device == config.device:
        return config
    return dataclasses.replace(config, data_parallel_rank=rank, device=device)
