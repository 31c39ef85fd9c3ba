"""A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) -> the per-layer
updates the wrapped layers add (engine/models/lora_linear.py). Everything an adapter could
get wrong for this model is refused here, naming the adapter and the reason."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora.request import LoRARequest
from engine.models.lora_linear import LoRATarget
from kernels import dispatch
from kernels.dispatch import LoRAWeights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT saves tensors under the wrapper's prefix: base_model.model.<HF module>.lora_A.weight
_KEY_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_PROJ_RE = re.compile(r"^(?P<prefix>model\.layers\.\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>\w+)$")


class LoRAAdapterError(ValueError):
    """The adapter cannot run on this model; the message names the adapter and why."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    int_id: int
    path: str
    rank: int  # the largest rank among its layers
    modules: dict[str, LoRAWeights]  # by wrapped layer name


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """An adapter folder as read from disk, before any tensor exists: the file reads can
    then happen on any thread, the torch work on the engine's."""
    config: dict
    weights: bytes  # adapter_model.safetensors


def _failure(request: LoRARequest):
    def fail(reason: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): "
                                f"{reason}")
    return fail


def read_adapter_files(request: LoRARequest) -> AdapterFiles:
    """Pure file reads (no torch); raises LoRAAdapterError naming the adapter."""
    fail = _failure(request)
    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise fail("folder does not exist")
    config = _read_config(folder, fail)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise fail(f"no {WEIGHTS_FILE}")
    try:
        return AdapterFiles(config, path.read_bytes())
    except OSError as exc:
        raise fail(f"{WEIGHTS_FILE} is not readable: {exc}") from None


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 files: AdapterFiles | None = None) -> LoRAAdapter:
    """`files`: already read (LoRARegistry.stage); None reads them now."""
    fail = _failure(request)
    files = files or read_adapter_files(request)
    config = files.config
    weights = _parse_weights(files.weights, fail)
    fused = _fused_names(targets)
    projections = {module.rsplit(".", 1)[1] for module in fused}
    listed = config.get("target_modules")
    # A list names module suffixes (a string is PEFT's regex; the tensors then tell).
    for module in listed if isinstance(listed, list) else ():
        if module.rsplit(".", 1)[-1] not in projections:
            raise fail(f"target module {module!r} is not in the model (LoRA runs on "
                       f"{', '.join(sorted(projections))})")
    pairs = _pair_tensors(weights, fail)
    by_layer: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    max_rank = 0
    for hf_module, (a, b) in sorted(pairs.items()):
        place = fused.get(hf_module)
        if place is None:
            raise fail(f"target module {hf_module!r} is not in the model (LoRA runs on "
                       f"q/k/v/o/gate/up/down_proj of its {_num_layers(targets)} layers)")
        layer, part = place
        target = targets[layer]
        part_name, out_features = target.parts[part]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise fail(f"{hf_module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                       "do not form a low-rank pair")
        if (a.shape[1], b.shape[0]) != (target.in_features, out_features):
            raise fail(f"{hf_module} is {a.shape[1]} -> {b.shape[0]} features, the base model's "
                       f"{part_name} is {target.in_features} -> {out_features}: an adapter "
                       "for another base model")
        if rank > max_lora_rank:
            raise fail(f"rank {rank} of {hf_module} is greater than max_lora_rank {max_lora_rank}")
        max_rank = max(max_rank, rank)
        by_layer.setdefault(layer, {})[part] = (a, b, _scaling(config, hf_module, rank))
    modules = {layer: _stack(targets[layer], parts, dtype, device)
               for layer, parts in by_layer.items()}
    return LoRAAdapter(request.lora_name, request.lora_int_id, request.lora_path, max_rank,
                       modules)


def _read_config(folder: Path, fail) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise fail(f"no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise fail(f"{CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {config['peft_type']!r} is not LORA")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise fail(f"{CONFIG_FILE}: r must be a positive integer, got {r!r}")
    # What PEFT can train but a LoRA delta on the projections cannot express (vLLM
    # refuses the same ones).
    if config.get("use_dora"):
        raise fail("DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise fail("adapter bias is not supported")
    if config.get("modules_to_save"):
        raise fail(f"modules_to_save {config['modules_to_save']} is not supported")
    if config.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out weights are not supported")
    return config


def _parse_weights(data: bytes, fail) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, ValueError) as exc:
        raise fail(f"{WEIGHTS_FILE} is not readable: {exc}") from None


def _pair_tensors(weights: dict[str, torch.Tensor], fail
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _KEY_RE.match(key)
        if match is None:
            raise fail(f"unexpected tensor {key!r} (only lora_A / lora_B weights are supported)")
        halves.setdefault(match["module"], {})[match["ab"]] = tensor
    if not halves:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise fail(f"{module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _fused_names(targets: dict[str, LoRATarget]) -> dict[str, tuple[str, int]]:
    """HF module name (model.layers.0.self_attn.q_proj) -> (wrapped layer, part index)."""
    names = {}
    for layer, target in targets.items():
        prefix = layer.rsplit(".", 1)[0]
        for index, (part, _) in enumerate(target.parts):
            names[f"{prefix}.{part}"] = (layer, index)
    return names


def _num_layers(targets: dict[str, LoRATarget]) -> int:
    return len({layer.rsplit(".", 2)[0] for layer in targets})


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling: alpha / r (alpha / sqrt(r) under rsLoRA); an alpha_pattern key that
    ends the module name at a dot boundary overrides lora_alpha (the first one, as PEFT).
    The rank is the tensors' own, which is where rank_pattern shows."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module)
    if alpha is None:
        alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pattern_value(pattern: dict, module: str):
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _stack(target: LoRATarget, parts: dict[int, tuple[torch.Tensor, torch.Tensor, float]],
           dtype: torch.dtype, device) -> LoRAWeights:
    """One adapter's update for one (possibly fused) layer: A stacks the parts' A rows
    ([sum of ranks, in]); B is block-diagonal over the parts ([out, sum of ranks]) with each
    part's scaling folded in, so a fused layer costs one shrink and one expand whatever
    subset of its parts the adapter trained."""
    total_rank = sum(a.shape[0] for a, _, _ in parts.values())
    a_all = torch.empty(total_rank, target.in_features, dtype=torch.float32)
    b_all = torch.zeros(target.out_features, total_rank, dtype=torch.float32)
    out_start = col = 0
    for index, (_, out_features) in enumerate(target.parts):
        if index in parts:
            a, b, scaling = parts[index]
            r = a.shape[0]
            a_all[col:col + r] = a.float()
            b_all[out_start:out_start + out_features, col:col + r] = b.float() * scaling
            col += r
        out_start += out_features
    return dispatch.prepare_lora(a_all.to(device=device, dtype=dtype),
                                 b_all.to(device=device, dtype=dtype))
