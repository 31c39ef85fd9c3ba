"""BERT-family encoders for the pooling runner: BertModel, RobertaModel and
XLMRobertaModel (bge, e5, gte, multilingual-e5 shapes) as embedders, and their
*ForSequenceClassification cross-encoders (bge-reranker, ms-marco MiniLM).

HF's math: word + token-type + absolute position embeddings, LayerNorm; post-LN layers
(attention, add, LayerNorm; GELU MLP, add, LayerNorm); bidirectional attention within
each sequence (engine/models/bidirectional.py), no KV cache. RoBERTa / XLM-R number
positions from padding_idx + 1 (HF's create_position_ids_from_input_ids), so their
usable context is max_position_embeddings - padding_idx - 1 (512 for 514). Linears go
through engine/models/layers.py (kernels.dispatch); q/k/v are fused into one matmul at
load, as in the decoders."""
from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.bidirectional import SequenceLayout, attend
from engine.models.layers import Embedding, Linear, empty_param

_ACTIVATIONS = {"gelu": F.gelu,  # erf, HF's "gelu"
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "relu": F.relu}


def check_config(config) -> None:
    """ValueError naming what an encoder config asks for that this module does not run."""
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise ValueError(f"model: position_embedding_type {kind!r} unsupported for "
                         f"{config.architectures} (only absolute)")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"model: {config.architectures} configured as a decoder; only "
                         "bidirectional encoders run on the pooling runner")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"model: hidden_act {config.hidden_act!r} unsupported for "
                         f"{config.architectures} (supported: {sorted(_ACTIVATIONS)})")


def position_offset(config) -> int | None:
    """RoBERTa's positions start after padding_idx; None for BERT's (from 0)."""
    return config.pad_token_id if config.model_type in ("roberta", "xlm-roberta") else None


