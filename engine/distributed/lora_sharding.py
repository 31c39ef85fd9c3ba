"""Tensor parallelism for LoRA adapters: each adapter layer is cut like its base layer
(engine/distributed/sharding.py), so a rank's update lands on exactly its slice.

Column-parallel q/k/v and gate/up keep their output rows of B (A is replicated: every
rank needs the whole shrink x A^T); row-parallel o and down keep their input columns of
A (B is replicated), and the partial updates ride on the base layer's all-reduce."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.distributed.sharding import HeadShard, even_slice, head_shard
from engine.models.llama import head_dim_of
from kernels import dispatch
from kernels.dispatch import LoRAWeights


@dataclass(frozen=True, slots=True)
class LoRASharder:
    """One rank's cut of every adapter layer, by the wrapped layer's name."""
    qkv_rows: tuple[tuple[int, int], ...]  # this rank's q, k and v rows of the fused layer
    o_columns: tuple[int, int]
    gate_up_rows: tuple[tuple[int, int], ...]
    down_columns: tuple[int, int]

    def __call__(self, name: str, module: LoRAWeights) -> LoRAWeights:
        kind = name.rsplit(".", 1)[1]
        if kind == "qkv_proj":
            return dispatch.prepare_lora(module.a, _rows(module.b, self.qkv_rows))
        if kind == "gate_up_proj":
            return dispatch.prepare_lora(module.a, _rows(module.b, self.gate_up_rows))
        start, end = self.o_columns if kind == "o_proj" else self.down_columns
        return dispatch.prepare_lora(module.a[:, start:end], module.b)


def lora_sharder(hf_config, world_size: int, rank: int) -> LoRASharder:
    """The same slices shard_model keeps for this rank's base layers."""
    num_heads = hf_config.num_attention_heads
    num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
    d = head_dim_of(hf_config)
    heads: HeadShard = head_shard(num_heads, num_kv, world_size, rank)
    q_size, kv_size = num_heads * d, num_kv * d
    q_rows = (heads.q_start * d, (heads.q_start + heads.num_heads) * d)
    kv_rows = (heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d)
    inter = hf_config.intermediate_size
    start, end = even_slice(inter, world_size, rank, "intermediate_size")
    return LoRASharder(
        qkv_rows=(q_rows, (q_size + kv_rows[0], q_size + kv_rows[1]),
                  (q_size + kv_size + kv_rows[0], q_size + kv_size + kv_rows[1])),
        o_columns=q_rows,
        gate_up_rows=((start, end), (inter + start, inter + end)),
        down_columns=(start, end))


def _rows(b: torch.Tensor, pieces: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.cat([b[start:end] for start, end in pieces])
