"""Rotary position embedding: inverse frequencies per HF `rope_scaling` type, and a
cos/sin table precomputed for every position so a forward only gathers rows by position."""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from kernels import dispatch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Phi-3's first configs named longrope "su"; transformers' Phi3Config renames it, other
# configs may not.
_LONGROPE_TYPES = ("longrope", "su")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between the two thresholds interpolated smoothly.
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(theta: float, dim: int, s: Mapping[str, Any],
                   max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig_len = s.get("original_max_position_embeddings") or max_pos
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn_factor = (_yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
                       if m and m_all else _yarn_mscale(factor))
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def dim_for_rotations(n_rot: float) -> float:
        return dim * math.log(orig_len / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = _base_inv_freq(theta, dim)
    inv_freq = extrapolate / factor * ramp + extrapolate * (1 - ramp)
    return inv_freq, float(attn_factor)


def _rotary_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * getattr(config, "partial_rotary_factor", 1.0))


def _rope_type(config) -> tuple[str, Mapping[str, Any]]:
    scaling = getattr(config, "rope_scaling", None) or {}
    return scaling.get("rope_type", scaling.get("type", "default")), scaling


def longrope_inv_freq(config) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """LongRoPE (Phi-3): (short inverse frequencies, long ones, the position from which
    the long ones apply, cos/sin multiplier). HF's numbers: the per-dimension factors
    divide the base frequencies; the multiplier comes from max_position_embeddings /
    original_max_position_embeddings and is the same for both sets. Which set a position
    gets is RotaryEmbedding's rule (docs/models.md, "Phi-3 longrope")."""
    _, scaling = _rope_type(config)
    dim = _rotary_dim(config)
    theta = float(getattr(config, "rope_theta", 10000.0))
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if values is None or len(values) != dim // 2:
            raise ValueError(f"rope_scaling longrope: {key} must list {dim // 2} factors "
                             f"(one per rotated pair), got {values!r}")
        factors[key] = torch.tensor(values, dtype=torch.float32)
    # As HF: the config's original_max_position_embeddings when it has one (Phi-3's do),
    # and then the scale is the ratio of the two lengths, not rope_scaling's factor.
    original = getattr(config, "original_max_position_embeddings", None)
    if original:
        factor = config.max_position_embeddings / original
    else:
        original = config.max_position_embeddings
        factor = float(scaling.get("factor") or 1.0)
    mult = scaling.get("attention_factor")
    if mult is None:
        mult = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    base = theta ** exponents
    return (1.0 / (factors["short_factor"] * base), 1.0 / (factors["long_factor"] * base),
            int(original), float(mult))


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rot_dim/2], cos/sin multiplier) for an HF config whose
    positions all share one set (every type but longrope: longrope_inv_freq)."""
    dim = _rotary_dim(config)
    theta = float(getattr(config, "rope_theta", 10000.0))
    rope_type, scaling = _rope_type(config)
    if rope_type in _LONGROPE_TYPES:
        raise ValueError("rope_scaling longrope: two sets of frequencies by position; "
                         "see longrope_inv_freq")
    if rope_type == "default":
        return _base_inv_freq(theta, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(theta, dim) / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(theta, dim), scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(theta, dim, scaling, config.max_position_embeddings)
    raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r}; "
                     f"supported: {SUPPORTED_ROPE_TYPES}")


class RotaryEmbedding(nn.Module):
    """NeoX-style (rotate-half) RoPE, as HF Llama/Qwen2 apply it."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        if _rope_type(config)[0] in _LONGROPE_TYPES:
            # Each position's own set: short below original_max_position_embeddings, long
            # from it on, whatever the sequence's length. A position then rotates the same
            # in every chunking of a prompt and in the prefix cache (HF instead switches
            # the whole sequence once it grows past; docs/models.md, "Phi-3 longrope").
            short, long, original, mult = longrope_inv_freq(config)
            inv_freq = short
            angles = torch.cat((torch.outer(positions[:original], short),
                                torch.outer(positions[original:], long)))
        else:
            inv_freq, mult = rope_inv_freq(config)
            angles = torch.outer(positions, inv_freq)
        self.rot_half = inv_freq.numel()
        # HF rounds cos/sin to the model dtype before mixing, so do the same.
        self.register_buffer("cos", (angles.cos() * mult).to(dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * mult).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin [T, 1, rot_dim/2], positions) for a batch; gathered once per forward,
        used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1), positions

    def rotate_qkv(self, cos_sin: tuple, qkv: torch.Tensor, num_heads: int,
                   head_dim: int) -> torch.Tensor:
        """Rotate the first `num_heads` heads (q then k) of each row of a fused [T, qkv]
        buffer -> contiguous [T, num_heads, head_dim]. One fused pass on CPU bf16."""
        return dispatch.rope(qkv, num_heads, head_dim, self.rot_half, cos_sin[2], self.cos,
                             self.sin, cos_sin[0], cos_sin[1])

    def forward(self, cos_sin: tuple, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; returns a new contiguous tensor. The model calls
        rotate_qkv; this is the same rotation for a tensor of heads alone."""
        rows, heads, head_dim = x.shape
        return self.rotate_qkv(cos_sin, x.reshape(rows, heads * head_dim), heads, head_dim)
