"""kernels.dispatch.linear: which kernel each prepared weight kind and row count reaches,
and the same numbers (within the int8 / summation-order tolerance) with the native
library reported unavailable, as on a host without a C compiler."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import LinearWeight, dispatch
from kernels.cpu import features as cpu_features
from kernels.cpu import gemm as cpu_gemm
from kernels.cpu import linear as cpu_linear
from kernels.cpu import onednn as cpu_onednn
from testing.gguf_weights import gguf_weight

needs_native = pytest.mark.skipif(
    (shutil.which("cc") is None and shutil.which("gcc") is None) or not cpu_linear.available(),
    reason="no C compiler: the native matmuls cannot load")


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Names of the kernels dispatch.linear ran, in order (a kernel that declined, by
    returning None, is not counted)."""
    ran: list[str] = []

    def spy(module, name, label):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            if out is not None:
                ran.append(label)
            return out
        monkeypatch.setattr(module, name, wrapper)

    spy(cpu_linear, "linear_f32_rows", "native rows")
    spy(cpu_linear, "linear_bf16_rows", "native bf16 rows")
    spy(cpu_linear, "linear_gguf", "gguf native")
    spy(cpu_linear, "linear_gguf_amx", "gguf amx")
    spy(cpu_linear, "dequantize_rows", "gguf dequantize")
    spy(cpu_gemm, "gemm", "native gemm")
    spy(cpu_gemm, "gemm_bf16", "native bf16 gemm")
    spy(cpu_gemm, "gemm_gguf", "native gguf gemm")
    spy(cpu_onednn, "linear", "onednn")
    spy(F, "linear", "F.linear")
    return ran


def _dense(dtype=torch.float32, out_features=40, in_features=64):
    g = torch.Generator().manual_seed(out_features + in_features)
    return (torch.randn(out_features, in_features, generator=g).to(dtype),
            torch.randn(out_features, generator=g).to(dtype))


def _float32_batch_kind(weight: torch.Tensor) -> str:
    """What a float32 weight is prepared as on this host: the native GEMM's panels where
    the build prefers it (AVX2 without AVX-512), else oneDNN's prepacked copy, else as is."""
    if cpu_gemm.preferred():
        return "panels"
    return "onednn" if cpu_onednn.can_prepack(weight) else "dense"


def _bf16_kind() -> str:
    """What a bf16 weight is prepared as on this host: the native bf16 GEMM's panels on
    AVX-512 BF16 without AMX, else oneDNN's prepacked copy where it packs bf16, else as is."""
    if dispatch.bf16_panels_preferred():
        return "panels"
    return "onednn" if cpu_features.detect().can_prepack_bf16 else "dense"


def test_prepare_reports_the_kind_this_host_runs():
    weight, bias = _dense()
    prepared = dispatch.prepare_linear(weight, bias)
    assert prepared.kind == _float32_batch_kind(weight)
    assert prepared.bias is bias
    if prepared.kind == "panels":  # the only copy: the dense rows come back bit-exact
        assert prepared.dense is None and torch.equal(dispatch.unpack_linear(prepared), weight)
    else:
        assert prepared.dense is weight
    bf16 = dispatch.prepare_linear(weight.bfloat16(), None)
    assert bf16.kind == _bf16_kind()
    if bf16.kind == "panels":
        assert bf16.dense is None and torch.equal(dispatch.unpack_linear(bf16), weight.bfloat16())
    quantized, _ = gguf_weight("Q4_0", 40, 64)
    gguf = dispatch.prepare_linear(quantized, bias.bfloat16())
    assert gguf.kind == "gguf" and gguf.dense is None
    # The VNNI kernel's panels replace the file's rows where it is built (AMX keeps rows).
    panels = cpu_linear.gguf_vnni_built() and not cpu_linear.gguf_amx_available()
    assert gguf.table.layout == ("panels" if panels else "rows")
    assert all(torch.equal(a, b) for a, b in zip(
        (gguf.table.to_rows().qs, gguf.table.to_rows().d, gguf.table.to_rows().offset),
        (quantized.qs, quantized.d, quantized.offset)))
    assert gguf.bias.dtype == torch.float32  # what the kernel adds
    assert LinearWeight(weight, bias).kind == "dense"  # not prepared: runs as loaded


