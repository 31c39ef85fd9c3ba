"""The fused single-sequence step's rows form (kernels/cpu/decode_step.c): a step of T
tokens at consecutive positions (a speculative verification: the last token and its
drafts) gives, row for row, the bits the one-row fused step gives for each token decoded
one at a time, and writes the same K/V: every kernel computes a row as it computes a lone
row (GGUF blocks through linear_gguf_rows). Float32 and bf16; dense rows, GEMM panels and
GGUF Q8_0 / Q4_0 blocks; Llama, Qwen3's q/k norms, Mistral's window (blocks behind it NaN
placeholders), Gemma 2's soft cap and Gemma 3's local RoPE. Then the engine: greedy
speculative decoding of one stream gives plain decoding's tokens exactly, its
verifications through the fused step."""
from __future__ import annotations

import gguf
import pytest
import torch
from gguf import quants

from engine import LLM, SamplingParams
from engine.models import AttentionMetadata, load_model
from engine.models.layers import Linear
from kernels.cpu import decode_step as cpu_decode_step
from kernels.cpu import native as cpu_native
from kernels.gguf_weight import GgufWeight
from testing.model_batch import PagedBatchBuilder
from testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.skipif(cpu_native.load_library() is None,
                                reason="the fused step is a native kernel; no C compiler here")

# name -> (tiny_model arch, config overrides, one window for every layer or None)
FAMILIES = {
    "llama": ("llama", {}, None),
    "qwen3": ("qwen3", {}, None),
    "mistral-window": ("mistral-window", {}, 12),
    "gemma2": ("gemma2", {}, None),
    "gemma3": ("gemma3", {}, None),
}
BLOCK = 4
PROMPT_LEN = 21
# Steps of these many rows, one after another (9: a token and 8 drafts).
ROWS = (9, 1, 4, 2)
_PANELS = {-3, -4}


