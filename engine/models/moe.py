"""The mixture-of-experts feed-forward block, and what loads its checkpoint tensors, for
every MoE family (engine/models/mixtral.py, engine/models/qwen3_moe.py,
engine/models/gpt_oss.py).

A block is a router GEMM ([num_experts, hidden], `gate`, HF's name), a routing rule that
turns its logits into each token's top-k experts and their weights, and the experts,
stacked (w13 [E, 2I, H]: each expert's gate rows then its up rows; w2 [E, H, I]) and run
through kernels.dispatch.fused_moe, whose definition is kernels/torch_moe.py.

Under tensor parallelism (engine/distributed/sharding.py) each rank keeps the same slice
of every expert's intermediate columns and the whole router; with expert parallelism it
keeps whole experts instead, a contiguous range, and maps the router's ids to its own
(-1, which the op skips, for the others'). Either way the block all-reduces its partial
output, as a row-parallel down projection does.

With a workload trace on, each block counts the token slots the router sent each expert
(ExpertLoad), per layer: under expert parallelism a rank's share of a layer's slots is its
work at that layer, and every layer's all-reduce waits for the busiest rank, so summed
over layers the figure would hide a hot expert that moves from layer to layer."""
from __future__ import annotations

import enum
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from engine.models.layers import Linear, empty_param
from engine.models.llama import LlamaForCausalLM
from kernels import dispatch
from kernels.dispatch import ExpertWeights, GgufWeight


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
        # Set by expert-parallel sharding: global expert id -> this rank's stack index, -1
        # where another rank holds the expert. num_experts stays the router's (global) count.
        self.expert_map: torch.Tensor | None = None
        self.batch_invariant = False  # set by MoEForCausalLM.prepack
        # ExpertLoad's counter, [num_experts] int64: token slots routed to each expert since
        # it was last read. None (tracing off): nothing is counted.
        self.expert_load: torch.Tensor | None = None
        # quantization="gguf": per expert tables in the file's blocks in place of w13 / w2
        # (set by quantize_experts, which drops the dense stacks).
        self.w13_gguf: tuple[GgufWeight, ...] | None = None
        self.w2_gguf: tuple[GgufWeight, ...] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate.forward(x), self.top_k, self.routing)
        if self.expert_load is not None:
            self.expert_load += torch.bincount(ids.flatten(), minlength=self.num_experts)
        if self.expert_map is not None:
            ids = self.expert_map[ids]
        experts = ExpertWeights(self.w13, self.w2, self.w13_bias, self.w2_bias,
                                w13_gguf=self.w13_gguf, w2_gguf=self.w2_gguf)
        out = dispatch.fused_moe(x, experts, weights, ids, self.activation,
                                 batch_invariant=self.batch_invariant)
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

    def quantize_experts(self, w13: list[GgufWeight], w2: list[GgufWeight]) -> None:
        """Serve the experts from GGUF tables, one per expert: [2I, H] (gate rows, then up
        rows) and [H, I]; the dense stacks are dropped."""
        want = ((2 * self.intermediate_size, self.w13.shape[2]),
                (self.w2.shape[1], self.intermediate_size))
        for part, tables, shape in (("w13", w13, want[0]), ("w2", w2, want[1])):
            got = {(t.out_features, t.in_features) for t in tables}
            if len(tables) != self.num_experts or got != {shape}:
                raise ValueError(f"quantization: {len(tables)} {part} tables of {sorted(got)}, "
                                 f"expected {self.num_experts} of {shape}")
        self.w13_gguf, self.w2_gguf = tuple(w13), tuple(w2)
        self.w13 = self.w2 = None


# quantize()'s names for expert tables (engine/models/gguf_weights.py makes them):
# "{FusedMoE module}.w13.{expert}" and "{FusedMoE module}.w2.{expert}".
_EXPERT_TABLE_RE = re.compile(r"(.+)\.(w13|w2)\.(\d+)")


class ExpertLoad:
    """Token slots routed to each expert of each MoE block of a model (every rank routes
    every token, so rank 0's blocks see the whole step). Counting costs a bincount per
    block per forward, and runs only in the blocks of a model one was made for."""

    def __init__(self, blocks: list[FusedMoE], device: torch.device) -> None:
        self.blocks = blocks
        for block in blocks:
            block.expert_load = torch.zeros(block.num_experts, dtype=torch.int64, device=device)

    @classmethod
    def of(cls, model: nn.Module) -> "ExpertLoad | None":
        """Counters on `model`'s MoE blocks (they count from now on); None without any."""
        blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
        # the model's device (a GGUF block has no dense expert stacks to ask)
        return cls(blocks, next(model.parameters()).device) if blocks else None

    def take(self) -> list[list[int]]:
        """Per MoE block, in layer order, the counts since the last take; zeroes them."""
        counts = [block.expert_load.tolist() for block in self.blocks]
        for block in self.blocks:
            block.expert_load.zero_()
        return counts

    def stop(self) -> None:
        """The blocks count no more."""
        for block in self.blocks:
            block.expert_load = None


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
    # LoRA wraps dense projections by name, not experts. GGUF: the families whose files
    # llama.cpp writes (Mixtral, Qwen3-MoE) allow it, their experts served by quantize.
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

    def quantize(self, weights: dict[str, GgufWeight]) -> None:
        """LlamaForCausalLM's, plus the experts' tables (named as _EXPERT_TABLE_RE says)."""
        experts: dict[str, dict[str, dict[int, GgufWeight]]] = {}
        rest = {}
        for name, weight in weights.items():
            match = _EXPERT_TABLE_RE.fullmatch(name)
            if match is None:
                rest[name] = weight
            else:
                experts.setdefault(match[1], {}).setdefault(match[2], {})[int(match[3])] = weight
        super().quantize(rest)
        modules = dict(self.named_modules())
        for name, parts in experts.items():
            moe = modules.get(name)
            if not isinstance(moe, FusedMoE):
                raise ValueError(f"quantization: no MoE block named {name!r}")
            tables = [parts.get(part, {}) for part in ("w13", "w2")]
            if any(sorted(t) != list(range(moe.num_experts)) for t in tables):
                raise ValueError(f"quantization: {name} needs w13 and w2 tables for experts "
                                 f"0..{moe.num_experts - 1}")
            moe.quantize_experts(*([dispatch.prepare_gguf(t[e]) for e in range(moe.num_experts)]
                                   for t in tables))

    def prepack(self, batch_invariant: bool = False) -> None:
        super().prepack(batch_invariant)
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.batch_invariant = batch_invariant

    def _shard_sizes(self, fused_name: str) -> tuple[int, ...]:
        # The dense layers' gate/up (layer 0 may be an MoE one).
        if fused_name == "gate_up_proj":
            return (self.config.intermediate_size,) * 2
        return super()._shard_sizes(fused_name)
