"""kernels.dispatch on CPU against the torch reference, with the native kernels loaded and
with them switched off; and engine/ reaching kernels through dispatch only."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

import kernels
from kernels import dispatch
from kernels.cpu import native as cpu_native
from kernels import torch_ops
from testing.paged_batch import make_paged_batch

HAS_COMPILER = shutil.which("cc") is not None or shutil.which("gcc") is not None
DTYPES = [torch.float32, torch.bfloat16]
NATIVE = [pytest.param(True, id="native", marks=pytest.mark.skipif(
              not HAS_COMPILER, reason="no C compiler: the native kernels cannot load")),
          pytest.param(False, id="torch-only")]
ENGINE = Path(__file__).resolve().parents[2] / "engine"


@pytest.fixture
def native(request, monkeypatch) -> bool:
    """True: the C library is loaded and in use; False: it is reported unavailable, as on
    a host without a compiler, so dispatch must fall back to the reference."""
    if request.param:
        assert cpu_native.load_library() is not None
    else:
        monkeypatch.setattr(cpu_native, "load_library", lambda: None)
    return request.param


def assert_same(got: torch.Tensor, expected: torch.Tensor, fused: bool) -> None:
    """Bit-equal on the torch path; a fused kernel differs from the torch chain only by
    float32 summation order and exp's last bits: a few float32 ulps, or, since the bf16
    kernel rounds the same steps as the chain, one bf16 ulp on a rare element."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if not fused:
        assert torch.equal(got, expected)
        return
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    ulp = expected.float().abs().clamp_min(1e-30) * 2.0 ** -7
    assert bool(((got.float() - expected.float()).abs() <= ulp).all())
    assert (got == expected).float().mean().item() > 0.99


@pytest.mark.parametrize("native", NATIVE, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_x", [True, False], ids=["residual-add", "norm-only"])
def test_add_rms_norm(native, dtype, with_x):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 576, generator=g).to(dtype) if with_x else None
    residual = (3 * torch.randn(7, 576, generator=g)).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    expected_residual = residual.clone()
    expected = torch_ops.add_rms_norm(x, expected_residual, weight, 1e-5)
    got = dispatch.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)  # updated in place on both paths
    assert_same(got, expected, fused=native)


@pytest.mark.parametrize("native", NATIVE, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(native, dtype):
    gate_up = (4 * torch.randn(33, 2 * 384, generator=torch.Generator().manual_seed(0))).to(dtype)
    expected = torch_ops.silu_mul(gate_up)
    assert expected.shape == (33, 384)
    assert_same(dispatch.silu_mul(gate_up), expected, fused=native)


@pytest.mark.parametrize("native", NATIVE, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_half", [32, 16], ids=["full-rotary", "partial-rotary"])
def test_rope(native, dtype, rot_half):
    g = torch.Generator().manual_seed(rot_half)
    rows, heads, head_dim = 11, 5, 64
    qkv = torch.randn(rows, (heads + 2) * head_dim, generator=g).to(dtype)  # fused row layout
    cos_table = torch.randn(100, rot_half, generator=g).to(dtype)
    sin_table = torch.randn(100, rot_half, generator=g).to(dtype)
    positions = torch.randint(0, 100, (rows,), generator=g)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    expected = torch_ops.rope(qkv, heads, head_dim, cos, sin)
    got = dispatch.rope(qkv, heads, head_dim, rot_half, positions, cos_table, sin_table, cos, sin)
    assert got.is_contiguous()
    # The C kernel rounds each product as torch does: bit-equal even when it runs.
    assert_same(got, expected, fused=False)


@pytest.mark.parametrize("native", NATIVE, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows(native, dtype):
    logits = torch.randn(9, 5000, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits[3, 17] = logits[3, 4000] = 50.0  # a tie: the first index wins on every path
    got = dispatch.argmax_rows(logits)
    assert torch.equal(got, torch_ops.argmax_rows(logits)) and got.dtype == torch.int64
    assert got[3] == 17


@pytest.mark.parametrize("native", NATIVE, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(native, dtype):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 5 * 64, generator=g).to(dtype)  # strided K/V views, as the model passes
    key, value = qkv[:, 3 * 64:4 * 64].view(6, 1, 64), qkv[:, 4 * 64:].view(6, 1, 64)
    slots = torch.tensor([5, 0, -1, 17, 3, -1])
    expected = [torch.zeros(4, 8, 1, 64, dtype=dtype) for _ in range(2)]
    torch_ops.reshape_and_cache(key, value, *expected, slots)
    got = [torch.zeros(4, 8, 1, 64, dtype=dtype) for _ in range(2)]
    dispatch.reshape_and_cache(key, value, *got, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("native", NATIVE, indirect=True)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("query_lens", [[1] * 5, [1, 3, 1, 40, 1], [1, 5, 2, 9, 1]],
                         ids=["decode", "mixed", "speculative"])
def test_paged_attention(native, dtype, tol, query_lens):
    # Against the torch definition with no fast decode: prefill chunks through SDPA, so
    # short chunks that dispatch runs as decode rows are checked too. "speculative":
    # decodes verifying drafts, a few query tokens at the end of long contexts.
    batch = make_paged_batch([1, 9, 33, 60, 77], query_lens, 9, 3, 64, 16, dtype=dtype, seed=5)
    expected = torch_ops.paged_attention(*batch.attention_args())
    got = dispatch.paged_attention(*batch.attention_args())
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def _kernel_imports(path: Path) -> set[str]:
    """The kernels module of every `import kernels.x` / `from kernels.x import y`: 'kernels.x.y'
    when y is a module of its own (`from kernels.cpu import features`), else 'kernels.x'."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kernels"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kernels":
            # From a package (kernels, kernels.cpu, kernels.dispatch) each name is a module
            # of its own or a name the package re-exports.
            package = ENGINE.parent.joinpath(*node.module.split("."))
            for alias in node.names:
                module = package / alias.name
                is_module = module.is_dir() or module.with_suffix(".py").is_file()
                found.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return found



def test_engine_reaches_kernels_through_dispatch_only():
    # One door: kernels.dispatch's face, which also hands out the weight types and CPU
    # detection; its own modules (kernels.dispatch.matmul, ...) are never reached directly.
    allowed = {"kernels.dispatch"}
    assert set(kernels.__all__) <= set(vars(dispatch))
    sources = sorted(ENGINE.rglob("*.py"))
    assert len(sources) > 10
    stray = {str(p.relative_to(ENGINE)): sorted(_kernel_imports(p) - allowed) for p in sources}
    assert {k: v for k, v in stray.items() if v} == {}
    assert not [p for p in sources if "cpu_native" in p.read_text()]
