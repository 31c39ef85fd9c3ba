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
the attention kwargs); why_not() says why another is refused."""
from __future__ import annotations

import contextvars
import copy
import functools
import logging
import re
import types
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from engine.config.sliding_window import FULL, SLIDING, layer_windows
from engine.models.attention import AttentionMetadata, per_layer
from engine.models.transformers_compat import dtype_kwarg
from kernels import dispatch

logger = logging.getLogger(__name__)

# The name our attention goes by in transformers' AttentionInterface (and so in the
# config's _attn_implementation).
ATTN_IMPLEMENTATION = "engine_paged"

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class _Step:
    """What the attention layers need of the forward in progress. HF calls the
    attention function deep inside its own code, so this travels in a context variable
    rather than through HF's kwargs (not every architecture threads them to every layer)."""
    kv_caches: list[KVCache]
    metas: list[AttentionMetadata]
    windows: list[int | None]
    architecture: str
    # id(cos) -> (cos, sin, the native rope's tables or None): HF computes cos/sin once
    # a forward and hands the same tensors to every layer (see _native_rope).
    rope_tables: dict[int, tuple] = field(default_factory=dict)
    # A forward that only records which linears share an input (_shared_input_groups):
    # attention answers zeros and touches no cache.
    tracing: bool = False


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("engine_paged_step",
                                                                    default=None)


def _paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q [1, H, T, D], k/v [1, KVH, T, D] (RoPE
    applied) -> ([1, T, H, D], no weights), as its eager_attention_forward returns."""
    step = _STEP.get()
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


def _prepared_linear(prepared: Any, x: torch.Tensor) -> torch.Tensor:
    # HF's activations are [1, T, in]; the kernels take rows.
    return dispatch.linear(x.reshape(-1, x.shape[-1]), prepared).view(*x.shape[:-1], -1)


class _SharedInputLinears:
    """Sibling nn.Linears that HF's code calls one after another on the same input
    tensor (q/k/v, gate/up): the first call runs one kernel over their stacked weights
    and each member takes its columns. One call instead of three or two: SmolLM2's 211
    matmul calls a bf16 decode step become 121, as the native model's fused qkv and
    gate_up weights have them. A member called on another tensor, or again on the same
    one, runs the stacked weight on it afresh."""

    __slots__ = ("weight", "bounds", "x", "out", "pending")

    def __init__(self, weight: Any, bounds: list[tuple[int, int]]) -> None:
        self.weight, self.bounds = weight, bounds
        self.x = self.out = None
        self.pending: set[int] = set()

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self.x or index not in self.pending:
            self.out = dispatch.linear(x.reshape(-1, x.shape[-1]), self.weight)
            self.x, self.pending = x, set(range(len(self.bounds)))
        self.pending.discard(index)
        start, end = self.bounds[index]
        out = self.out[:, start:end]
        if not self.pending:
            self.x = self.out = None  # each member has its part: hold nothing past the step
        # A column slice is contiguous at one row (a decode step); HF may view it freely.
        return out.contiguous().view(*x.shape[:-1], end - start)


# The row-norm kernels a norm module may be standing in for: `weight * norm(x)` and
# Gemma's `(1 + weight) * norm(x)`, each with HF's rounding order (kernels.dispatch).
_NORM_KERNELS = (dispatch.add_rms_norm, dispatch.gemma_rms_norm)


def _native_norm(module: nn.Module) -> Any:
    """A forward for `module` that runs one native norm kernel instead of HF's ~10 torch
    ops (the upcast, pow, mean, rsqrt, two multiplies, the casts back: 55 us a norm, 61
    norms and 3.4 ms of a SmolLM2 bf16 decode step here), or None. Which modules qualify
    is not read from class names: any leaf with a 1-D weight, no bias and an epsilon
    whose own output one of _NORM_KERNELS reproduces on probe rows (an offset row, so a
    mean-subtracting LayerNorm differs; a tiny one, so the epsilon must be the one used;
    a large one); the probe runs on the module's loaded weight, the one it will keep."""
    weight = module._parameters.get("weight")
    if (weight is None or weight.dim() != 1 or weight.device.type != "cpu"
            or weight.dtype not in (torch.float32, torch.bfloat16)
            or module._modules or getattr(module, "bias", None) is not None):
        return None
    eps = next((v for v in (getattr(module, a, None) for a in ("variance_epsilon", "eps"))
                if isinstance(v, float)), None)
    if eps is None:
        return None
    width = weight.shape[0]
    rows = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    rows[0] += 0.5
    rows[1] *= 1e-3
    rows[2] *= 30.0
    probe = rows.to(weight.dtype)
    original = module.forward
    try:
        expected = original(probe)
    except Exception:  # noqa: BLE001 - a module that cannot take plain rows keeps its forward
        return None
    # bf16: HF rounds the normalised rows before the weight multiply in some families and
    # after it in others; a kernel of the other order is 1 ulp off, which torch's bf16
    # tolerance takes and a wrong formula (a mean, another epsilon, 1 + w) does not.
    tolerance = dict(rtol=1.6e-2, atol=1e-5) if weight.dtype == torch.bfloat16 else \
        dict(rtol=1e-5, atol=1e-6)
    for kernel in _NORM_KERNELS:
        forward = functools.partial(_norm_forward, kernel, weight, eps, original)
        got = forward(probe)
        if (got.shape == expected.shape and got.dtype == expected.dtype
                and torch.allclose(got, expected, **tolerance)):
            return forward
    return None


