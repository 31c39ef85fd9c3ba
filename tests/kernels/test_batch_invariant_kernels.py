"""The batch-invariant kernels (kernels/dispatch/, batch_invariant): a row's result is
bit-equal whatever rows come with it, and still the right value (float64 references)."""
import pytest
import torch

from kernels import dispatch, torch_invariant
from kernels.cpu import gemm as cpu_gemm
from kernels.cpu import linear as cpu_linear
from kernels.lora_ops import LoRAWeights, make_segments
from testing.gguf_weights import gguf_weight

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="needs the native kernels")
ROW_COUNTS = (1, 2, 3, 5, 16, 67)


def _x_and_weight(dtype, k=579, n=37, rows=67, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, weight, bias


@pytest.mark.parametrize("dtype, n", [(torch.float32, 37), (torch.float32, 80),
                                      (torch.bfloat16, 37), (torch.float16, 37)])
def test_invariant_linear_rows_are_bit_equal_for_any_row_count(dtype, n):
    """k = 579 leaves a tail past the 8-wide loop; float32 runs the GEMM's panels (n = 80:
    one row takes 6-panel groups, the last one short), bf16 the row kernel, float16 the
    torch row-by-row path."""
    rows = 20 if dtype == torch.float16 else 67  # float16's torch GEMV is slow on CPUs
    x, weight, bias = _x_and_weight(dtype, n=n, rows=rows)
    prepared = dispatch.prepare_linear(weight, bias, batch_invariant=True)
    panels = dtype == torch.float32 and cpu_gemm._library() is not None
    assert prepared.kind == ("invariant-panels" if panels else "invariant")
    assert prepared.packed is None and (prepared.panels is not None) == panels
    full = dispatch.linear(x, prepared)
    for m in (m for m in ROW_COUNTS if m <= rows):
        assert torch.equal(dispatch.linear(x[:m], prepared), full[:m]), m
    # the same row at another place in another batch
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(dispatch.linear(x[order], prepared), full[order])
    exact = x.double() @ weight.double().T + bias.double()
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0.1)
    torch.testing.assert_close(full.double(), exact, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prepare", [LoRAWeights.of, dispatch.prepare_lora])
def test_invariant_lora_rows_are_bit_equal_in_any_segment(dtype, prepare):
    """Two adapters' segments (one split in two runs) and a base row between them: each
    row's update equals the one it gets alone, natively and on the torch fallback; natively
    also with bf16 pairs where the build runs them (dispatch.prepare_lora)."""
    g = torch.Generator().manual_seed(8)
    k, n = 100, 44  # tails past the kernel's 8-wide loops
    x, base = torch.randn(11, k, generator=g).to(dtype), torch.randn(11, n, generator=g)
    weights = [prepare(torch.randn(r, k, generator=g).to(dtype) / 4,
                       torch.randn(n, r, generator=g).to(dtype) / 4) for r in (8, 3)]
    segments = make_segments([[(0, 5), (8, 11)], [(5, 7)]])
    adapter_of = {r: 0 for r in (*range(5), 8, 9, 10)} | {5: 1, 6: 1}
    for add in (lambda *a: dispatch.lora_add(*a, batch_invariant=True),
                torch_invariant.lora_add):
        y = base.to(dtype, copy=True)
        add(x, y, segments, weights)
        assert torch.equal(y[7], base[7].to(dtype))  # no adapter: untouched
        for row, adapter in adapter_of.items():
            alone = base[row:row + 1].to(dtype, copy=True)
            add(x[row:row + 1], alone, make_segments([[(0, 1)]]), [weights[adapter]])
            assert torch.equal(alone, y[row:row + 1]), row
        a, b = weights[0].a, weights[0].b
        exact = base[:5].double() + (x[:5].double() @ a.double().T) @ b.double().T
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.05)
        torch.testing.assert_close(y[:5].double(), exact, **tol)


def test_default_linear_rounds_differently_across_row_counts():
    """Why the mode exists: by default few rows take the native row kernel and more take
    oneDNN / torch's GEMM, whose sums go in another order (float32, k = 576 as SmolLM2).
    Where float32 weights are GEMM panels (AVX2 builds) every row count runs the one FMA
    chain per output, so there the default is already invariant."""
    x, weight, bias = _x_and_weight(torch.float32, k=576, n=64, rows=16, seed=2)
    default = dispatch.prepare_linear(weight, bias)
    alone = torch.cat([dispatch.linear(x[r:r + 1], default) for r in range(x.shape[0])])
    batched = dispatch.linear(x, default)
    assert torch.equal(alone, batched) == (default.kind == "panels")
    invariant = dispatch.prepare_linear(weight, bias, batch_invariant=True)
    alone = torch.cat([dispatch.linear(x[r:r + 1], invariant) for r in range(x.shape[0])])
    assert torch.equal(alone, dispatch.linear(x, invariant))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_gguf_rows_in_one_row_order_for_any_row_count(type_name):
    weight, dense = gguf_weight(type_name, 40, 96)
    g = torch.Generator().manual_seed(3)
    x, bias = torch.randn(300, 96, generator=g), torch.randn(40, generator=g)
    full = dispatch.gguf_linear(x, weight, bias, batch_invariant=True)
    for m in (1, 2, 5, 300):
        assert torch.equal(dispatch.gguf_linear(x[:m], weight, bias, batch_invariant=True),
                           full[:m])
    # the one-row arithmetic is the kernel's own at m = 1 (what decode and the fused step run)
    assert torch.equal(dispatch.gguf_linear(x[7:8], weight, bias), full[7:8])
    torch.testing.assert_close(full.double(), x.double() @ dense.double().T + bias.double(),
                               rtol=0.05, atol=0.05)


