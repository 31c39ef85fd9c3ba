"""Sliding-window and soft-capped paged attention (issue 44) on every CPU path, against the
dense float64 reference of tests/kernels/window_reference.py: the torch implementation,
the dispatcher (default and batch-invariant), the native decode kernel, the tile kernel
and the AMX prefill kernel. Every block a query's window leaves behind, and every table
column past a sequence's blocks, names a block of NaN: a path that reads one fails.
Attention sinks (gpt-oss, issue 45) with and without windows / caps through the
dispatcher, the one CPU door that takes them (the native kernels decline: torch runs).
The Triton kernels have the same cases under the interpreter (tests/kernels/triton/)."""
from __future__ import annotations

import pytest
import torch

from kernels import dispatch, torch_ops, torch_windowed
from kernels.cpu import native as cpu_native
from kernels.cpu import paged_attention as cpu_attention
from tests.kernels.window_reference import assert_matches, reference, windowed_batch

# Decode rows (one a lone token), a fresh prompt, a chunk after cached context, a short
# chunk, an idle sequence; contexts around the windows below.
MIXED = ([1, 37, 40, 100, 29, 64, 5, 3], [1, 1, 40, 23, 1, 7, 0, 3])
DECODE = ([1, 37, 40, 100, 29, 64, 5], [1] * 7)
# 1: the query alone; 7 and 29: not a multiple of any block size (29 is one context
# exactly); 16: one block; 1000: past every context (the window changes nothing).
WINDOWS = [1, 7, 16, 29, 1000]
# GQA at Gemma's 256, MQA, MHA at 128, GQA at 64 (block sizes 8, 16, 32).
SHAPES = [(8, 2, 256, 16), (4, 1, 256, 32), (4, 4, 128, 16), (6, 2, 64, 8)]
# Gemma's scales are query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
SCALE = 0.11
CAP = 2.0  # with queries x3, logits of several units: the cap bends most of them
TOLERANCE = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
native = pytest.mark.skipif(cpu_native.load_library() is None, reason="no native kernels")


def _batch(lens, shape, window, dtype, seed=0):
    heads, kv_heads, head_dim, block_size = shape
    return windowed_batch(*lens, heads, kv_heads, head_dim, block_size, window, dtype=dtype,
                          seed=seed + head_dim + heads, scale=SCALE, query_gain=3.0)


def _options(window, cap):
    return dict(sliding_window=window, soft_cap=cap)


def _cases():
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for window in WINDOWS:
                yield shape, dtype, window, None
            yield shape, dtype, 7, CAP
            yield shape, dtype, None, CAP
    yield SHAPES[0], torch.float32, 29, CAP
    yield SHAPES[2], torch.bfloat16, 1000, CAP


CASES = pytest.mark.parametrize("shape,dtype,window,cap", list(_cases()))


@CASES
def test_torch_path(shape, dtype, window, cap):
    batch = _batch(MIXED, shape, window, dtype)
    got = torch_ops.paged_attention(*batch.attention_args(), **_options(window, cap))
    assert_matches(got, batch, window, cap, **TOLERANCE[dtype])


@CASES
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_dispatch(shape, dtype, window, cap, lens):
    batch = _batch(lens, shape, window, dtype)
    got = dispatch.paged_attention(*batch.attention_args(), **_options(window, cap))
    assert_matches(got, batch, window, cap, **TOLERANCE[dtype])


@CASES
def test_dispatch_batch_invariant(shape, dtype, window, cap):
    batch = _batch(MIXED, shape, window, dtype)
    got = dispatch.paged_attention(*batch.attention_args(), True, **_options(window, cap))
    assert_matches(got, batch, window, cap, **TOLERANCE[dtype])


@native
@CASES
def test_native_decode_kernel(shape, dtype, window, cap):
    batch = _batch(DECODE, shape, window, dtype)
    q, kc, vc, tables, _, lens, scale, *_ = batch.attention_args()
    got = cpu_native.decode_attention(q, kc, vc, tables, lens, scale, **_options(window, cap))
    assert got is not None, "the native decode kernel declined"
    assert_matches(got, batch, window, cap, **TOLERANCE[dtype])