def _set_weights(model, weights: str) -> None:
    for name, module in model.named_modules():
        if not (isinstance(module, Linear) and ".layers." in name):
            continue
        module.unpack()
        if weights == "dense":
            module.prepared = None
        elif weights == "panels":  # float32 ones only under batch_invariant
            module.prepack(batch_invariant=module.weight.dtype == torch.float32)
        else:
            qtype = getattr(gguf.GGMLQuantizationType, weights)
            dense = module.dense_weight().float().numpy()
            blocks = quants.quantize(dense, qtype)
            module.quantize(GgufWeight.from_blocks(weights, torch.from_numpy(blocks.copy()),
                                                   dense.shape[1]))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _step(model, kv, tokens: list[int], position: int, table: torch.Tensor) -> torch.Tensor:
    rows = len(tokens)
    positions = torch.arange(position, position + rows)
    slots = torch.tensor([int(table[0, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=table,
                             query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
                             seq_lens=torch.tensor([position + rows], dtype=torch.int32),
                             max_query_len=rows, max_seq_len=position + rows)
    with torch.inference_mode():
        return model(torch.tensor(tokens), positions, kv, meta)


def _hide(kv, table: list[int], first_seen: int, placeholder: int) -> torch.Tensor:
    """Blocks wholly before key position first_seen: NaN in every cache, the table naming
    the placeholder (the KV manager frees them)."""
    table = list(table)
    for b in range(len(table)):
        if (b + 1) * BLOCK <= first_seen:
            for key_cache, value_cache in kv:
                key_cache[table[b]] = float("nan")
                value_cache[table[b]] = float("nan")
            table[b] = placeholder
    return torch.tensor([table], dtype=torch.int32)


@pytest.mark.parametrize("weights", ["dense", "panels", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_rows_are_bit_equal_to_one_row_steps(name, dtype, weights, tmp_path, monkeypatch,
                                             fused_steps):
    arch, overrides, window = FAMILIES[name]
    # bf16 panels on AMX hosts cap the rows for speed, not exactness: test them all.
    monkeypatch.setattr(cpu_decode_step, "AMX_PANEL_ROWS", cpu_decode_step.MAX_ROWS)
    loaded = load_model(make_tiny_model_dir(tmp_path, arch=arch, seed=5, **overrides), dtype)
    _set_weights(loaded.model, weights)
    model = loaded.model
    builder = PagedBatchBuilder(block_size=BLOCK, num_blocks=32)
    kv = builder.new_kv_caches(loaded, dtype)
    placeholder = builder._next_free.pop()
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 1000, (PROMPT_LEN,), generator=gen).tolist()
    ids, positions, meta = builder.build([("S", prompt, 0)])
    with torch.inference_mode():
        model(ids, positions, kv, meta)
    assert not fused_steps  # a fresh prompt keeps the layer path
    plan = model.model._plan_for(kv)
    assert plan is not None
    types = {entry.qkv.type for entry in plan._layers}
    if weights == "panels" and dtype == torch.bfloat16 and types.isdisjoint(_PANELS):
        pytest.skip("no bf16 GEMM panels on this host")
    assert (types <= _PANELS) == (weights == "panels")
    position = PROMPT_LEN
    for rows in ROWS:
        tokens = torch.randint(3, 1000, (rows,), generator=gen).tolist()
        builder.build([("S", tokens, position)])  # grows the table
        first_seen = position + 1 - window if window else 0
        table = _hide(kv, builder.block_tables["S"], first_seen, placeholder)
        one_kv = [(k.clone(), v.clone()) for k, v in kv]
        fused_steps.clear()
        singles = torch.cat([_step(model, one_kv, [token], position + t, table)
                             for t, token in enumerate(tokens)])
        together = _step(model, kv, tokens, position, table)
        assert len(fused_steps) == rows + 1, "not fused"
        assert all(hidden is not None for _, hidden in fused_steps), "not fused"
        assert torch.isfinite(together).all()
        assert torch.equal(_bits(together), _bits(singles)), f"{name} {rows} rows at {position}"
        for (k, v), (k_ref, v_ref) in zip(kv, one_kv):
            assert torch.equal(_bits(k), _bits(k_ref)) and torch.equal(_bits(v), _bits(v_ref))
        position += rows


def test_rows_past_the_plan_keep_the_layer_path(tmp_path, fused_steps):
    loaded = load_model(make_tiny_model_dir(tmp_path, arch="llama", seed=5), torch.float32)
    builder = PagedBatchBuilder(block_size=BLOCK, num_blocks=32)
    kv = builder.new_kv_caches(loaded, torch.float32)
    ids, positions, meta = builder.build([("S", list(range(3, 24)), 0)])
    with torch.inference_mode():
        loaded.model(ids, positions, kv, meta)
    plan = loaded.model.model._plan_for(kv)
    tokens = list(range(5, 5 + plan.max_rows + 1))
    builder.build([("S", tokens, PROMPT_LEN)])
    table = torch.tensor([builder.block_tables["S"]], dtype=torch.int32)
    fused_steps.clear()  # the prompt's step
    hidden = _step(loaded.model, kv, tokens, PROMPT_LEN, table)
    assert fused_steps == [(len(tokens), None)] and hidden.shape == (len(tokens), plan.hidden)


class _Drafts:
    """Proposes the tokens that follow the last occurrence of the request's last token
    (right or wrong), up to its limit: drafts of every length, some accepted."""

    def propose(self, requests, limits):
        out = []
        for request, limit in zip(requests, limits):
            ids = request.all_token_ids
            earlier = [i for i in range(len(ids) - 1) if ids[i] == ids[-1]]
            out.append(list(ids[earlier[-1] + 1:][:limit]) if earlier else [7] * limit)
        return out

    def finished(self, requests):
        pass


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_speculative_greedy_tokens_equal_plain_decoding(arch, dtype, tmp_path, monkeypatch,
                                                        fused_steps):
    monkeypatch.setattr(cpu_decode_step, "AMX_PANEL_ROWS", cpu_decode_step.MAX_ROWS)
    path = make_tiny_model_dir(tmp_path, arch=arch, seed=11, num_hidden_layers=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = "1, 2, 3, 1, 2, 3, 1, 2"
    plain = LLM(str(path), dtype=dtype, num_kv_blocks=64, block_size=8, max_model_len=128)
    expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(str(path), dtype=dtype, num_kv_blocks=64, block_size=8, max_model_len=128,
               speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    spec.llm_engine.speculator.proposer = _Drafts()
    fused_steps.clear()  # the plain engine's
    got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == expected
    assert all(hidden is not None for _, hidden in fused_steps)
    # verifications of several drafts took the fused step
    assert any(rows > 2 for rows, _ in fused_steps)