@needs_native
@pytest.mark.parametrize("rows", [1, dispatch.DENSE_ROWS_MAX, dispatch.DENSE_ROWS_MAX + 1, 64])
def test_dense_float32_takes_native_rows_then_the_hosts_batch_gemm(calls, rows):
    """Panels (the only copy) serve every row count; oneDNN's copy sits beside the rows."""
    weight, bias = _dense()
    prepared = dispatch.prepare_linear(weight, bias)
    batch = {"panels": "native gemm", "onednn": "onednn", "dense": "F.linear"}[prepared.kind]
    x = torch.randn(rows, 64)
    torch.testing.assert_close(dispatch.linear(x, prepared), x @ weight.T + bias,
                               rtol=1e-5, atol=1e-4)
    few = "native gemm" if prepared.kind == "panels" else "native rows"
    assert calls == [few if rows <= dispatch.DENSE_ROWS_MAX else batch]


@needs_native
def test_unpacked_weights_take_native_rows_then_f_linear(calls):
    weight, bias = _dense()
    dispatch.linear(torch.randn(1, 64), LinearWeight(weight, bias))
    dispatch.linear(torch.randn(5, 64), LinearWeight(weight, bias))
    assert calls == ["native rows", "F.linear"]


@needs_native
def test_bf16_weights_take_native_bf16_rows_then_onednn_or_f_linear(calls):
    """Where the bf16 panels serve, their GEMM takes every row count instead."""
    weight, bias = _dense(torch.bfloat16)
    prepared = dispatch.prepare_linear(weight, bias)
    x = torch.randn(dispatch.DENSE_ROWS_MAX + 1, 64).bfloat16()
    for rows in (1, dispatch.DENSE_ROWS_MAX, dispatch.DENSE_ROWS_MAX + 1):
        torch.testing.assert_close(dispatch.linear(x[:rows], prepared).float(),
                                   x[:rows].float() @ weight.float().T + bias.float(),
                                   rtol=1e-2, atol=2e-2)
    if prepared.kind == "panels":
        assert calls == ["native bf16 gemm"] * 3
        return
    wide = "onednn" if prepared.kind == "onednn" else "F.linear"
    assert calls == ["native bf16 rows", "native bf16 rows", wide]


@needs_native
@pytest.mark.parametrize("rows", [1, dispatch.GGUF_PANEL_MIN_ROWS - 1, dispatch.GGUF_PANEL_MIN_ROWS,
                                  dispatch.GGUF_DENSE_MIN_ROWS - 1, dispatch.GGUF_DENSE_MIN_ROWS])
def test_gguf_takes_the_int8_kernel_then_a_dense_gemm(calls, rows):
    """Few rows: the int8 kernel. Batches: the native GEMM widening W inside (AVX2 builds),
    else, from GGUF_DENSE_MIN_ROWS, W dequantized whole for F.linear. Where the VNNI
    panels serve, their kernel takes every row count."""
    quantized, _ = gguf_weight("Q4_1", 40, 64)
    prepared = dispatch.prepare_linear(quantized, None)
    dispatch.linear(torch.randn(rows, 64), prepared)
    if prepared.quantized.layout == "panels":
        assert calls == ["gguf native"]
    elif rows >= dispatch.GGUF_PANEL_MIN_ROWS and cpu_gemm.preferred():
        assert calls == ["native gguf gemm"]
    elif rows >= dispatch.GGUF_DENSE_MIN_ROWS:
        assert calls == ["gguf dequantize", "F.linear"]
    else:
        assert calls == ["gguf native"]


@needs_native
@pytest.mark.parametrize("rows", [1, dispatch.GGUF_AMX_MIN_ROWS - 1, dispatch.GGUF_AMX_MIN_ROWS,
                                  dispatch.GGUF_DENSE_MIN_ROWS - 1, dispatch.GGUF_DENSE_MIN_ROWS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gguf_bf16_batches_take_the_amx_kernel_exactly_where_it_runs(calls, rows, dtype):
    """bf16 batches from GGUF_AMX_MIN_ROWS run on AMX tiles where the CPU in use (the cap
    applied) and the build have them; float32 ones, fewer rows and other hosts keep the
    int8 kernel / GEMM paths. Batch-invariant mode never takes it."""
    quantized, dense = gguf_weight("Q4_1", 40, 64)
    x = torch.randn(rows, 64).to(dtype)
    out = dispatch.linear(x, dispatch.prepare_linear(quantized, None))
    amx = (cpu_features.detect().isa == "amx" and bool(cpu_linear.gguf_amx_built()))
    assert cpu_linear.gguf_amx_available() == amx
    takes_amx = amx and dtype == torch.bfloat16 and rows >= dispatch.GGUF_AMX_MIN_ROWS
    assert ("gguf amx" in calls) == takes_amx
    if takes_amx:
        assert calls == ["gguf amx"]
    exact = x.double() @ dense.double().T
    assert float((out.double() - exact).abs().max()) < 0.02 * float(exact.abs().max())
    calls.clear()
    dispatch.linear(x, dispatch.prepare_linear(quantized, None, batch_invariant=True))
    assert "gguf amx" not in calls


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 7, dispatch.GGUF_PANEL_MIN_ROWS,
                                  dispatch.GGUF_DENSE_MIN_ROWS])
