"""The fused single-sequence decode step (engine/models/single_decode.py) on the layers
beyond Llama's that it runs: Qwen3's per-head q/k norms and sliding windows (Mistral,
Phi-3, windowed Qwen3). Each step is checked against the layer-by-layer path to the bit:
the hidden state and every K/V written, float32 and bf16, dense and GGUF-quantized
weights, contexts past the window with the blocks behind it NaN-filled placeholders that
neither path may read. Gemma keeps the layer-by-layer path (its norms and GeGLU are
torch ops the C step does not reproduce), which the last test pins."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from engine.models import load_model
from engine.models import single_decode
from engine.models.layers import Linear
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
    window = windows[0]
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


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_keeps_the_layer_path(arch, tmp_path):
    loaded = load_model(make_tiny_model_dir(tmp_path, arch=arch, seed=5), torch.float32)
    kv = PagedBatchBuilder(block_size=BLOCK, num_blocks=8).new_kv_caches(loaded, torch.float32)
    assert single_decode.build_plan(loaded.model.model, kv) is None