def max_positions(config) -> int:
    offset = position_offset(config)
    return config.max_position_embeddings - (0 if offset is None else offset + 1)


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype)
        self.bias = empty_param(size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class BertLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.scale = (hidden // self.num_heads) ** -0.5
        self.qkv_proj = Linear(hidden, 3 * hidden, True, dtype)
        self.o_proj = Linear(hidden, hidden, True, dtype)
        self.attn_norm = LayerNorm(hidden, eps, dtype)
        self.up_proj = Linear(hidden, config.intermediate_size, True, dtype)
        self.down_proj = Linear(config.intermediate_size, hidden, True, dtype)
        self.mlp_norm = LayerNorm(hidden, eps, dtype)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        attn = self.o_proj(attend(q, k, v, layout, self.num_heads, self.scale))
        x = self.attn_norm(attn + x)
        return self.mlp_norm(self.down_proj(self.act(self.up_proj(x))) + x)


class BertEncoder(nn.Module):
    """Embeddings and layers: token ids of whole sequences -> last hidden states [T, H]."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        check_config(config)
        hidden = config.hidden_size
        self.word_embeddings = Embedding(config.vocab_size, hidden, dtype)
        self.position_embeddings = Embedding(config.max_position_embeddings, hidden, dtype)
        self.token_type_embeddings = Embedding(config.type_vocab_size, hidden, dtype)
        self.embed_norm = LayerNorm(hidden, config.layer_norm_eps, dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype)
                                    for _ in range(config.num_hidden_layers))
        self.padding_idx = position_offset(config)

    def positions(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=input_ids.device)
        seq_index = torch.repeat_interleave(torch.arange(len(seq_lens), device=lens.device),
                                            lens)
        starts = torch.cumsum(lens, 0) - lens
        if self.padding_idx is None:
            return torch.arange(input_ids.shape[0], device=lens.device) - starts[seq_index]
        # HF's RoBERTa rule: real tokens count up from padding_idx + 1 within their
        # sequence; a padding id keeps padding_idx.
        real = (input_ids != self.padding_idx).to(torch.int64)
        counted = torch.cumsum(real, 0)
        before = (counted - real)[starts]
        return (counted - before[seq_index]) * real + self.padding_idx

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        """`input_ids`, `token_type_ids` [T]: the sequences back to back, of `seq_lens`."""
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(self.positions(input_ids, seq_lens))
        x = self.embed_norm(x)
        layout = SequenceLayout.of(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, layout)
        return x


# HF name (after the bert./roberta. prefix) -> ours; q/k/v go into qkv_proj's thirds.
_RENAMES = [(re.compile(p), r) for p, r in [
    (r"^embeddings\.LayerNorm\.", "encoder.embed_norm."),
    (r"^embeddings\.", "encoder."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"encoder.layers.\1.o_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"encoder.layers.\1.attn_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"encoder.layers.\1.up_proj."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"encoder.layers.\1.down_proj."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"encoder.layers.\1.mlp_norm."),
    (r"^pooler\.dense\.", "pooler."),
    (r"^classifier\.dense\.", "head_dense."),
    (r"^classifier\.out_proj\.", "classifier."),
]]
_QKV = re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$")
# Checkpoint tensors no task here reads: pretraining heads, the position-id buffer.
_UNUSED = re.compile(r"^(cls\.|lm_head\.|embeddings\.position_ids$)")


class BertPoolingModel(nn.Module):
    """The encoder, plus a classification head for the *ForSequenceClassification
    architectures. forward -> last hidden states; classify(first-token rows) -> logits."""
    is_encoder = True
    supports_lora = supports_tensor_parallel = supports_quantization = False

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.encoder = BertEncoder(config, dtype)
        arch = (config.architectures or [""])[0]
        self.task = "classify" if arch.endswith("ForSequenceClassification") else "embed"
        hidden = config.hidden_size
        # BERT: pooler (dense + tanh) then classifier; RoBERTa: its ClassificationHead
        # (dense + tanh then out_proj) on the first token, no pooler.
        self.pooler = self.head_dense = self.classifier = None
        if self.task == "classify":
            first = Linear(hidden, hidden, True, dtype)
            if position_offset(config) is None:
                self.pooler = first
            else:
                self.head_dense = first
            self.classifier = Linear(hidden, config.num_labels, True, dtype)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        return self.encoder(input_ids, token_type_ids, seq_lens)

    def classify(self, first_token: torch.Tensor) -> torch.Tensor:
        dense = self.pooler if self.pooler is not None else self.head_dense
        return self.classifier(torch.tanh(dense(first_token)))

    def prepack(self, batch_invariant: bool = False) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(batch_invariant)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        hidden = self.config.hidden_size
        for name, tensor in weights:
            name = re.sub(r"^(bert|roberta)\.", "", name)
            name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
            # An embedder pools hidden states itself; only BERT's classifier reads the pooler.
            if _UNUSED.match(name) or (name.startswith("pooler.") and self.pooler is None):
                continue
            match = _QKV.match(name)
            if match:
                layer, part, kind = match.groups()
                target = f"encoder.layers.{layer}.qkv_proj.{kind}"
                dest = params[target].data.narrow(0, "qkv".index(part[0]) * hidden, hidden)
                loaded.add(f"{target}#{part}")
            else:
                target = name
                for pattern, repl in _RENAMES:
                    target, hits = pattern.subn(repl, target, count=1)
                    if hits:
                        break
                if target not in params:
                    raise ValueError(f"weights: unexpected tensor {name!r} for "
                                     f"{self.config.architectures[0]}")
                dest = params[target].data
                loaded.add(target)
            if dest.shape != tensor.shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
        missing = [n for n in params if n not in loaded and not (
            n.endswith("qkv_proj.weight") or n.endswith("qkv_proj.bias"))]
        missing += [f"{n} ({part})" for n in params if ".qkv_proj." in n
                    for part in ("query", "key", "value") if f"{n}#{part}" not in loaded]
        if missing:
            raise ValueError(f"weights: checkpoint lacks {len(missing)} tensors, "
                             f"e.g. {missing[:3]}")
