"""Our paged-attention decoder vs HF transformers on tiny random Llama / Qwen2 models:
mixed prefill / chunked-prefill / decode batches through the paged cache."""
from __future__ import annotations

import pytest
import torch

from engine.models import load_model
from testing.tiny_model import make_tiny_model_dir
from testing.model_batch import (PagedBatchBuilder, check_mixed_batches_match_hf, hf_logits,
                                  run_chunks)
from testing.hf_reference import hf_causal_lm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny(request, tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch=request.param)
    hf = hf_causal_lm(path, torch.float32)
    return load_model(path, torch.float32), hf


def test_mixed_batch_matches_hf(tiny):
    check_mixed_batches_match_hf(*tiny)


def test_logits_only_for_selected_rows(tiny):
    loaded, hf = tiny
    toks = list(range(500, 511))
    builder = PagedBatchBuilder(block_size=8, num_blocks=4)
    kv = builder.new_kv_caches(loaded, torch.float32)
    ids, positions, meta = builder.build([("S", toks, 0)])
    with torch.inference_mode():
        hidden = loaded.model(ids, positions, kv, meta)
        last = loaded.model.compute_logits(hidden[-1:])
    assert last.shape == (1, loaded.vocab_size)
    torch.testing.assert_close(last[0], hf_logits(hf, toks)[-1], atol=1e-4, rtol=1e-4)


def test_bf16_tracks_hf_bf16(tiny):
    _, hf_fp32 = tiny
    path = hf_fp32.name_or_path
    loaded = load_model(path, torch.bfloat16)
    hf = hf_causal_lm(path, torch.bfloat16)
    toks = list(range(1000, 1012))
    builder = PagedBatchBuilder(block_size=4, num_blocks=8)
    kv = builder.new_kv_caches(loaded, torch.bfloat16)
    assert kv[0][0].dtype == loaded.dtype == torch.bfloat16
    logits = run_chunks(loaded, kv, builder, [("S", toks, 0)])
    expected = hf_logits(hf, toks)
    # Different but equally valid bf16 roundings (attention kernels differ); logits
    # here span about +-2.
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0.05)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
