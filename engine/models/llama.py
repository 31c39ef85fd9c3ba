"""Llama-family decoder (Llama / SmolLM2 / TinyLlama / Mistral / Qwen2) over a paged KV cache.

Parameter names mirror HF's except that q/k/v and gate/up are fused at load time
(qkv_proj, gate_up_proj): one matmul each instead of three and two.

Over 300 lines: the decoder layers and weight loader every native family subclasses
(qwen3, gemma, phi3, the MoE families)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from engine.config.sliding_window import layer_windows
from engine.models import single_decode
from engine.models.attention import AttentionMetadata, PagedAttention, per_layer
from engine.models.layers import (Embedding, GemmaRMSNorm, Linear, RMSNorm, SwiGLUMLP,
                                  empty_param)
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


def model_windows(config) -> list[int | None]:
    """Each layer's attention window (engine/config/sliding_window.py), None where it is
    full attention or where the window reaches past every position the model takes (Phi-3
    128k's 262144): such a window never drops a key, and None keeps the faster paths."""
    limit = config.max_position_embeddings
    return [w if w is not None and w < limit else None for w in layer_windows(config)]


class LlamaAttention(nn.Module):
    def __init__(self, config, spec: ArchSpec, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None = None) -> None:
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
        # The kernel's options live here, not on self.attn, which tensor-parallel
        # sharding replaces (engine/distributed/sharding.py); families set their own.
        self.scale = self.head_dim ** -0.5
        self.sliding_window = sliding_window
        self.soft_cap: float | None = None
        # [num_heads] float32 attention sinks (gpt-oss); None: off.
        self.sinks: nn.Parameter | None = None
        # Per-head norms of q and k before RoPE (Qwen3, Gemma 3); one weight [head_dim]
        # for every head, so they apply to any subset of heads (a tensor-parallel rank's).
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None

    def forward(self, cos_sin: CosSin, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        # .forward, not __call__: the model registers no hooks, and nn.Module's call path
        # costs ~2 us, ~10 times a layer: 0.5 ms of a 12 ms single-stream token.
        qkv = self.qkv_proj.forward(x)
        q_end, k_end = self.split
        qk = qkv if self.q_norm is None else self._normed_qk(qkv)
        # q and k sit side by side in each row, so one pass rotates both at once.
        qk = self.rotary.rotate_qkv(cos_sin, qk, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, k_end:].view(T, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                                self.soft_cap, self.sinks)
        return self.o_proj.forward(out.reshape(T, -1))

    def _normed_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """[T, (H + KVH) * D]: q_norm over each q head, k_norm over each k head, as the
        rows of one buffer for the fused rotation."""
        T, d = qkv.shape[0], self.head_dim
        q_end, k_end = self.split
        q, _ = self.q_norm.forward(qkv[:, :q_end].reshape(-1, d))
        k, _ = self.k_norm.forward(qkv[:, q_end:k_end].reshape(-1, d))
        return torch.cat((q.view(T, -1), k.view(T, -1)), dim=1)


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, config, spec: ArchSpec, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None = None, layer_index: int = 0) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = self.attention_class(config, spec, rotary, dtype, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = self.build_mlp(config, spec, dtype, layer_index)

    def build_mlp(self, config, spec: ArchSpec, dtype: torch.dtype, layer_index: int) -> nn.Module:
        """The feed-forward block; MoE families pick theirs by layer (engine/models/moe.py)."""
        return SwiGLUMLP(config.hidden_size, config.intermediate_size, spec.mlp_bias, dtype)

    def forward(self, cos_sin: CosSin, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward(x, residual)  # .forward: see LlamaAttention
        x = self.self_attn.forward(cos_sin, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaModel(nn.Module):
    layer_class = LlamaDecoderLayer

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        spec = arch_spec(config)
        # One table shared by every layer: same positions, same frequencies.
        self.rotary = RotaryEmbedding(config, dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.embed_quantized: GgufWeight | None = None
        self.layers = nn.ModuleList(self.layer_class(config, spec, self.rotary, dtype, window, i)
                                    for i, window in enumerate(model_windows(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # One sequence decoding runs all layers in one native call where it applies
        # (engine/models/single_decode.py); False keeps the layer-by-layer path.
        self.fused_single_decode = True
        self._single_plan: tuple[int, object] | None = None  # (KV cache address, plan or None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: expected {len(self.layers)} layers, got {len(kv_caches)}")
        metas = per_layer(meta, len(self.layers))
        x = self.embed(input_ids)
        if self.fused_single_decode and single_decode.applies(metas[0], input_ids.shape[0]):
            plan = self._plan_for(kv_caches)
            if plan is not None:
                hidden = single_decode.run(plan, x, positions, meta)
                if hidden is not None:
                    return hidden
        cos_sin = self.rotary.lookup(positions)
        residual = None
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, metas):
            x, residual = layer.forward(cos_sin, x, residual, kv_cache, layer_meta)
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


def _fused_param(name: str) -> str | None:
    """"qkv_proj" or "gate_up_proj" if `name` is a parameter of one, else None."""
    return next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel
    # The checkpoint stores q/k/v and gate/up already fused, under our names (Phi-3):
    # loaded as they are, and what LoRA adapters name (engine/models/lora_linear.py).
    checkpoint_fused = False

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.dtype = dtype
        self.model = self.model_class(config, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head_weight = self.model.embed_tokens.weight
        else:
            self.lm_head_weight = empty_param(config.vocab_size, config.hidden_size, dtype=dtype)
        self.lm_head_prepared: LinearWeight | None = None  # as Linear.prepared
        # Tensor parallelism: each rank's lm_head holds a slice of the vocabulary, and this
        # joins the ranks' logit columns into full rows (engine/distributed/sharding.py).
        self.gather_logits = None
        # c * tanh(logits / c) (Gemma's final_logit_softcapping); None: off.
        self.final_logit_softcap: float | None = None

    @classmethod
    def check_config(cls, config) -> None:
        """ValueError naming what the config asks for that this class does not run."""
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {config.hidden_act!r} unsupported for "
                             f"{cls.__name__} (only silu)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, vocab] logits, float32 unless `upcast` is False (the sampler then upcasts
        only when it needs more than an argmax)."""
        logits = dispatch.linear(hidden, self.lm_head_prepared
                                 or LinearWeight(self.lm_head_weight, None))
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        if self.final_logit_softcap is not None:
            # In the logits' dtype before any upcast, where HF caps them.
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap).mul_(cap)
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
            elif isinstance(module, (RMSNorm, GemmaRMSNorm, PagedAttention)):
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
                if self.checkpoint_fused and _fused_param(name) is not None:
                    # The whole fused tensor at once: every part of it is loaded.
                    sizes = self._shard_sizes(_fused_param(name))
                    loaded.update(f"{name}#{sum(sizes[:i])}" for i in range(1, len(sizes)))
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
            fused = _fused_param(name)
            if fused is None:
                offsets = [0]
            else:
                sizes = self._shard_sizes(fused)
                offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            if any(f"{name}#{o}" not in loaded for o in offsets):
                missing.append(name)
        if missing:
            raise ValueError(f"weights: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

