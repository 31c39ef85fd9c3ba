"""The fused single-sequence decode step (engine/models/single_decode.py) on the layers
beyond Llama's that it runs: Qwen3's per-head q/k norms, sliding windows (Mistral,
Phi-3, windowed Qwen3) and Gemma's layer (Gemma 2's logit soft cap, Gemma 3's q/k norms
and local RoPE, head_dim 256). Each step is checked against the layer-by-layer path to the
bit: the hidden state and every K/V written, float32 and bf16, dense and GGUF-quantized
weights, contexts past the window with the blocks behind it NaN-filled placeholders that
neither path may read. Then hybrid KV layouts, windowed and full layers each with their
own block table (per-layer metadata), which must take the fused step too; and Gemma's
native norm and GeGLU kernels, which both paths run, against HF's torch ops."""
from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from engine.models import load_model
from engine.models.layers import Linear
from kernels import torch_ops
from kernels.cpu import native as cpu_native
from kernels.gguf_weight import GgufWeight
from testing.model_batch import PagedBatchBuilder
from testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.skipif(cpu_native.load_library() is None,
                                reason="the fused step is a native kernel; no C compiler here")

WINDOW = 12
# name -> (tiny_model arch, config overrides, each layer's expected window)
FAMILIES = {
    "qwen3": ("qwen3", {}, [None, None]),
    "qwen3-window": ("qwen3", dict(sliding_window=WINDOW, use_sliding_window=True,
                                   max_window_layers=0), [WINDOW, WINDOW]),
    "mistral-window": ("mistral-window", {}, [WINDOW, WINDOW]),
    "phi3-window": ("phi3", dict(sliding_window=WINDOW), [WINDOW, WINDOW]),
    # Windowed and full layers over one block table: nothing behind a window is freed.
    "gemma2": ("gemma2", {}, [10, None]),
    "gemma2-hd256": ("gemma2", dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                                    query_pre_attn_scalar=256), [10, None]),
    "gemma3": ("gemma3", {}, [10, None, 10]),
}
BLOCK = 4
PROMPT_LEN = 21   # past the window already, so the first decode has blocks behind it
DECODE_STEPS = 8


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    arch, overrides, windows = FAMILIES[request.param]
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch=arch, seed=5,
                               **overrides)
    return request.param, path, windows


def _quantize_layers(loaded, type_name: str) -> None:
    """Every decoder layer's matmul as GGUF blocks of its own (dense) weights."""
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    weights = {}
    for name, module in loaded.model.named_modules():
        if isinstance(module, Linear) and ".layers." in name:
            module.unpack()  # bf16 packing may have dropped the dense parameter
            dense = module.dense_weight().float().numpy()
            blocks = quants.quantize(dense, qtype)
            weights[name] = GgufWeight.from_blocks(type_name, torch.from_numpy(blocks.copy()),
                                                   dense.shape[1])
    loaded.model.quantize(weights)


