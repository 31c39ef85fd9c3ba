"""Llama-family decoder (Llama / SmolLM2 / TinyLlama / Mistral / Qwen2) over a paged KV cache.

Parameter names mirror HF's except that q/k/v and gate/up are fused at load time
(qkv_proj, gate_up_proj): one matmul each instead of three and two."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from engine.models import single_decode
from engine.models.attention import AttentionMetadata, PagedAttention
from engine.models.layers import Embedding, Linear, RMSNorm, SwiGLUMLP, empty_param
from engine.models.rope import RotaryEmbedding
from kernels import dispatch
from kernels.dispatch import GgufWeight
from kernels.dispatch import LinearWeight

KVCache = tuple[torch.Tensor, torch.Tensor]
CosSin = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # cos, sin, positions


@dataclass(frozen=True, slots=True)
class ArchSpec:
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool


def arch_spec(config) -> ArchSpec:
    if config.model_type == "qwen2":
        return ArchSpec(qkv_bias=True, o_bias=False, mlp_bias=False)
    attn_bias = bool(getattr(config, "attention_bias", False))
    return ArchSpec(qkv_bias=attn_bias, o_bias=attn_bias,
                    mlp_bias=bool(getattr(config, "mlp_bias", False)))


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, spec: ArchSpec, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, q_size + kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, spec.qkv_bias, dtype)
        self.o_proj = Linear(q_size, config.hidden_size, spec.o_bias, dtype)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, cos_sin: CosSin, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        # .forward, not __call__: the model registers no hooks, and nn.Module's call path
        # costs ~2 us, ~10 times a layer: 0.5 ms of a 12 ms single-stream token.
        qkv = self.qkv_proj.forward(x)
        q_end, k_end = self.split
        # q and k sit side by side in each row, so one pass rotates both at once.
        qk = self.rotary.rotate_qkv(cos_sin, qkv, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, k_end:].view(T, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, meta)
        return self.o_proj.forward(out.reshape(T, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, spec: ArchSpec, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, spec, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, spec.mlp_bias, dtype)

    def forward(self, cos_sin: CosSin, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward(x, residual)  # .forward: see LlamaAttention
        x = self.self_attn.forward(cos_sin, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        spec = arch_spec(config)
        # One table shared by every layer: same positions, same frequencies.
        self.rotary = RotaryEmbedding(config, dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.embed_quantized: GgufWeight | None = None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, spec, self.rotary, dtype)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # One sequence decoding runs all layers in one native call where it applies
        # (engine/models/single_decode.py); False keeps the layer-by-layer path.
        self.fused_single_decode = True
        self._single_plan: tuple[int, object] | None = None  # (KV cache address, plan or None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: expected {len(self.layers)} layers, got {len(kv_caches)}")
        x = self.embed(input_ids)
        if self.fused_single_decode and meta.max_query_len == 1 and input_ids.shape[0] == 1:
            plan = self._plan_for(kv_caches)
            if plan is not None:
                hidden = single_decode.run(plan, x, positions, meta)
                if hidden is not None:
                    return hidden
        cos_sin = self.rotary.lookup(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer.forward(cos_sin, x, residual, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quantized is not None:
            return dispatch.gguf_embedding(input_ids, self.embed_quantized, self.norm.weight.dtype)
        return self.embed_tokens.forward(input_ids)

    def _plan_for(self, kv_caches: list[KVCache]):
        key = kv_caches[0][0].data_ptr()
        if self._single_plan is None or self._single_plan[0] != key:
            self._single_plan = (key, single_decode.build_plan(self, kv_caches))
        return self._single_plan[1]


# HF checkpoint name -> (our param name, shard index within the fused param).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_FUSED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {config.hidden_act!r} unsupported for "
                             f"{type(self).__name__} (only silu)")
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head_weight = self.model.embed_tokens.weight
        else:
            self.lm_head_weight = empty_param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.lm_head_prepared: LinearWeight | None = None  # as Linear.prepared
        # Tensor parallelism: each rank's lm_head holds a slice of the vocabulary, and this
        # joins the ranks' logit columns into full rows (engine/distributed/sharding.py).
        self.gather_logits = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, vocab] logits, float32 unless `upcast` is False (the sampler then upcasts
        only when it needs more than an argmax)."""
        logits = dispatch.linear(hidden, self.lm_head_prepared
                                 or LinearWeight(self.lm_head_weight, None))
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        return logits.float() if upcast else logits

    def prepack(self, batch_invariant: bool = False) -> None:
        """Hand the dense weights to kernels.dispatch to lay out for their matmuls (on
        the CPU, oneDNN's blocked copies). Must run after load_weights and sharding:
        packed copies do not track edits. `batch_invariant`: every matmul, norm and
        attention takes the kernels whose per-row results do not depend on the batch
        (kernels/dispatch/); the fused single-sequence decode runs those same kernels."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(batch_invariant)
            elif isinstance(module, (RMSNorm, PagedAttention)):
                module.batch_invariant = batch_invariant
        if self.lm_head_weight is not None:
            self.lm_head_prepared = dispatch.prepare_linear(self.lm_head_weight, None,
                                                            batch_invariant)
        elif self.lm_head_prepared is not None:  # GGUF blocks
            self.lm_head_prepared.batch_invariant = batch_invariant

    def quantize(self, weights: dict[str, GgufWeight]) -> None:
        """Swap dense weights for GGUF-quantized ones, by module name ("lm_head" and
        "model.embed_tokens" name the output and input tables); dense ones are dropped."""
        modules = dict(self.named_modules())
        # Each table once in its serving layout: a tied embedding and lm_head share it.
        served: dict[int, GgufWeight] = {}
        for name, weight in weights.items():
            if id(weight) not in served:
                served[id(weight)] = dispatch.prepare_gguf(weight)
            weight = served[id(weight)]
            if name == "lm_head":
                self.lm_head_prepared = dispatch.prepare_linear(weight, None)
                self.lm_head_weight = None
            elif name == "model.embed_tokens":
                self.model.embed_quantized = weight
                self.model.embed_tokens.weight = None
            elif isinstance(modules.get(name), Linear):
                modules[name].quantize(weight)
            else:
                raise ValueError(f"quantization: no linear layer named {name!r}")

    def _shard_sizes(self, fused_name: str) -> tuple[int, ...]:
        attn = self.model.layers[0].self_attn
        if fused_name == "qkv_proj":
            kv = attn.num_kv_heads * attn.head_dim
            return (attn.num_heads * attn.head_dim, kv, kv)
        inter = self.model.layers[0].mlp.intermediate_size
        return (inter, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (fused) parameters, casting to the model dtype."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight":
                if self.tie_word_embeddings:
                    continue
                name = "lm_head_weight"
            match = _FUSED_RE.search(name)
            if match is None:
                target, offset = name, 0
            else:
                fused, shard = _FUSED[match.group(1)]
                target = name.replace(match.group(1), fused)
                sizes = self._shard_sizes(fused)
                offset = sum(sizes[:shard])
            param = params.get(target)
            if param is None:
                raise ValueError(f"weights: unexpected tensor {name!r} for {type(self).__name__}")
            dest = param.data.narrow(0, offset, sizes[shard]) if match else param.data
            if dest.shape != tensor.shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{target}#{offset}")
        self._check_complete(params, loaded)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head_weight" and self.tie_word_embeddings:
                continue
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
            if fused is None:
                offsets = [0]
            else:
                sizes = self._shard_sizes(fused)
                offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            if any(f"{name}#{o}" not in loaded for o in offsets):
                missing.append(name)
        if missing:
            raise ValueError(f"weights: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

