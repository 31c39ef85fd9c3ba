"""The mixture-of-experts op in torch: what kernels.dispatch's fused_moe computes, and the
reference its native and Triton kernels are tested against.

Routing (router logits -> top-k expert ids and weights) belongs to the model layer; this
op takes its result. For each token t and each of its k slots j with a valid expert
e = topk_ids[t, j] (0 <= e < num_experts; anything else, e.g. the -1 an expert-parallel
rank writes for an expert another rank holds, contributes nothing):

    h        = x[t] @ w13[e].T (+ w13_bias[e])        # [2I]: gate = h[:I], up = h[I:]
    a        = activation(gate, up)                    # [I]
    y_e      = a @ w2[e].T (+ w2_bias[e])              # [H]
    out[t]  += topk_weights[t, j] * y_e                # float32, in slot order j = 0..k-1

and out is returned in x's dtype. Activations: "silu" (SwiGLU: silu(gate) * up, Mixtral
and Qwen3-MoE) and "swigluoai" (gpt-oss: gate clamped above at `limit`, up to
[-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)). gpt-oss checkpoints
interleave gate and up columns; the loader lays them out as gate rows then up rows.

Each expert runs on the rows routed to it, so a token's result depends on its own row
and its experts alone, never on which other tokens share a step (the matmuls here are
torch's and may round differently by row count in bf16; batch-invariant mode takes the
native kernel's fixed-order path, or runs this op one row at a time).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "swigluoai")


def moe_activation(gate_up: torch.Tensor, activation: str, alpha: float = 1.702,
                   limit: float = 7.0) -> torch.Tensor:
    """[rows, 2I] gate then up -> [rows, I], computed in float32, returned in the input's
    dtype."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    if activation == "silu":
        out = F.silu(gate) * up
    elif activation == "swigluoai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        out = (up + 1.0) * (gate * torch.sigmoid(gate * alpha))
    else:
        raise ValueError(f"moe activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return out.to(gate_up.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", *,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k] (any float dtype, used
    in float32); topk_ids [T, k] integer; biases [E, 2I] / [E, H] or None. -> [T, H] in
    x's dtype. See the module docstring for the definition. w13 / w2 are read only as
    `.shape` and `w[e]`, so a stack that dequantizes one expert when indexed
    (kernels/torch_mxfp4.Mxfp4Stack) runs here unchanged."""
    def expert_forward(expert: int, rows_x: torch.Tensor) -> torch.Tensor:
        h = rows_x @ w13[expert].T
        if w13_bias is not None:
            h = h + w13_bias[expert]
        y = moe_activation(h, activation, alpha, limit) @ w2[expert].T
        return y if w2_bias is None else y + w2_bias[expert]

    return combine_experts(x, w2.shape[1], w13.shape[0], topk_weights, topk_ids, expert_forward)


def combine_experts(x: torch.Tensor, out_features: int, num_experts: int,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_forward: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The definition's routing and sum around any expert computation: each valid expert e
    runs `expert_forward(e, x[rows routed to e])` -> y [rows, out_features] once, and
    out[t] sums topk_weights[t, j] * y in float32 in slot order j; returned in x's dtype.
    fused_moe passes dense matmuls; kernels.dispatch's GGUF experts their block matmuls."""
    weights = topk_weights.float()
    ids = topk_ids.long()
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    contributions = []  # (slot j, rows, y) so the sum can go in slot order
    for expert in torch.unique(ids).tolist():
        if not 0 <= expert < num_experts:
            continue
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        y = expert_forward(expert, x[rows])
        contributions.append((slots, rows, y.float() * weights[rows, slots, None]))
    for slot in range(ids.shape[1]):
        for slots, rows, y in contributions:
            keep = slots == slot
            if bool(keep.any()):
                out.index_add_(0, rows[keep], y[keep])
    return out.to(x.dtype)
