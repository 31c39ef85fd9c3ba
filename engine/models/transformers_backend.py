"""The general path (vLLM's "Transformers backend"): any decoder-only causal LM that
transformers implements, run by transformers' own modeling code over our paged KV cache.

How: the HF model is built with its attention implementation set to ours
(ATTN_IMPLEMENTATION, registered through transformers' AttentionInterface), so every
attention layer hands its rotated q/k/v to `_paged_attention`, which writes K/V into our
cache and attends with kernels.dispatch over the step's metadata. HF's own KV cache is
off (use_cache=False, no past_key_values) and it builds no mask (see _register). A step is
one flat sequence of T tokens (batch 1, position_ids = our positions), so the scheduler,
prefix caching, chunked prefill, preemption and sampling see the same interface as the
native models give them.

Which models qualify follows vLLM's rule: the class declares
`_supports_attention_backend` (its attention goes through the interface and it threads
the attention kwargs); why_not() says why another is refused. Which of HF's other modules
then run on our kernels (linears, norms, RoPE) is transformers_kernels.py's job.

Over 300 lines: the attention plugin, the architecture checks and the model class are
each too small for a file of their own and share the step context
(transformers_step.py)."""
from __future__ import annotations

import copy
import logging
import re
from typing import Any, Iterable

import torch
from torch import nn

from engine.config.sliding_window import FULL, SLIDING, layer_windows
from engine.models.attention import AttentionMetadata, per_layer
from engine.models import transformers_kernels
from engine.models.transformers_compat import dtype_kwarg
from engine.models.transformers_step import CURRENT_STEP, KVCache, Step
from kernels import dispatch

logger = logging.getLogger(__name__)

# The name our attention goes by in transformers' AttentionInterface (and so in the
# config's _attn_implementation).
ATTN_IMPLEMENTATION = "engine_paged"

def _paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q [1, H, T, D], k/v [1, KVH, T, D] (RoPE
    applied) -> ([1, T, H, D], no weights), as its eager_attention_forward returns."""
    step = CURRENT_STEP.get()
    if step is None:
        raise RuntimeError("the general path's attention ran outside "
                           "TransformersForCausalLM.forward (no paged KV cache to use)")
    # What our kernels cannot honour: attention sinks (gpt-oss), a head mask, a layer
    # marked non-causal for this call.
    if kwargs.get("s_aux") is not None or kwargs.get("head_mask") is not None:
        raise ValueError(f"model: {step.architecture} passes attention sinks or a head mask, "
                         "which the paged attention kernels do not take")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise ValueError(f"model: {step.architecture} asks for non-causal attention")
    if attention_mask is not None:
        # The kernels mask by the metadata (causal per sequence, the window); a mask HF
        # built anyway would say something they do not (custom or bidirectional spans).
        raise ValueError(f"model: {step.architecture} passes an attention mask of its own, "
                         "which the paged attention kernels cannot apply")
    if step.tracing:
        return torch.zeros_like(query.transpose(1, 2)), None
    layer = module.layer_idx
    key_cache, value_cache = step.kv_caches[layer]
    meta = step.metas[layer]
    if query.shape[0] != 1 or key.shape[-1] != value.shape[-1] or \
            key.shape[1:2] + key.shape[3:] != key_cache.shape[2:]:
        raise ValueError(f"model: {step.architecture} layer {layer} gives q {tuple(query.shape)}, "
                         f"k {tuple(key.shape)}, v {tuple(value.shape)}; the KV cache holds "
                         f"[*, *, {key_cache.shape[2]}, {key_cache.shape[3]}] per token (from "
                         "the config's num_key_value_heads and head_dim)")
    # [1, heads, T, D] -> [T, heads, D]: the kernels take tokens first, contiguous.
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    dispatch.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    # The window HF would mask with; where its attention call does not name one, the
    # config's. The config's is also the one the KV-cache manager frees blocks behind, so
    # a wider one named here would read freed blocks.
    window = step.windows[layer]
    if sliding_window is not None:
        if window is not None and sliding_window != window:
            raise ValueError(f"model: {step.architecture} layer {layer} attends through a "
                             f"window of {sliding_window}, its config says {window}")
        window = sliding_window
    extra: dict[str, Any] = {}
    if window is not None:
        extra["sliding_window"] = int(window)
    if softcap is not None:
        extra["soft_cap"] = float(softcap)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = dispatch.paged_attention(q, key_cache, value_cache, meta.block_tables,
                                   meta.query_start_loc, meta.seq_lens, scale,
                                   meta.max_query_len, meta.max_seq_len, **extra)
    return out.unsqueeze(0), None


def _register() -> None:
    # Only the attention function is registered. An implementation that transformers'
    # AttentionMaskInterface does not know makes every create_*_mask return None before
    # any work (masking_utils._preprocess_mask_arguments: "for TGI/vLLM backends"): no
    # T x T mask, no packed-sequence detection each step. Registering a mask function
    # that returns None would cost both and make Gemma 2's sliding mask read
    # config.sliding_window, which disable_sliding_window clears (HF then raises).
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention)


_register()


# HF rotary embeddings that recompute their frequencies from the longest position in
# the batch (dynamic_rope_update): with several requests in one flat step, one request's
# tokens would depend on the others'.
_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _architecture(config: Any) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        return archs[0]
    return f"<no architectures; model_type {getattr(config, 'model_type', '?')!r}>"


def hf_class(config: Any) -> type:
    """The transformers class for the config's architecture; ValueError naming it and
    why where the general path cannot run it."""
    reason = why_not(config)
    if reason is not None:
        raise ValueError(f"model: architecture {_architecture(config)} cannot run on the "
                         f"general path (model_impl='transformers'): {reason}")
    import transformers
    return getattr(transformers, _architecture(config))


def why_not(config: Any) -> str | None:
    """None if the general path runs this config, else why not (one clause)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        return "the config names no architectures"
    arch = archs[0]
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; only decoder-only causal LMs run here"
    causal = set()
    for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal.update([names] if isinstance(names, str) else names)
    cls = getattr(transformers, arch, None)
    if cls is None:
        return (f"transformers {transformers.__version__} has no class {arch} (remote code is "
                "never run)")
    if arch not in causal:
        return ("it is not a causal LM (AutoModelForCausalLM does not map to it: an encoder, "
                "a masked LM or another head)")
    if not getattr(cls, "_supports_attention_backend", False):
        return ("its modeling code does not declare _supports_attention_backend, so its "
                "attention cannot be routed to the paged cache")
    if config.sub_configs or not all(hasattr(config, a) for a in (
            "num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")):
        return "its config is composite (multimodal or nested text config)"
    if not isinstance(config, cls.config_class):
        return f"its config is a {type(config).__name__}, {arch} takes {cls.config_class.__name__}"
    kinds = getattr(config, "layer_types", None) or []
    other = sorted({k for k in kinds if k not in (FULL, SLIDING)})
    if other:
        return (f"it has layers of type {other}; the paged cache holds attention layers "
                f"only ({FULL!r}, {SLIDING!r})")
    if getattr(config, "attention_chunk_size", None):
        return "it uses chunked attention (attention_chunk_size), which the kernels lack"
    rope = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in _BATCH_DEPENDENT_ROPE:
        return (f"its rope_scaling type {rope_type!r} recomputes frequencies from the longest "
                "sequence in the batch, so requests batched together would change each other")
    return None


