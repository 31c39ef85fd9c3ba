"""Megatron-style tensor parallelism for the Llama-family model: which slice of each
weight a rank keeps, and the layers that join the ranks' partial results.

Per layer: QKV and gate/up are column-parallel (each rank computes its own heads and its
own MLP columns, no communication), O and down are row-parallel (each rank multiplies its
slice of the input features, one all-reduce sums the partial outputs). The embedding and
lm_head are vocab-parallel: each rank holds a contiguous slice of the vocabulary rows;
embedding rows outside it are zero and the all-reduce fills them in, logits are gathered
as column blocks. Every rank ends up with the full hidden state after each layer.

A mixture-of-experts block (engine/models/moe.py) is sharded as its experts' MLPs: each
rank keeps the same intermediate columns of every expert (w13's gate and up rows, w2's
input columns) and the whole router, so every rank routes every token alike; the block
all-reduces its partial sums. With expert parallelism (enable_expert_parallel) a rank
keeps whole experts instead, vLLM's linear placement (expert_range), and the router
still whole: its partial output is its experts' share of each token, the same
all-reduce adds the ranks' shares. Attention, dense MLPs and the vocabulary are split as
without it.

Over 300 lines: the tensor- and expert-parallel cuts of every layer kind share the head
and slice arithmetic and the shardability checks."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import PagedAttention
from engine.models.layers import Embedding, Linear
from engine.models.moe import FusedMoE
from engine.distributed.group import ParallelGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """One rank's attention heads: q heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads) of the full model."""
    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_shard(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """KV heads are split across ranks while there are at least as many as ranks, and
    replicated past that (each rank then keeps the one KV head its q heads read), as in
    vLLM; either way a rank's q heads must all read KV heads it holds."""
    if num_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's "
                         f"num_attention_heads ({num_heads})")
    local_heads = num_heads // world_size
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} must divide the model's "
                             f"num_key_value_heads ({num_kv_heads}) when it is not larger")
        local_kv = num_kv_heads // world_size
        return HeadShard(local_heads, local_kv, rank * local_heads, rank * local_kv)
    if world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} is larger than the model's "
                         f"num_key_value_heads ({num_kv_heads}) but not a multiple of it, so "
                         "the KV heads cannot be replicated evenly")
    ranks_per_kv_head = world_size // num_kv_heads
    return HeadShard(local_heads, 1, rank * local_heads, rank // ranks_per_kv_head)


def even_slice(size: int, world_size: int, rank: int, what: str) -> tuple[int, int]:
    if size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's {what} ({size})")
    part = size // world_size
    return rank * part, (rank + 1) * part


def vocab_slice(vocab_size: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, rows per rank): every rank holds ceil(vocab / N) rows so the logit
    blocks gather evenly; the last rank's rows past the vocabulary are zero padding."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size), per_rank


def expert_range(num_experts: int, world_size: int, rank: int) -> tuple[int, int]:
    """The experts [start, end) rank `rank` holds under expert parallelism: vLLM's linear
    placement, num_experts // N each and one more for each of the first num_experts % N
    ranks."""
    base, extra = divmod(num_experts, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def model_num_experts(hf_config) -> int | None:
    """The routed experts per MoE layer (Mixtral's and gpt-oss's num_local_experts,
    Qwen3-MoE's num_experts), None for a dense model."""
    for name in ("num_local_experts", "num_experts"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def expert_parallel_applies(hf_config, world_size: int, enabled: bool) -> bool:
    """Whether enable_expert_parallel changes how this model is split: not for a dense
    model (vLLM ignores the flag there too; logged) nor for one rank. ValueError when
    there are fewer experts than ranks (a rank would hold none)."""
    if not enabled or world_size == 1:
        return False
    experts = model_num_experts(hf_config)
    if experts is None:
        logger.info("enable_expert_parallel: the model has no experts; ignored (attention "
                    "and MLPs are tensor-parallel as without it)")
        return False
    if world_size > experts:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {world_size} is larger "
                         f"than the model's {experts} experts per layer, so a rank would "
                         "hold none; use at most that many ranks, or turn it off")
    return True


def check_shardable(hf_config, world_size: int, expert_parallel: bool = False) -> None:
    """Raise ValueError, before any worker starts, if the model cannot be split N ways
    (`expert_parallel`: what expert_parallel_applies decided)."""
    num_heads = hf_config.num_attention_heads
    num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_shard(num_heads, num_kv, world_size, 0)
    moe_inter = getattr(hf_config, "moe_intermediate_size", None)  # Qwen3-MoE's experts
    # Whole experts are not cut: then only a dense MLP's intermediate_size must divide, and
    # Mixtral's and gpt-oss's intermediate_size is their experts'.
    if not expert_parallel or moe_inter:
        even_slice(hf_config.intermediate_size, world_size, 0, "intermediate_size")
    if moe_inter and not expert_parallel:
        even_slice(moe_inter, world_size, 0, "moe_intermediate_size")


class RowParallelLinear(Linear):
    """Holds input features [start, end) of the full layer; the all-reduce adds the
    ranks' partial products. The bias lives on rank 0 only, so it is added once."""

    def __init__(self, full: Linear, start: int, end: int, group: ParallelGroup) -> None:
        out_features = full.weight.shape[0]
        super().__init__(end - start, out_features, False, full.weight.dtype)
        self.weight = _param(full.weight[:, start:end])
        self.bias = full.bias if group.is_driver else None
        self.group = group

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product, before the all-reduce (a LoRA wrapper adds its
        own partial update to it first)."""
        return super().forward(x)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial_forward(x))


class VocabParallelEmbedding(Embedding):
    """Rows [start, end) of the table: ids outside give zero rows, which the all-reduce
    replaces by the owning rank's row (exact: one non-zero term per element)."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, group: ParallelGroup) -> None:
        nn.Module.__init__(self)
        self.weight = _param(weight)
        self.start, self.end = start, end
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local_ids = (input_ids - self.start).masked_fill_(outside, 0)
        rows = F.embedding(local_ids, self.weight)
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(rows)


class LogitsGather:
    """The lm_head's column blocks from every rank -> [rows, vocab] on every rank."""

    def __init__(self, group: ParallelGroup, vocab_size: int) -> None:
        self.group = group
        self.vocab_size = vocab_size

    def __call__(self, local_logits: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_columns(local_logits)[:, :self.vocab_size]


def shard_model(net: nn.Module, group: ParallelGroup, batch_invariant: bool = False,
                expert_parallel: bool = False) -> HeadShard:
    """Cut a loaded LlamaForCausalLM down to this rank's slices, in place, and re-pack
    the smaller weights (for batch-invariant kernels if asked); `expert_parallel`: MoE
    blocks keep whole experts. Returns the rank's heads (the KV cache is sized from them)."""
    world, rank = group.world_size, group.rank
    config = net.config
    check_shardable(config, world, expert_parallel)
    model = net.model
    for module in net.modules():  # packing may have dropped the rows the slices cut
        if isinstance(module, Linear):
            module.unpack()
    first = model.layers[0].self_attn
    heads = head_shard(first.num_heads, first.num_kv_heads, world, rank)
    for layer in model.layers:
        _shard_attention(layer.self_attn, heads, group)
        if isinstance(layer.mlp, FusedMoE):
            (_place_experts if expert_parallel else _shard_experts)(layer.mlp, group)
        else:
            _shard_mlp(layer.mlp, group)
    _shard_vocab(net, group)
    model.fused_single_decode = False  # its native plan runs the whole, unsharded layer
    net.prepack(batch_invariant)
    return heads


def _shard_attention(attn: nn.Module, heads: HeadShard, group: ParallelGroup) -> None:
    d = attn.head_dim
    q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
    q_rows = (heads.q_start * d, (heads.q_start + heads.num_heads) * d)
    kv_rows = (heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d)
    # The fused QKV rows are [q | k | v]; this rank's are its q, k and v rows, kept in
    # that order so the layer's split points still apply.
    pieces = [q_rows, (q_size + kv_rows[0], q_size + kv_rows[1]),
              (q_size + kv_size + kv_rows[0], q_size + kv_size + kv_rows[1])]
    qkv = attn.qkv_proj
    qkv.weight = _param(torch.cat([qkv.weight[a:b] for a, b in pieces]))
    if qkv.bias is not None:
        qkv.bias = _param(torch.cat([qkv.bias[a:b] for a, b in pieces]))
    attn.o_proj = RowParallelLinear(attn.o_proj, q_rows[0], q_rows[1], group)
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:  # one logit per query head (gpt-oss): the rank's heads' own
        attn.sinks = _param(sinks[heads.q_start:heads.q_start + heads.num_heads])
    attn.num_heads, attn.num_kv_heads = heads.num_heads, heads.num_kv_heads
    local_q, local_kv = heads.num_heads * d, heads.num_kv_heads * d
    attn.split = (local_q, local_q + local_kv)
    attn.attn = PagedAttention(heads.num_heads, heads.num_kv_heads, d)


def _shard_mlp(mlp: nn.Module, group: ParallelGroup) -> None:
    inter = mlp.intermediate_size
    start, end = even_slice(inter, group.world_size, group.rank, "intermediate_size")
    gate_up = mlp.gate_up_proj
    # Fused rows are [gate | up]; the rank keeps the same columns of both.
    rows = [(start, end), (inter + start, inter + end)]
    gate_up.weight = _param(torch.cat([gate_up.weight[a:b] for a, b in rows]))
    if gate_up.bias is not None:
        gate_up.bias = _param(torch.cat([gate_up.bias[a:b] for a, b in rows]))
    mlp.down_proj = RowParallelLinear(mlp.down_proj, start, end, group)
    mlp.intermediate_size = end - start


def _shard_experts(moe: FusedMoE, group: ParallelGroup) -> None:
    inter = moe.intermediate_size
    start, end = even_slice(inter, group.world_size, group.rank, "experts' intermediate size")
    # Each expert's rows are [gate | up], as a dense gate_up_proj's.
    moe.w13 = _param(torch.cat([moe.w13[:, start:end], moe.w13[:, inter + start:inter + end]],
                               dim=1))
    if moe.w13_bias is not None:
        moe.w13_bias = _param(torch.cat([moe.w13_bias[:, start:end],
                                         moe.w13_bias[:, inter + start:inter + end]], dim=1))
    moe.w2 = _param(moe.w2[:, :, start:end])
    if not group.is_driver:  # the output bias is added once, on rank 0, as RowParallelLinear's
        moe.w2_bias = None
    moe.intermediate_size = end - start
    moe.reduce_group = group


def _place_experts(moe: FusedMoE, group: ParallelGroup) -> None:
    """Expert parallelism: keep experts expert_range(...) whole. Every tensor the block
    holds itself is per expert along dim 0 (the stacks, their biases, a quantized block's
    buffers), so each is cut alike; the router, a submodule, stays whole. Each expert's
    output bias is then added by the one rank that holds it."""
    start, end = expert_range(moe.num_experts, group.world_size, group.rank)
    for name, param in list(moe.named_parameters(recurse=False)):
        setattr(moe, name, _param(param[start:end]))
    for name, buffer in list(moe.named_buffers(recurse=False)):
        setattr(moe, name, buffer[start:end].clone())  # stays a buffer of the same kind
    device = moe.gate.weight.device
    expert_map = torch.full((moe.num_experts,), -1, dtype=torch.int64, device=device)
    expert_map[start:end] = torch.arange(end - start, device=device)
    moe.expert_map = expert_map
    moe.reduce_group = group


def _shard_vocab(net: nn.Module, group: ParallelGroup) -> None:
    vocab = net.config.vocab_size
    start, end, per_rank = vocab_slice(vocab, group.world_size, group.rank)
    model = net.model
    embed_rows = model.embed_tokens.weight[start:end]
    model.embed_tokens = VocabParallelEmbedding(embed_rows, start, end, group)
    head = embed_rows if net.tie_word_embeddings else net.lm_head_weight[start:end]
    if net.tie_word_embeddings and end - start == per_rank:
        net.lm_head_weight = model.embed_tokens.weight  # still one table
    else:
        # Zero rows pad the last rank's block to per_rank logits; LogitsGather drops them.
        padded = torch.zeros(per_rank, head.shape[1], dtype=head.dtype, device=head.device)
        padded[:end - start] = head
        net.lm_head_weight = _param(padded)
    net.gather_logits = LogitsGather(group, vocab)


def _param(tensor: torch.Tensor) -> nn.Parameter:
    # A copy, so the full tensor it was cut from can be freed.
    return nn.Parameter(tensor.detach().clone().contiguous(), requires_grad=False)


def shard_loaded(loaded, group: ParallelGroup, batch_invariant: bool = False,
                 expert_parallel: bool = False):
    """shard_model on a LoadedModel; the returned copy reports this rank's heads, which
    is what the KV cache (and its size per token) is built from."""
    heads = shard_model(loaded.model, group, batch_invariant, expert_parallel)
    return dataclasses.replace(loaded, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads)