def _norm_forward(kernel: Any, weight: torch.Tensor, eps: float, original: Any,
                  x: torch.Tensor) -> torch.Tensor:
    if x.dtype != weight.dtype or x.device != weight.device:
        return original(x)  # what the probe did not see: HF's own code decides
    return kernel(None, x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


# The module-level function HF's attention forwards rotate q and k with, in every family
# that applies RoPE outside the attention function (Llama's modeling code and its copies).
_ROPE_FUNCTION = "apply_rotary_pos_emb"


def _native_rope(original: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, position_ids: Any = None,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`original` (HF's rotate-half apply_rotary_pos_emb) as two native rope calls: HF's
    runs 14 torch ops a layer (two rotate_halfs' slices, negations and cats, four
    multiplies, two adds: 50 us, 1.5 ms of a SmolLM2 bf16 decode step here). q/k
    [1, heads, T, D] -> the same shapes, each a view of a contiguous [T, heads, D], which
    _paged_attention then takes without a copy. What this does not cover goes to
    `original`: a call outside our forward, another layout, or cos/sin whose two halves
    differ (then they are not rotate-half's cat(freqs, freqs))."""
    step = _STEP.get()
    tables = None
    if (step is not None and unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4
            and q.shape[0] == 1 and cos.dim() == 3 and cos.shape[0] == 1
            and cos.shape == sin.shape and q.shape[-1] == k.shape[-1] == cos.shape[-1]
            and q.shape[-1] % 2 == 0 and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.device.type == "cpu"):
        tables = _rope_tables(step, cos, sin)
    if tables is None:
        return original(q, k, cos, sin, position_ids, unsqueeze_dim)
    return _rotate(q, tables), _rotate(k, tables)


def _rope_tables(step: _Step, cos: torch.Tensor, sin: torch.Tensor) -> tuple | None:
    cached = step.rope_tables.get(id(cos))
    if cached is not None and cached[0] is cos and cached[1] is sin:
        return cached[2]
    half = cos.shape[-1] // 2
    cos_half, sin_half = cos[0, :, :half], sin[0, :, :half]
    tables = None
    if torch.equal(cos_half, cos[0, :, half:]) and torch.equal(sin_half, sin[0, :, half:]):
        # The native kernel looks rows up by position in its tables: this step's rows are
        # the tables, so token i's position is i.
        tables = (cos_half.contiguous(), sin_half.contiguous(),
                  torch.arange(cos.shape[1], dtype=torch.int64))
    step.rope_tables[id(cos)] = (cos, sin, tables)  # holds cos: its id stays its own
    return tables


def _rotate(x: torch.Tensor, tables: tuple) -> torch.Tensor:
    cos_table, sin_table, positions = tables
    _, heads, tokens, dim = x.shape
    # [1, heads, T, D] is HF's view of the projection's [1, T, heads * D]: rows again.
    rows = x[0].transpose(0, 1).reshape(tokens, heads * dim)
    out = dispatch.rope(rows, heads, dim, dim // 2, positions, cos_table, sin_table,
                        cos_table.unsqueeze(1), sin_table.unsqueeze(1))
    return out.unsqueeze(0).transpose(1, 2)


def _rope_probe_passes(original: Any, dtype: torch.dtype) -> bool:
    """Whether _native_rope gives what `original` gives on random q/k (as HF lays them
    out: a transposed view, GQA head counts) and rotate-half cos/sin, inside a step."""
    gen = torch.Generator().manual_seed(0)
    tokens, dim = 3, 8
    q = torch.randn(1, tokens, 4 * dim, generator=gen).to(dtype).view(1, tokens, 4, dim)
    k = torch.randn(1, tokens, 2 * dim, generator=gen).to(dtype).view(1, tokens, 2, dim)
    angles = torch.rand(1, tokens, dim // 2, generator=gen) * 6.0
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    try:
        expected = original(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - another signature: HF's own stays
        return False
    token = _STEP.set(_Step([], [], [], "probe"))
    try:
        got = _native_rope(original, q, k, cos, sin)
    finally:
        _STEP.reset(token)
    # bf16: HF rounds each product and the sum, the kernel once; a wrong rotation (an
    # interleaved or partial one) is off by the values' own size.
    slack = 2.0 ** -5 if dtype == torch.bfloat16 else 1e-5
    return all(g.shape == e.shape and g.dtype == e.dtype and torch.allclose(
        g.float(), e.float(), rtol=0, atol=slack * float(e.abs().max()))
        for g, e in zip(got, expected))


def _with_global(fn: Any, name: str, value: Any) -> Any:
    """A copy of the function `fn` whose global `name` is `value` (fn's module is not
    touched), decorators kept: each functools.wraps wrapper is copied around the copy
    below it. None where fn is not built that way or does not read the global."""
    if not isinstance(fn, types.FunctionType):
        return None
    wrapped = getattr(fn, "__wrapped__", None)
    cells = fn.__closure__ or ()
    globals_ = fn.__globals__
    if wrapped is None:
        if name not in fn.__code__.co_names:
            return None
        globals_ = {**globals_, name: value}
        inner = None
    else:
        inner = _with_global(wrapped, name, value)
        holding = [i for i, c in enumerate(cells) if _cell_value(c) is wrapped]
        if inner is None or len(holding) != 1:
            return None
        cells = tuple(types.CellType(inner) if i == holding[0] else c
                      for i, c in enumerate(cells))
    copy_ = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, cells)
    copy_.__kwdefaults__ = fn.__kwdefaults__
    copy_.__dict__.update(fn.__dict__)
    copy_.__qualname__ = fn.__qualname__
    if inner is not None:
        copy_.__wrapped__ = inner
    return copy_


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _innermost(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _preparable(module: nn.Module) -> bool:
    # Exact type: subclasses (quantized or BitNet linears) compute something else. A GPU
    # runs torch's linear as HF does.
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype in (torch.float32, torch.bfloat16))


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """What stays in a prepacked layer's `weight`: its shape, dtype and device (HF code
    reads those, e.g. to cast inputs) over one NaN element, so a stray read of the values
    poisons the result instead of passing for the weights."""
    return torch.full((), float("nan"), dtype=weight.dtype, device=weight.device).expand(
        weight.shape)


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
        step = _Step(kv_caches, per_layer(attn_metadata, self.num_layers), self.windows,
                     self.architecture)
        token = _STEP.set(step)
        try:
            out = self.base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                            use_cache=False)
        finally:
            _STEP.reset(token)
        return out[0][0]  # last_hidden_state [1, T, hidden] -> [T, hidden], final norm applied

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, vocab] logits, float32 unless `upcast` is False, as the HF model's forward
        computes them from its last hidden states."""
        logits = self._head(inputs_embeds=hidden.unsqueeze(0), use_cache=False).logits[0]
        return logits.float() if upcast else logits

    def prepack(self, batch_invariant: bool = False) -> None:
        """Hand every plain nn.Linear's weight on the CPU to kernels.dispatch, as the native
        model's layers do (oneDNN's blocked copy, or the native GEMM's panels): the
        matmuls are most of a step, and the panels ran SmolLM2's decode steps 1.7-1.8x
        torch's bf16 linear here (AMX host). Where the panels are then the only copy, the
        dense weight is dropped (see _placeholder). Siblings HF calls on one input run as
        one stacked matmul (_SharedInputLinears), and norms and RoPE run the native
        kernels where a probe shows them computing what HF's code does (_native_norm,
        _native_rope). batch_invariant is refused: HF's activations are torch's, not the
        batch-invariant kernels."""
        if batch_invariant:
            raise ValueError(f"batch_invariant: not available on the general path "
                             f"({self.architecture} runs transformers' layers, whose norms "
                             "and activations are torch's, not the batch-invariant kernels)")
        if self._prepacked:
            return  # the packed copies are the weights now; packing again would read placeholders
        self._prepacked = True
        uses: dict[int, int] = {}
        for module in self.hf.modules():
            for param in module.parameters(recurse=False):
                uses[id(param)] = uses.get(id(param), 0) + 1
        linears = [m for m in self.hf.modules() if _preparable(m)]
        grouped: set[nn.Linear] = set()
        for members in self._shared_input_groups(linears):
            weight = torch.cat([m.weight for m in members])
            bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
            ends = torch.tensor([m.out_features for m in members]).cumsum(0).tolist()
            group = _SharedInputLinears(dispatch.prepare_linear(weight, bias),
                                        list(zip([0, *ends[:-1]], ends)))
            for index, module in enumerate(members):
                # An instance attribute: nn.Module.__call__ finds it before the class's forward.
                module.forward = functools.partial(group.forward, index)
            grouped.update(members)
        for module in linears:
            weight = module.weight
            if module in grouped:
                if uses[id(weight)] == 1:  # the stacked copy is the weights now
                    module.weight = nn.Parameter(_placeholder(weight), requires_grad=False)
                continue
            prepared = dispatch.prepare_linear(weight, module.bias)
            module.forward = functools.partial(_prepared_linear, prepared)
            if prepared.dense is None and uses[id(weight)] == 1:
                module.weight = nn.Parameter(_placeholder(weight), requires_grad=False)
        for module in self.hf.modules():
            forward = _native_norm(module)
            if forward is not None:
                module.forward = forward
        self._use_native_rope()

    def _shared_input_groups(self, linears: list[nn.Linear]) -> list[list[nn.Linear]]:
        """Siblings among `linears` (children of one module, same in_features, all with a
        bias or none) that one traced forward called once each on the same tensor: what
        HF's code does, read from a run rather than from the architecture's names."""
        inputs: dict[nn.Linear, list[torch.Tensor]] = {}
        hooks = [m.register_forward_pre_hook(
            lambda module, args: inputs.setdefault(module, []).append(args[0]))
            for m in linears]
        token = _STEP.set(_Step([], [], self.windows, self.architecture, tracing=True))
        try:
            with torch.inference_mode():
                self.base(input_ids=torch.zeros(1, 2, dtype=torch.long),
                          position_ids=torch.arange(2).unsqueeze(0), use_cache=False)
        except Exception as e:  # noqa: BLE001 - no stacking then; the real forward decides
            logger.info("general path: %s's trace forward failed (%s); its linears run "
                        "one call each", self.architecture, e)
            return []
        finally:
            _STEP.reset(token)
            for hook in hooks:
                hook.remove()
        groups = []
        for parent in self.hf.modules():
            by_input: dict[tuple, list[nn.Linear]] = {}
            for child in parent.children():
                seen = inputs.get(child)
                if seen is not None and len(seen) == 1:
                    key = (id(seen[0]), child.in_features, child.bias is None)
                    by_input.setdefault(key, []).append(child)
            groups += [members for members in by_input.values() if len(members) > 1]
        return groups

    def _use_native_rope(self) -> None:
        # Per attention class: the forward's copy that calls _native_rope, if the probe
        # says it computes what HF's function does; bound to each instance, so HF's
        # module and every other model of the class are left as they are.
        forwards: dict[type, Any] = {}
        for module in self.hf.modules():
            if not (hasattr(module, "is_causal") and hasattr(module, "layer_idx")):
                continue
            cls = type(module)
            if cls not in forwards:
                forwards[cls] = None
                original = _innermost(cls.forward).__globals__.get(_ROPE_FUNCTION)
                if original is not None and _rope_probe_passes(original, self.dtype):
                    forwards[cls] = _with_global(cls.forward, _ROPE_FUNCTION,
                                                 functools.partial(_native_rope, original))
            if forwards[cls] is not None:
                module.forward = types.MethodType(forwards[cls], module)

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