class _Hidden(nn.Module):
    """Stands in for the base model under the head-only copy of the HF CausalLM (see
    TransformersForCausalLM.compute_logits): returns the hidden states it is given."""

    def forward(self, *args: Any, inputs_embeds: torch.Tensor, **kwargs: Any):
        # *args: some heads pass input_ids (None here) positionally.
        from transformers.modeling_outputs import MoeModelOutputWithPast
        # The MoE output is a superset of the dense one: CausalLM forwards that read
        # router_logits find None.
        return MoeModelOutputWithPast(last_hidden_state=inputs_embeds)


class TransformersForCausalLM(nn.Module):
    """An HF `*ForCausalLM` behind LlamaForCausalLM's interface (what the model runner
    calls): forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden],
    compute_logits, load_weights (checkpoint names), prepack."""

    # What other parts of the engine check before applying themselves to a model: the
    # LoRA wrappers, tensor-parallel sharding and GGUF quantization all rewrite the
    # native model's own layers, which HF's modules are not.
    supports_lora = False
    supports_tensor_parallel = False
    supports_quantization = False

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers.modeling_utils import no_init_weights

        cls = hf_class(config)
        self.architecture = _architecture(config)
        # Our own copy: HF writes the attention implementation into the config, and the
        # loader's copy (LoadedModel.hf_config) stays as the checkpoint has it.
        config = copy.deepcopy(config)
        config.use_cache = False
        if hasattr(config, "output_router_logits"):
            config.output_router_logits = False  # MoE auxiliary loss: training only
        # Uninitialised parameters (load_weights fills them): no RNG time; the buffers
        # (RoPE frequencies) are computed as HF computes them.
        with no_init_weights():
            hf = cls._from_config(config, **dtype_kwarg(dtype),
                                  attn_implementation=ATTN_IMPLEMENTATION)
        hf.tie_weights()  # no_init_weights skips it: lm_head shares the embedding if tied
        hf.eval()
        hf.requires_grad_(False)
        self.config = hf.config
        self.dtype = dtype
        self.hf = hf
        base = hf.base_model
        if base is hf:
            raise ValueError(f"model: {self.architecture} has no base model under "
                             f"{hf.base_model_prefix!r}; the general path needs one")
        # Unregistered: it is hf's submodule already (one name per parameter).
        self.__dict__["base"] = base
        self.num_layers = int(config.num_hidden_layers)
        self._check_attention_layers()
        self.windows = layer_windows(config)
        # The same CausalLM with the base model swapped for _Hidden: compute_logits runs
        # HF's own head code on our hidden states (lm_head and whatever the architecture
        # does to logits after it: Granite's logits_scaling, Cohere's logit_scale,
        # Gemma 2's final soft-capping). It shares every module but the base with `hf`,
        # so moving or loading `hf` moves and loads it. Not a registered submodule.
        head = copy.copy(hf)
        head.__dict__["_modules"] = {**hf._modules, hf.base_model_prefix: _Hidden()}
        self.__dict__["_head"] = head
        self._prepacked = False
        import transformers
        logger.info("model %s runs on the general path: transformers %s modeling code over "
                    "the paged KV cache", self.architecture, transformers.__version__)

    def _check_attention_layers(self) -> None:
        # Our attention function finds a layer's cache by module.layer_idx: every
        # attention layer must carry a distinct index in [0, num_hidden_layers).
        indices = [m.layer_idx for m in self.hf.modules()
                   if hasattr(m, "is_causal") and hasattr(m, "layer_idx")]
        if sorted(indices) != list(range(self.num_layers)):
            raise ValueError(f"model: {self.architecture}'s attention layers carry layer_idx "
                             f"{sorted(indices, key=str)}, not one each of "
                             f"0..{self.num_layers - 1}; the general path maps layers to KV "
                             "caches by that index")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches: expected {self.num_layers} layers, got {len(kv_caches)}")
        step = Step(kv_caches, per_layer(attn_metadata, self.num_layers), self.windows,
                     self.architecture)
        token = CURRENT_STEP.set(step)
        try:
            out = self.base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                            use_cache=False)
        finally:
            CURRENT_STEP.reset(token)
        return out[0][0]  # last_hidden_state [1, T, hidden] -> [T, hidden], final norm applied

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, vocab] logits, float32 unless `upcast` is False, as the HF model's forward
        computes them from its last hidden states."""
        logits = self._head(inputs_embeds=hidden.unsqueeze(0), use_cache=False).logits[0]
        return logits.float() if upcast else logits

    def prepack(self, batch_invariant: bool = False) -> None:
        """Run HF's modules on our kernels where a load-time probe shows them computing
        what HF's code does (transformers_kernels.prepack): every plain nn.Linear on the
        CPU goes to kernels.dispatch as the native model's layers do (the matmuls are most
        of a step, and the native GEMM's panels ran SmolLM2's decode steps 1.7-1.8x torch's
        bf16 linear here, AMX host), siblings HF calls on one input as one stacked matmul,
        and RMSNorm-like norms and RoPE on the native kernels. batch_invariant is refused:
        HF's activations are torch's, not the batch-invariant kernels."""
        if batch_invariant:
            raise ValueError(f"batch_invariant: not available on the general path "
                             f"({self.architecture} runs transformers' layers, whose norms "
                             "and activations are torch's, not the batch-invariant kernels)")
        if self._prepacked:
            return  # the packed copies are the weights now; packing again would read placeholders
        self._prepacked = True
        transformers_kernels.prepack(self)

    def quantize(self, weights: Any) -> None:
        raise ValueError(f"quantization 'gguf': not available on the general path "
                         f"({self.architecture}); GGUF runs on the native Llama family only")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the HF model, cast to its dtype. Tied
        weights are one parameter and load from either name; a tensor the model does not
        know raises, and so does a parameter the checkpoint lacks."""
        hf = self.hf
        params = dict(hf.named_parameters(remove_duplicate=False))
        buffers = dict(hf.named_buffers(remove_duplicate=False))
        prefix = hf.base_model_prefix + "."
        renames = [(re.compile(p), r) for p, r in (hf._checkpoint_conversion_mapping or {}).items()]
        ignored = [re.compile(p) for p in (hf._keys_to_ignore_on_load_unexpected or [])]
        loaded: set[int] = set()
        for name, tensor in weights:
            target = self._resolve(name, params, prefix, renames)
            if target is None:
                if name in buffers or (prefix + name) in buffers:
                    # A persistent buffer saved with the weights (or a computed one an older
                    # export kept, e.g. rotary_emb.inv_freq): HF's own values stand.
                    continue
                if "rotary_emb.inv_freq" in name or any(p.search(name) for p in ignored):
                    continue
                raise ValueError(f"weights: unexpected tensor {name!r} for {self.architecture}")
            param = params[target]
            if param.shape != tensor.shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(id(param))
        allowed = [re.compile(p) for p in (hf._keys_to_ignore_on_load_missing or [])]
        missing = sorted({name for name, p in params.items() if id(p) not in loaded
                          and not any(a.search(name) for a in allowed)})
        if missing:
            raise ValueError(f"weights: checkpoint lacks {len(missing)} tensors of "
                             f"{self.architecture}, e.g. {missing[:3]}")

    @staticmethod
    def _resolve(name: str, params: dict[str, nn.Parameter], prefix: str,
                 renames: list[tuple[re.Pattern, str]]) -> str | None:
        from transformers import PreTrainedModel

        # HF's legacy renames (LayerNorm gamma/beta), then the class's own key mapping,
        # then a base-model checkpoint (no prefix) loaded into the CausalLM.
        candidate, _ = PreTrainedModel._fix_state_dict_key_on_load(name)
        for pattern, replacement in renames:
            candidate = pattern.sub(replacement, candidate)
        for option in (candidate, prefix + candidate):
            if option in params:
                return option
        return None
