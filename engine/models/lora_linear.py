"""Linear layers that add, per batch row, the low-rank update of that row's LoRA adapter.

`attach_lora` wraps the four projections of every decoder layer (fused qkv_proj and
gate_up_proj included); the runner hands each step's adapter groups to the shared
`LoRABatch` before the forward. A step with no adapter rows runs the base layer only.
The update itself, every group at once, is kernels.dispatch.lora_add's."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.models.layers import Linear
from kernels import dispatch
from kernels.dispatch import LoRASegments, LoRAWeights


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """One wrapped layer as an adapter sees it: the HF projections fused into it, in order,
    with their output sizes, and the input size they share."""
    in_features: int
    parts: tuple[tuple[str, int], ...]  # (HF projection name, out features)

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.parts)


@dataclass(slots=True)
class LoRABatch:
    """This step's adapter groups, shared by every wrapped layer of one model; the runner
    sets it before the forward and clears it after (no segments: base rows only).
    `modules[g]` is segment g's adapter's layers by name."""
    segments: LoRASegments | None = None
    modules: list[dict[str, LoRAWeights]] = field(default_factory=list)


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, name: str, batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.batch = batch

    def kernel_weight(self):
        # The native single-sequence decode reads the base weights; the runtime lets it
        # run only in steps without adapter rows.
        return self.base.kernel_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A row-parallel base (tensor parallelism) holds a slice of the input features and
        # so does the adapter's A: its update is a partial sum too, added before the
        # base's all-reduce so that one collective sums both.
        partial = getattr(self.base, "partial_forward", None)
        y = self.base.forward(x) if partial is None else partial(x)
        segments = self.batch.segments
        if segments is not None:
            weights = [modules.get(self.name) for modules in self.batch.modules]
            # The base layer's kernels were chosen batch-invariant or not at load; the
            # update follows them.
            dispatch.lora_add(x, y, segments, weights, self.base.kernel_weight().batch_invariant)
        return y if partial is None else self.base.reduce(y)


def attach_lora(model: nn.Module) -> tuple[LoRABatch, dict[str, LoRATarget]]:
    """Wrap a Llama-family model's projections; returns the batch they read and what each
    wrapped layer (by module name) is made of, for the adapter loader to check against."""
    batch = LoRABatch()
    targets: dict[str, LoRATarget] = {}
    config = model.config
    # The full model's sizes, from its config: under tensor parallelism the layers are
    # already cut to one rank's slices, but adapters are checked (and then sharded) whole.
    head_dim = model.model.layers[0].self_attn.head_dim
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    inter = config.intermediate_size
    hidden = config.hidden_size
    # Adapters name the base model's HF modules: q/k/v and gate/up apart, or fused as one
    # where the checkpoint fuses them (Phi-3), in the same [q | k | v] / [gate | up] rows.
    if getattr(model, "checkpoint_fused", False):
        qkv_parts = (("qkv_proj", q + 2 * kv),)
        gate_up_parts = (("gate_up_proj", 2 * inter),)
    else:
        qkv_parts = (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
        gate_up_parts = (("gate_proj", inter), ("up_proj", inter))
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{i}"
        layout = {
            "self_attn.qkv_proj": (hidden, qkv_parts),
            "self_attn.o_proj": (q, (("o_proj", hidden),)),
            "mlp.gate_up_proj": (hidden, gate_up_parts),
            "mlp.down_proj": (inter, (("down_proj", hidden),)),
        }
        for path, (in_features, parts) in layout.items():
            parent_name, attr = path.split(".")
            parent = attn if parent_name == "self_attn" else mlp
            name = f"{prefix}.{path}"
            setattr(parent, attr, LoRALinear(getattr(parent, attr), name, batch))
            targets[name] = LoRATarget(in_features, parts)
    return batch, targets
