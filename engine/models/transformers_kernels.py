"""Which of HF's modules the general path (transformers_backend.py) runs on our kernels
instead of transformers' torch code, and how each swap is shown equal at load. Nothing is
matched by class or architecture name: a module is swapped where the loaded model itself
shows the kernel computing what HF's code does (an exact nn.Linear, the calls of one
traced forward, a probe's output), and HF's code stays everywhere else.

- plain nn.Linear: its weight handed to kernels.dispatch.prepare_linear (_preparable);
- sibling Linears one traced forward calls on the same tensor (q/k/v, gate/up): one
  stacked matmul (_shared_input_groups, _SharedInputLinears);
- RMSNorm-like leaves: one native norm kernel where its output on probe rows matches
  (_native_norm);
- the attention classes' apply_rotary_pos_emb: the native rope, where a probe matches
  (_use_native_rope, _native_rope).

The rope and the trace forward read the step in progress (transformers_step.CURRENT_STEP).

Over 300 lines: three swaps, each with the probe that proves it, behind one prepack."""
from __future__ import annotations

import functools
import logging
import types
from typing import Any

import torch
from torch import nn

from engine.models.transformers_step import CURRENT_STEP, Step
from kernels import dispatch

logger = logging.getLogger(__name__)


def prepack(model: nn.Module) -> None:
    """Swap `model`'s HF modules onto our kernels, once, after its weights are loaded
    (TransformersForCausalLM.prepack). A linear whose prepared copy (the native GEMM's
    panels, or a stacked group's) is then the only one has its dense weight dropped (see
    _placeholder); a weight another module shares stays."""
    hf = model.hf
    uses: dict[int, int] = {}
    for module in hf.modules():
        for param in module.parameters(recurse=False):
            uses[id(param)] = uses.get(id(param), 0) + 1
    linears = [m for m in hf.modules() if _preparable(m)]
    grouped: set[nn.Linear] = set()
    for members in _shared_input_groups(model, linears):
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
    for module in hf.modules():
        forward = _native_norm(module)
        if forward is not None:
            module.forward = forward
    _use_native_rope(model)


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


def _shared_input_groups(model: nn.Module,
                         linears: list[nn.Linear]) -> list[list[nn.Linear]]:
    """Siblings among `linears` (children of one module, same in_features, all with a
    bias or none) that one traced forward called once each on the same tensor: what
    HF's code does, read from a run rather than from the architecture's names."""
    inputs: dict[nn.Linear, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(
        lambda module, args: inputs.setdefault(module, []).append(args[0]))
        for m in linears]
    token = CURRENT_STEP.set(Step([], [], model.windows, model.architecture, tracing=True))
    try:
        with torch.inference_mode():
            model.base(input_ids=torch.zeros(1, 2, dtype=torch.long),
                       position_ids=torch.arange(2).unsqueeze(0), use_cache=False)
    except Exception as e:  # noqa: BLE001 - no stacking then; the real forward decides
        logger.info("general path: %s's trace forward failed (%s); its linears run "
                    "one call each", model.architecture, e)
        return []
    finally:
        CURRENT_STEP.reset(token)
        for hook in hooks:
            hook.remove()
    groups = []
    for parent in model.hf.modules():
        by_input: dict[tuple, list[nn.Linear]] = {}
        for child in parent.children():
            seen = inputs.get(child)
            if seen is not None and len(seen) == 1:
                key = (id(seen[0]), child.in_features, child.bias is None)
                by_input.setdefault(key, []).append(child)
        groups += [members for members in by_input.values() if len(members) > 1]
    return groups


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


def _use_native_rope(model: nn.Module) -> None:
    # Per attention class: the forward's copy that calls _native_rope, if the probe
    # says it computes what HF's function does; bound to each instance, so HF's
    # module and every other model of the class are left as they are.
    forwards: dict[type, Any] = {}
    for module in model.hf.modules():
        if not (hasattr(module, "is_causal") and hasattr(module, "layer_idx")):
            continue
        cls = type(module)
        if cls not in forwards:
            forwards[cls] = None
            original = _innermost(cls.forward).__globals__.get(_ROPE_FUNCTION)
            if original is not None and _rope_probe_passes(original, model.dtype):
                forwards[cls] = _with_global(cls.forward, _ROPE_FUNCTION,
                                             functools.partial(_native_rope, original))
        if forwards[cls] is not None:
            module.forward = types.MethodType(forwards[cls], module)


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
    step = CURRENT_STEP.get()
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


def _rope_tables(step: Step, cos: torch.Tensor, sin: torch.Tensor) -> tuple | None:
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
    token = CURRENT_STEP.set(Step([], [], [], "probe"))
    try:
        got = _native_rope(original, q, k, cos, sin)
    finally:
        CURRENT_STEP.reset(token)
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
