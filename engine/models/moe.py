"""The mixture-of-experts feed-forward block, and what loads its checkpoint tensors, for
every MoE family (engine/models/mixtral.py, engine/models/qwen3_moe.py,
engine/models/gpt_oss.py).

A block is a router GEMM ([num_experts, hidden], `gate`, HF's name), a routing rule that
turns its logits into each token's top-k experts and their weights, and the experts,
stacked (w13 [E, 2I, H]: each expert's gate rows then its up rows; w2 [E, H, I]) and run
through kernels.dispatch.fused_moe, whose definition is kernels/torch_moe.py.

Under tensor parallelism (engine/distributed/sharding.py) each rank keeps the same slice
of every expert's intermediate columns and the whole router; the block all-reduces its
partial output, as a row-parallel down projection does."""
from __future__ import annotations

import enum
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from engine.models.layers import Linear, empty_param
from engine.models.llama import LlamaForCausalLM
from kernels import dispatch
from kernels.dispatch import ExpertWeights


class Routing(enum.Enum):
    # softmax over all the router's logits in float32, top-k of the probabilities: Qwen3-MoE
    # with norm_topk_prob False (the k weights then sum to less than 1).
    SOFTMAX_TOPK = "softmax_topk"
    # ... and the k probabilities renormalised to sum to 1: Mixtral, Qwen3-MoE with
    # norm_topk_prob.
    SOFTMAX_TOPK_RENORM = "softmax_topk_renorm"
    # top-k of the logits (the router has a bias), then softmax over those k in the logits'
    # dtype: gpt-oss.
    TOPK_SOFTMAX = "topk_softmax"


def route(logits: torch.Tensor, top_k: int, rule: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), slot 0
    the highest; HF's op sequence for each rule, so ties and roundings fall its way."""
    if rule is Routing.TOPK_SOFTMAX:
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype).float(), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if rule is Routing.SOFTMAX_TOPK_RENORM:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


# HF's per-expert tensors -> the part of the stack they fill.
EXPERT_PARTS = ("gate", "up", "down")
# ... and, in a block with expert biases (gpt-oss), their biases' parts.
BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")