def test_without_the_native_library_every_kind_gives_the_same_numbers(monkeypatch, rows):
    weight, bias = _dense(in_features=96)
    quantized, dense = gguf_weight("Q8_0", 40, 96)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    kinds = {"dense": LinearWeight(weight, bias), "prepared": dispatch.prepare_linear(weight, bias),
             "gguf": dispatch.prepare_linear(quantized, bias)}
    native = {name: dispatch.linear(x, w) for name, w in kinds.items()}
    monkeypatch.setattr(cpu_linear, "_library", lambda: None)
    monkeypatch.setattr(cpu_gemm, "_library", lambda: None)
    fallback = {name: dispatch.linear(x, w) for name, w in kinds.items()}
    for name in ("dense", "prepared"):
        torch.testing.assert_close(fallback[name], native[name], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(fallback[name], F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    # torch's path dequantizes W and is exact in x; the kernel's int8 activations cost little
    exact = x @ dense.T + bias
    torch.testing.assert_close(fallback["gguf"], exact, rtol=1e-5, atol=1e-5)
    assert float((native["gguf"] - exact).abs().max()) < 0.02 * float(exact.abs().max())


def test_matmul_primitives_are_built_once_per_packed_shape_and_row_bucket(monkeypatch):
    """dispatch.build_matmul_primitives: every bucket above the row kernel's rows, up to
    each weight's most rows, once per shape and dtype; nothing for weights without a
    oneDNN copy (native panels, batch-invariant ones, CPUs that cannot pack bf16)."""
    ran: list[tuple] = []
    real = cpu_onednn.build_primitives

    def spy(dense, packed, bias, min_rows, max_rows):
        ran.append((tuple(dense.shape), dense.dtype, min_rows, max_rows))
        return real(dense, packed, bias, min_rows, max_rows)
    monkeypatch.setattr(cpu_onednn, "build_primitives", spy)
    gen = torch.Generator().manual_seed(3)
    a, b = (dispatch.prepare_linear(torch.randn(48, 32, generator=gen).to(torch.bfloat16), None)
            for _ in range(2))
    other = dispatch.prepare_linear(torch.randn(16, 32, generator=gen).to(torch.bfloat16), None)
    fp32 = dispatch.prepare_linear(torch.randn(48, 32, generator=gen), None)
    invariant = dispatch.prepare_linear(torch.randn(48, 32, generator=gen).to(torch.bfloat16),
                                        None, batch_invariant=True)
    built = dispatch.build_matmul_primitives([(a, 40), (b, 40), (other, 9), (fp32, 40),
                                              (invariant, 40)])
    low = dispatch.DENSE_ROWS_MAX + 1
    expected = [(tuple(w.dense.shape), w.dense.dtype, low, top)
                for w, top in ((a, 40), (other, 9), (fp32, 40)) if w.packed is not None]
    assert ran == expected  # b shares a's shape; the invariant weight is never packed
    assert built == sum(len(cpu_onednn.bucket_rows(low, top)) for *_, top in expected)
    assert invariant.packed is None
    assert (a.packed is not None) == (cpu_features.detect().can_prepack_bf16
                                      and not dispatch.bf16_panels_preferred())


def test_every_row_count_lands_in_a_built_bucket():
    buckets = cpu_onednn.bucket_rows(3, 2048)
    assert buckets == sorted(set(buckets)) and buckets[0] == 3 and buckets[-1] == 2048
    for rows in range(3, 2049):
        padded = cpu_onednn.padded_rows(rows)
        assert padded in buckets and rows <= padded <= rows * 1.125 + 1
    assert cpu_onednn.bucket_rows(5, 4) == []