# The decode kernel's other loops: a group past the vector loop's 8 heads and a head_dim
# no vector width divides (the per-lane loop, every ISA), a group without its own
# specialisation, and Phi-3's head_dim 96.
OTHER_SHAPES = [(16, 1, 40, 16), (10, 2, 64, 16), (4, 2, 96, 16)]


@native
@pytest.mark.parametrize("shape", OTHER_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,cap", [(7, None), (29, CAP), (None, CAP)])
def test_native_decode_kernel_other_loops(shape, dtype, window, cap):
    test_native_decode_kernel(shape, dtype, window, cap)


@native
@CASES
def test_tile_kernel(shape, dtype, window, cap):
    batch = _batch(MIXED, shape, window, dtype)
    q, kc, vc, tables, starts, lens, scale, *_ = batch.attention_args()
    got = cpu_attention.paged_attention(q, kc, vc, tables, starts, lens, scale,
                                        **_options(window, cap))
    assert got is not None, "the tile kernel declined"
    assert_matches(got, batch, window, cap, **TOLERANCE[dtype])


@pytest.mark.skipif(not cpu_attention.prefill_amx_built(), reason="no AMX build")
@pytest.mark.parametrize("shape,dtype,window,cap", [  # bf16, block sizes multiples of 16
    case for case in _cases() if case[1] == torch.bfloat16 and case[0][3] % 16 == 0])
def test_amx_prefill_kernel(shape, dtype, window, cap):
    batch = _batch(MIXED, shape, window, dtype)
    q, kc, vc, tables, starts, lens, scale, *_ = batch.attention_args()
    query_lens = starts.diff()
    chunks = (query_lens > 0).nonzero().squeeze(1)
    out = torch.zeros_like(q)
    assert cpu_attention.prefill_attention_amx(
        q, kc, vc, tables[chunks], starts[chunks], query_lens[chunks], lens[chunks], scale, out,
        **_options(window, cap)), "the AMX kernel declined"
    # P is rounded to bf16 on the tiles: a little looser than the float32 paths' bf16.
    assert_matches(out, batch, window, cap, atol=3e-2, rtol=3e-2)


# Prompts longer than a torch slice (a window's rows, at least 128) and an AMX item.
LONG = ([300, 200, 3], [300, 150, 1])


@pytest.mark.parametrize("window,cap", [(40, None), (100, CAP), (None, CAP), (1000, CAP)])
@pytest.mark.parametrize("path", ["torch", "dispatch", "tiles", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompts(window, cap, path, dtype, monkeypatch):
    """The torch path's slices (a small score budget makes the soft-capped ones many),
    the tiles and the AMX kernel over contexts of many windows."""
    monkeypatch.setattr(torch_windowed, "_SCORES_BUDGET", 20000)
    batch = _batch(LONG, (8, 2, 64, 16), window, dtype)
    args, options = batch.attention_args(), _options(window, cap)
    if path == "torch":
        got = torch_ops.paged_attention(*args, **options)
    elif path == "dispatch":
        got = dispatch.paged_attention(*args, **options)
    elif cpu_native.load_library() is None:
        pytest.skip("no native kernels")
    elif path == "tiles":
        got = cpu_attention.paged_attention(*args[:7], **options)
    else:
        if dtype != torch.bfloat16 or not cpu_attention.prefill_amx_built():
            pytest.skip("the AMX kernel is bf16, on AMX builds")
        got = torch.zeros_like(batch.query)
        q, kc, vc, tables, starts, lens, scale, *_ = args
        assert cpu_attention.prefill_attention_amx(q, kc, vc, tables, starts[:-1], starts.diff(),
                                                   lens, scale, got, **options)
    tolerance = dict(TOLERANCE[dtype])
    if path == "amx":
        tolerance = dict(atol=3e-2, rtol=3e-2)
    assert_matches(got, batch, window, cap, **tolerance)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,cap", [(7, None), (None, CAP), (29, CAP)])
def test_batch_invariant_rows_are_the_same_bits_alone(dtype, window, cap):
    """batch_invariant with a window: a token's row is bit-equal to the same token run as
    the only row of its own step."""
    batch = _batch(MIXED, SHAPES[0], window, dtype)
    q, kc, vc, tables, starts, lens, scale, *_ = batch.attention_args()
    whole = dispatch.paged_attention(*batch.attention_args(), True, **_options(window, cap))
    bounds = starts.tolist()
    for seq, seq_len in enumerate(lens.tolist()):
        for row in range(bounds[seq], bounds[seq + 1]):
            length = seq_len - (bounds[seq + 1] - 1 - row)
            alone = dispatch.paged_attention(
                q[row:row + 1], kc, vc, tables[seq:seq + 1],
                torch.tensor([0, 1], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
                scale, 1, length, True, **_options(window, cap))
            assert torch.equal(alone, whole[row:row + 1]), (seq, row)


def test_none_is_todays_call():
    """Both features None is the call without them, bit for bit."""
    batch = _batch(MIXED, SHAPES[3], None, torch.bfloat16)
    # today's paths read the table's padding (masked): a real block, not the placeholder
    batch.block_tables = batch.block_tables.clamp(max=batch.key_cache.shape[0] - 2)
    args = batch.attention_args()
    for invariant in (False, True):
        assert torch.equal(dispatch.paged_attention(*args, invariant),
                           dispatch.paged_attention(*args, invariant, sliding_window=None,
                                                    soft_cap=None))


def test_window_at_least_the_context_is_full_attention():
    batch = _batch(MIXED, SHAPES[2], 1000, torch.float32)
    torch.testing.assert_close(reference(batch, 1000, None), reference(batch, None, None))


@pytest.mark.parametrize("bad", [dict(sliding_window=0), dict(sliding_window=-3),
                                 dict(sliding_window=2.5), dict(sliding_window=True),
                                 dict(soft_cap=0.0), dict(soft_cap=-1.0),
                                 dict(soft_cap=float("inf")), dict(soft_cap=float("nan"))])
def test_bad_window_or_cap_is_refused(bad):
    batch = _batch(DECODE, SHAPES[3], None, torch.float32)
    with pytest.raises(ValueError, match=next(iter(bad))):
        dispatch.paged_attention(*batch.attention_args(), **bad)


# ---- attention sinks (gpt-oss) -------------------------------------------------------------
def _sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    """One per head, of the logits' size (some heads' sinks outweigh most keys, some almost
    none), in no order, so a head reading another head's sink shows."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0 + 1.0


SINK_FEATURES = [(None, None), (1, None), (7, None), (29, None), (1000, None), (None, CAP),
                 (16, CAP)]
SINK_CASES = pytest.mark.parametrize("shape,dtype,window,cap", [
    (shape, dtype, window, cap) for shape in SHAPES for dtype in (torch.float32, torch.bfloat16)
    for window, cap in SINK_FEATURES])


@SINK_CASES
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_dispatch_with_sinks(shape, dtype, window, cap, lens):
    batch = _batch(lens, shape, window, dtype)
    sinks = _sinks(shape[0])
    got = dispatch.paged_attention(*batch.attention_args(), sinks=sinks, **_options(window, cap))
    assert_matches(got, batch, window, cap, sinks=sinks, **TOLERANCE[dtype])


@SINK_CASES
def test_dispatch_batch_invariant_with_sinks(shape, dtype, window, cap):
    batch = _batch(MIXED, shape, window, dtype)
    sinks = _sinks(shape[0], seed=1)
    got = dispatch.paged_attention(*batch.attention_args(), True, sinks=sinks,
                                   **_options(window, cap))
    assert_matches(got, batch, window, cap, sinks=sinks, **TOLERANCE[dtype])


@pytest.mark.parametrize("window,cap", [(40, None), (100, CAP), (None, None), (None, CAP)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompts_with_sinks(window, cap, dtype, monkeypatch):
    """Chunks of several torch slices (a window's rows; a small score budget makes the
    sink slices, which cannot use SDPA, many more) over contexts of many windows."""
    monkeypatch.setattr(torch_windowed, "_SCORES_BUDGET", 20000)
    batch = _batch(LONG, (8, 2, 64, 16), window, dtype)
    sinks = _sinks(8, seed=2)
    got = dispatch.paged_attention(*batch.attention_args(), sinks=sinks, **_options(window, cap))
    assert_matches(got, batch, window, cap, sinks=sinks, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("invariant", [False, True])
def test_sinks_never_reach_the_native_kernels(dtype, invariant, monkeypatch):
    """The native decode, tile and AMX kernels know no sinks: a call with sinks must not
    reach them (they would drop the sinks silently), wherever they are built."""
    def refuse(*args, **kwargs):
        raise AssertionError("a native kernel got a call with sinks")
    monkeypatch.setattr(cpu_native, "decode_attention", refuse)
    monkeypatch.setattr(cpu_attention, "paged_attention", refuse)
    monkeypatch.setattr(cpu_attention, "prefill_attention_amx", refuse)
    for lens in (MIXED, DECODE):
        batch = _batch(lens, SHAPES[0], 7, dtype)
        sinks = _sinks(SHAPES[0][0])
        got = dispatch.paged_attention(*batch.attention_args(), invariant, sliding_window=7,
                                       sinks=sinks)
        assert_matches(got, batch, 7, None, sinks=sinks, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_rows_with_sinks_are_the_same_bits_alone(dtype):
    batch = _batch(MIXED, SHAPES[3], 7, dtype)
    sinks = _sinks(SHAPES[3][0])
    q, kc, vc, tables, starts, lens, scale, *_ = batch.attention_args()
    whole = dispatch.paged_attention(*batch.attention_args(), True, sliding_window=7, sinks=sinks)
    bounds = starts.tolist()
    for seq, seq_len in enumerate(lens.tolist()):
        for row in range(bounds[seq], bounds[seq + 1]):
            length = seq_len - (bounds[seq + 1] - 1 - row)
            alone = dispatch.paged_attention(
                q[row:row + 1], kc, vc, tables[seq:seq + 1],
                torch.tensor([0, 1], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
                scale, 1, length, True, sliding_window=7, sinks=sinks)
            assert torch.equal(alone, whole[row:row + 1]), (seq, row)


def test_reference_sinks_are_hf_gpt_oss_eager_attention():
    """The reference's sinks are gpt-oss's: HF's eager_attention_forward (sinks joined to
    the scaled, masked logits, softmax, the sink's column dropped) on one fresh prompt."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    heads, kv_heads, head_dim = 4, 2, 32
    batch = _batch(([23], [23]), (heads, kv_heads, head_dim, 8), None, torch.float32)
    sinks = _sinks(heads)
    query = batch.query.double().transpose(0, 1)[None]           # [1, H, T, D]
    keys = batch.keys[0].double().transpose(0, 1)[None]           # [1, KVH, T, D]
    values = batch.values[0].double().transpose(0, 1)[None]
    mask = torch.full((23, 23), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=sinks.double(),
                             training=False)
    expected, _ = eager_attention_forward(module, query, keys, values, mask, batch.scale)
    torch.testing.assert_close(reference(batch, None, None, sinks), expected[0])


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(4), r"float32 \(8,\).*\(4,\)"),
    (torch.zeros(8, dtype=torch.bfloat16), "bfloat16"),
    (torch.zeros(1, 8), r"\(1, 8\)"),
    ([0.0] * 8, "list")])
def test_bad_sinks_are_refused(bad, match):
    batch = _batch(DECODE, SHAPES[0], None, torch.float32)
    with pytest.raises(ValueError, match=rf"sinks: .*{match}"):
        dispatch.paged_attention(*batch.attention_args(), sinks=bad)