class FusedMoE(nn.Module):
    """out = sum over the token's top-k experts e of weight_e * down_e(act(gate_e(x)) * up_e(x)),
    computed by kernels.dispatch.fused_moe."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 routing: Routing, dtype: torch.dtype, router_bias: bool = False,
                 expert_bias: bool = False, activation: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size  # a rank's share under tensor parallelism
        self.num_experts = num_experts
        self.top_k = top_k
        self.routing = routing
        self.activation = activation
        self.gate = Linear(hidden_size, num_experts, router_bias, dtype)
        self.w13 = empty_param(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        self.w2 = empty_param(num_experts, hidden_size, intermediate_size, dtype=dtype)
        self.w13_bias = (empty_param(num_experts, 2 * intermediate_size, dtype=dtype)
                         if expert_bias else None)
        self.w2_bias = empty_param(num_experts, hidden_size, dtype=dtype) if expert_bias else None
        # Set by tensor-parallel sharding: sums the ranks' partial outputs.
        self.reduce_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate.forward(x), self.top_k, self.routing)
        experts = ExpertWeights(self.w13, self.w2, self.w13_bias, self.w2_bias)
        out = dispatch.fused_moe(x, experts, weights, ids, self.activation)
        return out if self.reduce_group is None else self.reduce_group.all_reduce(out)

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts a checkpoint must fill for each expert."""
        return EXPERT_PARTS + (BIAS_PARTS if self.w13_bias is not None else ())

    def expert_slice(self, expert: int | slice, part: str) -> torch.Tensor:
        """Where HF's [I, H] gate / up or [H, I] down weight of `expert` goes, or its [I]
        gate / up or [H] down bias (a slice of experts: theirs, stacked)."""
        inter = self.intermediate_size
        stacks = {"gate": (self.w13, slice(None, inter)), "up": (self.w13, slice(inter, None)),
                  "down": (self.w2, slice(None)),
                  "gate_bias": (self.w13_bias, slice(None, inter)),
                  "up_bias": (self.w13_bias, slice(inter, None)),
                  "down_bias": (self.w2_bias, slice(None))}
        if part not in stacks or stacks[part][0] is None:
            raise ValueError(f"expert part: expected one of {self.parts}, got {part!r}")
        stack, rows = stacks[part]
        return stack.data[expert, rows]


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family causal LM whose layers' `mlp` is a FusedMoE (or, in some layers, a
    dense SwiGLUMLP). Loading: each expert's HF tensors go into its slice of the stack;
    everything else, the router included (renamed to `mlp.gate`), is llama.py's."""
    # The block's HF module name under model.layers.{i} ("mlp", Mixtral's
    # "block_sparse_moe") and its experts' projection names -> EXPERT_PARTS.
    hf_moe_block = "mlp"
    hf_expert_parts: dict[str, str] = {}
    # HF's router module under the block, loaded as our `gate` (gpt-oss: "router").
    hf_router = "gate"
    # HF tensors that hold a part of every expert at once, under {block}.experts (gpt-oss's
    # gate_up_proj ...) -> the parts they fill; place_stacked copies them in.
    hf_stacked_parts: dict[str, tuple[str, ...]] = {}
    # Neither path knows experts: LoRA wraps dense projections by name, GGUF quantizes
    # Linear layers only.
    supports_lora = False
    supports_quantization = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._experts_loaded: set[tuple[str, int, str]] = set()
        try:
            super().load_weights(self._place_experts(weights))
        finally:
            del self._experts_loaded

    def _place_experts(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """Copies the expert tensors into the stacks as they stream past; yields the rest,
        the MoE block and its router renamed to ours, for llama.py's loader."""
        parts = "|".join(map(re.escape, self.hf_expert_parts))
        block = re.escape(self.hf_moe_block)
        expert_re = re.compile(rf"(model\.layers\.\d+)\.{block}\.experts\.(\d+)\.({parts})\.weight")
        stacked = "|".join(map(re.escape, self.hf_stacked_parts))
        stacked_re = re.compile(rf"(model\.layers\.\d+)\.{block}\.experts\.({stacked})")
        blocks = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        for name, tensor in weights:
            match = stacked_re.fullmatch(name) if stacked else None
            if match is not None:
                module = f"{match.group(1)}.mlp"
                moe = blocks.get(module)
                if moe is None:
                    raise ValueError(f"weights: unexpected tensor {name!r} for "
                                     f"{type(self).__name__}")
                self.place_stacked(moe, match.group(2), name, tensor)
                self._experts_loaded.update((module, e, part) for e in range(moe.num_experts)
                                            for part in self.hf_stacked_parts[match.group(2)])
                continue
            match = expert_re.fullmatch(name)
            if match is None:
                name = name.replace(f".{self.hf_moe_block}.", ".mlp.")
                yield name.replace(f".mlp.{self.hf_router}.", ".mlp.gate."), tensor
                continue
            module = f"{match.group(1)}.mlp"
            moe, expert = blocks.get(module), int(match.group(2))
            if moe is None or expert >= moe.num_experts:
                raise ValueError(f"weights: unexpected tensor {name!r} for {type(self).__name__}")
            part = self.hf_expert_parts[match.group(3)]
            dest = moe.expert_slice(expert, part)
            if dest.shape != tensor.shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            self._experts_loaded.add((module, expert, part))

    def place_stacked(self, moe: FusedMoE, hf_part: str, name: str, tensor: torch.Tensor) -> None:
        """Copy `tensor`, HF's `hf_part` of every expert of `moe` (named `name`), into the
        stacks; the family knows its layout. ValueError on a wrong shape."""
        raise NotImplementedError(f"{type(self).__name__} loads no stacked expert tensors")

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        blocks = [(name, m) for name, m in self.named_modules() if isinstance(m, FusedMoE)]
        missing = [f"{name}.experts.{e}.{part}" for name, moe in blocks
                   for e in range(moe.num_experts) for part in moe.parts
                   if (name, e, part) not in self._experts_loaded]
        if missing:
            raise ValueError(f"weights: checkpoint lacks {len(missing)} expert tensors, "
                             f"e.g. {missing[:3]}")
        stacked = {f"{name}.{p}" for name, _ in blocks
                   for p in ("w13", "w2", "w13_bias", "w2_bias")}
        super()._check_complete({n: p for n, p in params.items() if n not in stacked}, loaded)

    def _shard_sizes(self, fused_name: str) -> tuple[int, ...]:
        # The dense layers' gate/up (layer 0 may be an MoE one).
        if fused_name == "gate_up_proj":
            return (self.config.intermediate_size,) * 2
        return super()._shard_sizes(fused_name)
