"""quantization="gguf": the default model's Q4_1/Q8_0 tensors served in their blocks.
Loads the real SmolLM2 GGUF, so marked slow."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models import load_model
from engine.models.gguf_cache import default_gguf_path
from engine.models.gguf_weights import read_quantized
from engine.models.layers import Linear
from kernels import dispatch
from testing.tiny_model import make_tiny_model_dir
from testing.model_batch import last_logits

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The capital of France is", "Here is a recipe for pancakes:", "def fibonacci(n):",
           "Once upon a time, in a small village,", "List three colours:", "Water boils at"]


@pytest.fixture(scope="module")
def dense():
    return load_model(None, torch.float32)


@pytest.fixture(scope="module")
def quantized_llm():
    return LLM(None, dtype="float32", quantization="gguf", num_kv_blocks=256, max_num_seqs=8,
               max_model_len=1024)


@pytest.mark.slow
def test_quantized_tables_hold_exactly_the_files_values(dense):
    """Every table (fused q/k/v with the file's q/k row order undone, fused gate/up, the
    tied Q8_0 embedding as lm_head too) dequantizes to what transformers loaded."""
    net = dense.model
    tables = read_quantized(default_gguf_path(), net)
    assert len(tables) == 30 * 4 + 2
    assert tables["lm_head"] is tables["model.embed_tokens"]
    assert {t.type_name for t in tables.values()} == {"Q4_1", "Q8_0"}
    modules = dict(net.named_modules())
    for name, table in tables.items():
        if name in ("lm_head", "model.embed_tokens"):
            expected = net.model.embed_tokens.weight
        else:
            expected = modules[name].dense_weight()
        assert torch.equal(table.dequantize(), expected.float()), name


@pytest.mark.slow
def test_quantized_model_drops_dense_weights_and_stays_close(dense, quantized_llm):
    loaded = quantized_llm.llm_engine.loaded
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.prepared.kind == "gguf" for m in linears)
    assert loaded.model.lm_head_weight is None and loaded.model.model.embed_tokens.weight is None
    # The tied Q8_0 table is held once, in the layout this host serves (VNNI panels or rows):
    # the embedding lookup reads what lm_head multiplies.
    table = loaded.model.model.embed_quantized
    assert table is loaded.model.lm_head_prepared.quantized
    assert dispatch.prepare_gguf(table) is table
    assert all(m.prepared.quantized.layout == table.layout for m in linears)
    tok = quantized_llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        expected = last_logits(dense, ids)
        got = last_logits(loaded, ids)
        # int8 activations per 32-block (as llama.cpp computes Q4_1 x Q8_1) through 30
        # layers: 3-5% of the largest logit at most on these prompts (llama.cpp on the
        # same file: 2-4%); offsets against the exact x sums made it 6-13%
        assert float((got - expected).abs().max()) < 0.08 * float(expected.abs().max()), prompt
        assert int(got.argmax()) in expected.topk(3).indices.tolist(), prompt


@pytest.mark.slow
def test_quantized_batches_agree_with_requests_run_alone(quantized_llm):
    """Batched rows (prefill chunks, decode batches) take the kernel's 4-row tiles, a
    request alone the 1-row path: the same products summed in another order, so only
    near-ties may flip a greedy choice (kernel-level exactness: tests/kernels/cpu/test_linear.py)."""
    tok = quantized_llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in quantized_llm.generate(ids, params, use_tqdm=False)]
    alone = [quantized_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in ids]
    assert [t[:3] for t in together] == [a[:3] for a in alone]
    same = sum(x == y for t, a in zip(together, alone) for x, y in zip(t, a))
    assert same >= 0.75 * 16 * len(PROMPTS)


def test_quantization_needs_a_gguf_model_and_a_known_name(tmp_path):
    tiny = make_tiny_model_dir(tmp_path, arch="llama", seed=1)
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf model"):
        load_model(str(tiny), torch.float32, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="awq")
    assert EngineConfig.from_dict({"quantization": "gguf"}).quantization == "gguf"


@pytest.mark.slow
def test_cached_tables_equal_a_fresh_read(dense):
    from engine.models.gguf_cache import converted_dir_for
    from engine.models.gguf_weights import _CACHE_FILE, load_quantized
    fresh = read_quantized(default_gguf_path(), dense.model)
    load_quantized(default_gguf_path(), dense.model)  # writes the cache if absent
    assert (converted_dir_for(default_gguf_path()) / _CACHE_FILE).is_file()
    cached = load_quantized(default_gguf_path(), dense.model)
    assert cached.keys() == fresh.keys()
    assert cached["lm_head"] is cached["model.embed_tokens"]
    for name, table in fresh.items():
        other = cached[name]
        assert (other.type_name, other.in_features) == (table.type_name, table.in_features)
        assert torch.equal(other.qs, table.qs) and torch.equal(other.d, table.d), name
        assert (other.offset is None) == (table.offset is None)
        assert other.offset is None or torch.equal(other.offset, table.offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_row_order_is_found_when_the_dense_copy_was_rounded_to_bf16(dtype, type_name):
    # dtype auto is bf16 on AVX-512 BF16 / AMX hosts: the dense weights the order is
    # checked against are rounded, which a fixed 1e-3 of the largest weight did not
    # allow for in a Q4_0 file of random weights (Llama-3.2-1B's shape, AMX host).
    from engine.models.gguf_weights import _head_rows_order, _matching_order
    from testing.gguf_weights import gguf_weight

    heads, head_dim, k = 4, 16, 64
    weight, values = gguf_weight(type_name, heads * head_dim, k, seed=3)
    assert _matching_order(weight, values.to(dtype), heads, "q") is weight
    order = _head_rows_order(heads, heads * head_dim)
    inverse = torch.argsort(order)
    permuted_file = weight.select_rows(inverse)  # a file in the other row order
    found = _matching_order(permuted_file, values.to(dtype), heads, "q")
    assert torch.equal(found.dequantize(), weight.dequantize())
    with pytest.raises(ValueError, match="matches neither row order"):
        _matching_order(weight, torch.randn(heads * head_dim, k).to(dtype), heads, "q")