def _hide_blocks_behind_window(kv, table: list[int], seq_len: int, window: int | None,
                               placeholder: int) -> torch.Tensor:
    """The block table for a decode at seq_len with each block wholly behind the window
    replaced by `placeholder`, and those blocks NaN in every layer's cache (the KV
    manager frees them and points the table at a placeholder)."""
    table = list(table)
    if window is not None:
        first_seen = seq_len - window  # the first key position the decode row sees
        for b in range(len(table)):
            if (b + 1) * BLOCK <= first_seen:
                for key_cache, value_cache in kv:
                    key_cache[table[b]] = float("nan")
                    value_cache[table[b]] = float("nan")
                table[b] = placeholder
    return torch.tensor([table], dtype=torch.int32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # NaN placeholders compare unequal to themselves: compare the caches' bytes.
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _decode(model, kv, token: int, position: int, table: torch.Tensor, fused: bool):
    from engine.models import AttentionMetadata

    slot = int(table[0, position // BLOCK]) * BLOCK + position % BLOCK
    meta = AttentionMetadata(slot_mapping=torch.tensor([slot]), block_tables=table,
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                             seq_lens=torch.tensor([position + 1], dtype=torch.int32),
                             max_query_len=1, max_seq_len=position + 1)
    model.model.fused_single_decode = fused
    with torch.inference_mode():
        return model(torch.tensor([token]), torch.tensor([position]), kv, meta)


@pytest.mark.parametrize("weights", ["dense", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_is_bit_equal_to_the_layer_path(family_dir, dtype, weights):
    name, path, windows = family_dir
    loaded = load_model(path, dtype)
    if weights != "dense":
        _quantize_layers(loaded, weights)
    model = loaded.model
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == windows
    # One table for every layer: blocks are freed behind a window only if all layers have it.
    window = windows[0] if len(set(windows)) == 1 else None
    builder = PagedBatchBuilder(block_size=BLOCK, num_blocks=24)
    kv = builder.new_kv_caches(loaded, dtype)
    placeholder = builder._next_free.pop()  # never a sequence's block
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 1000, (PROMPT_LEN,), generator=gen).tolist()
    ids, positions, meta = builder.build([("S", prompt, 0)])
    with torch.inference_mode():
        hidden = model(ids, positions, kv, meta)[-1:]
    token = int(model.compute_logits(hidden).argmax())
    for step in range(DECODE_STEPS):
        position = PROMPT_LEN + step
        builder.build([("S", [token], position)])  # grows the sequence's table as needed
        table = _hide_blocks_behind_window(kv, builder.block_tables["S"], position + 1, window,
                                           placeholder)
        for key_cache, value_cache in kv:
            key_cache[placeholder] = float("nan")
            value_cache[placeholder] = float("nan")
        layered_kv = [(k.clone(), v.clone()) for k, v in kv]
        layered = _decode(model, layered_kv, token, position, table, fused=False)
        fused = _decode(model, kv, token, position, table, fused=True)
        assert model.model._single_plan[1] is not None, "the fused step did not plan"
        assert torch.isfinite(fused).all()
        assert torch.equal(fused, layered), f"{name} step {step}"
        for (k, v), (k_ref, v_ref) in zip(kv, layered_kv):
            assert torch.equal(_bits(k), _bits(k_ref)) and torch.equal(_bits(v), _bits(v_ref))
        token = int(model.compute_logits(fused).argmax())


# name -> (tiny_model arch, config overrides): windowed and full layers side by side.
HYBRID = {
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    # Qwen's layers from max_window_layers on are windowed.
    "qwen3-hybrid": ("qwen3", dict(sliding_window=WINDOW, use_sliding_window=True,
                                   max_window_layers=1)),
}


class _GroupedKV:
    """The KV manager's hybrid layout for one sequence: the full layers' blocks and the
    windowed layers' blocks from pools of their own (different sizes, so the blocks and
    slots of the two groups differ), each with its own block table, and so one metadata
    per group, handed to every layer of that group."""

    def __init__(self, loaded, dtype) -> None:
        self.windows = loaded.sliding_windows
        self.builders = {False: PagedBatchBuilder(block_size=BLOCK, num_blocks=24),
                         True: PagedBatchBuilder(block_size=BLOCK, num_blocks=31)}
        caches = {g: b.new_kv_caches(loaded, dtype) for g, b in self.builders.items()}
        self.kv = [caches[w is not None][i] for i, w in enumerate(self.windows)]
        self.placeholder = self.builders[True]._next_free.pop()  # never a sequence's block

    def build(self, tokens: list[int], position: int):
        built = {g: b.build([("S", tokens, position)]) for g, b in self.builders.items()}
        ids, positions, _ = built[False]
        return ids, positions, [built[w is not None][2] for w in self.windows]

    def hide_behind_window(self, metas: list, seq_len: int) -> list:
        """The windowed group's table with its blocks wholly behind the window pointing at
        a NaN placeholder, and those blocks NaN in the windowed layers' caches (the KV
        manager frees them); the full group's table as it is."""
        windowed = [(kv, w) for kv, w in zip(self.kv, self.windows) if w is not None]
        window = windowed[0][1]
        table = _hide_blocks_behind_window([kv for kv, _ in windowed],
                                           self.builders[True].block_tables["S"], seq_len,
                                           window, self.placeholder)
        for (key_cache, value_cache), _ in windowed:
            key_cache[self.placeholder] = float("nan")
            value_cache[self.placeholder] = float("nan")
        hidden = {}
        for meta, w in zip(metas, self.windows):
            if w is not None and id(meta) not in hidden:
                hidden[id(meta)] = dataclasses.replace(meta, block_tables=table)
        return [hidden.get(id(meta), meta) for meta in metas]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_kv_groups_take_the_fused_step(name, dtype, tmp_path, fused_steps):
    arch, overrides = HYBRID[name]
    loaded = load_model(make_tiny_model_dir(tmp_path, arch=arch, seed=5, **overrides), dtype)
    model = loaded.model
    assert None in loaded.sliding_windows and any(loaded.sliding_windows)  # hybrid
    grouped = _GroupedKV(loaded, dtype)
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 1000, (PROMPT_LEN,), generator=gen).tolist()
    ids, positions, metas = grouped.build(prompt, 0)
    with torch.inference_mode():
        hidden = model(ids, positions, grouped.kv, metas)[-1:]
    token = int(model.compute_logits(hidden).argmax())
    for step in range(DECODE_STEPS):
        position = PROMPT_LEN + step
        ids, positions, metas = grouped.build([token], position)
        metas = grouped.hide_behind_window(metas, position + 1)
        layered_kv = [(k.clone(), v.clone()) for k, v in grouped.kv]
        model.model.fused_single_decode = False
        with torch.inference_mode():
            layered = model(ids, positions, layered_kv, metas)
        model.model.fused_single_decode = True
        fused_steps.clear()
        with torch.inference_mode():
            fused = model(ids, positions, grouped.kv, metas)
        assert len(fused_steps) == 1 and fused_steps[0][1] is not None, \
            "the fused step did not run"
        assert torch.isfinite(fused).all()
        assert torch.equal(fused, layered), f"{name} step {step}"
        for (k, v), (k_ref, v_ref) in zip(grouped.kv, layered_kv):
            assert torch.equal(_bits(k), _bits(k_ref)) and torch.equal(_bits(v), _bits(v_ref))
        token = int(model.compute_logits(fused).argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_kernels_track_hf_torch_ops(dtype):
    """The native (1 + w) norm and GeGLU the layer path and the fused step share, against
    HF's torch op sequences (kernels/torch_ops.py): the norm to the order of a float32
    sum (bf16: within one rounding), GELU's tanh as exp (cancellation in torch's 1 + tanh
    makes its far negative tail the less accurate one, so that tail is bounded
    absolutely)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 1152, generator=gen).to(dtype)
    residual = (4 * torch.randn(3, 1152, generator=gen)).to(dtype)
    weight = (0.5 * torch.randn(1152, generator=gen)).to(dtype)
    ours_residual, ref_residual = residual.clone(), residual.clone()
    ours = cpu_native.gemma_rms_norm(x, ours_residual, weight, 1e-6)
    ref = torch_ops.gemma_rms_norm(x, ref_residual, weight, 1e-6)
    assert torch.equal(ours_residual, ref_residual)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(ours, ref, **tol)
    gate_up = (3 * torch.randn(2, 2 * 1000, generator=gen)).to(dtype)
    gate_up[0, :8] = torch.tensor([-1e4, -20., -9., 0., 1e-3, 9., 20., 1e4])
    ours, ref = cpu_native.gelu_tanh_mul(gate_up), torch_ops.gelu_tanh_mul(gate_up)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=2 ** -7)
    torch.testing.assert_close(ours, ref, **tol)