def _paged_sequences(dtype, block_size=8, heads=4, kv_heads=2, dim=16):
    """A 40-token sequence A and a 20-token sequence B in a shared paged cache, with one
    query vector per position (position p's query is the same in every call)."""
    g = torch.Generator().manual_seed(5)
    key_cache = torch.randn(16, block_size, kv_heads, dim, generator=g).to(dtype)
    value_cache = torch.randn(16, block_size, kv_heads, dim, generator=g).to(dtype)
    seqs = {"A": (torch.tensor([5, 2, 7, 0, 9], dtype=torch.int32), 40),
            "B": (torch.tensor([1, 3, 4], dtype=torch.int32), 20)}
    queries = {name: torch.randn(n, heads, dim, generator=g).to(dtype)
               for name, (_, n) in seqs.items()}
    return key_cache, value_cache, seqs, queries


def _attend(cache, seqs, queries, parts, batch_invariant=True):
    """parts: (sequence, first position, end position) in batch order -> output rows."""
    key_cache, value_cache = cache
    q = torch.cat([queries[name][start:end] for name, start, end in parts])
    tables = torch.zeros(len(parts), 5, dtype=torch.int32)
    for i, (name, _, _) in enumerate(parts):
        tables[i, :len(seqs[name][0])] = seqs[name][0]
    lens = [end - start for _, start, end in parts]
    qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([end for _, _, end in parts], dtype=torch.int32)
    return dispatch.paged_attention(q, key_cache, value_cache, tables, qsl, seq_lens, 0.25,
                                    max(lens), int(seq_lens.max()), batch_invariant)


def _reference(cache, seqs, queries, name, position):
    key_cache, value_cache = cache
    table, _ = seqs[name]
    keys = key_cache[table.long()].flatten(0, 1)[:position + 1].double()
    values = value_cache[table.long()].flatten(0, 1)[:position + 1].double()
    group = queries[name].shape[1] // keys.shape[1]
    q = queries[name][position].double()  # [H, D]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", q, k) * 0.25, dim=-1)
    return torch.einsum("ht,thd->hd", weights, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_depends_on_the_position_alone(dtype):
    """Whole prefill, a chunk, the chunk mixed with other sequences' rows, a decode row."""
    key_cache, value_cache, seqs, queries = _paged_sequences(dtype)
    cache = (key_cache, value_cache)
    whole = _attend(cache, seqs, queries, [("A", 0, 40)])
    chunk = _attend(cache, seqs, queries, [("A", 27, 40)])
    mixed = _attend(cache, seqs, queries, [("B", 19, 20), ("A", 27, 40), ("B", 0, 12)])
    decode = _attend(cache, seqs, queries, [("B", 5, 6), ("A", 39, 40)])
    assert torch.equal(chunk, whole[27:])
    assert torch.equal(mixed[1:14], whole[27:])
    assert torch.equal(decode[1], whole[39])
    assert torch.equal(mixed[14:], _attend(cache, seqs, queries, [("B", 0, 20)])[:12])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    for position in (0, 8, 27, 39):
        torch.testing.assert_close(whole[position].double(),
                                   _reference(cache, seqs, queries, "A", position), **tol)


def test_torch_fallbacks_are_row_by_row_and_bit_equal_across_batches():
    """What hosts without the native kernels (and float16) run: each row alone."""
    key_cache, value_cache, seqs, queries = _paged_sequences(torch.float32)
    tables = torch.stack([torch.tensor([5, 2, 7, 0, 9], dtype=torch.int32),
                          torch.tensor([1, 3, 4, 0, 0], dtype=torch.int32)])
    both = torch_invariant.decode_attention(
        torch.stack([queries["A"][39], queries["B"][19]]), key_cache, value_cache, tables,
        torch.tensor([40, 20], dtype=torch.int32), 0.25)
    alone = torch_invariant.decode_attention(queries["B"][19:20], key_cache, value_cache,
                                             tables[1:], torch.tensor([20], dtype=torch.int32),
                                             0.25)
    assert torch.equal(both[1:], alone)
    g = torch.Generator().manual_seed(9)
    residual, x, weight = (torch.randn(6, 64, generator=g) for _ in range(3))
    first = torch_invariant.add_rms_norm(x, residual.clone(), weight[0], 1e-5)
    assert torch.equal(torch_invariant.add_rms_norm(x[2:3], residual[2:3].clone(), weight[0],
                                                    1e-5), first[2:3])
