"""batch_invariant for the mixture-of-experts block (engine/models/moe.py, kernels/dispatch/
moe.py): a token's output does not depend on which other tokens share the call, whether
the native kernel runs it (row-invariant by construction) or the torch definition does
(then one row at a time); then end to end on the tiny Mixtral, in the style of
test_batch_invariant.py."""
import pytest
import torch

from engine import LLM
from engine.models.moe import FusedMoE, Routing
from kernels import torch_moe
from kernels.cpu import linear as cpu_linear
from kernels.dispatch import moe as moe_dispatch
from testing.tiny_model import make_tiny_model_dir
from tests.engine.test_batch_invariant import COMMON, FILLERS, TARGET_PARAMS, TARGETS, _results
from tests.engine.test_batch_invariant import _alone

needs_native = pytest.mark.skipif(not cpu_linear.available(), reason="needs the native kernels")

# Mixtral's block, and gpt-oss's (router bias, expert biases, its activation and rule).
BLOCKS = {
    "mixtral": dict(routing=Routing.SOFTMAX_TOPK_RENORM),
    "gpt-oss": dict(routing=Routing.TOPK_SOFTMAX, router_bias=True, expert_bias=True,
                    activation="swigluoai"),
}


def _invariant_block(kind: str) -> FusedMoE:
    moe = FusedMoE(64, 48, 8, 2, dtype=torch.bfloat16, **BLOCKS[kind])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    moe.gate.prepack(True)  # the router's GEMM too: what MoEForCausalLM.prepack does
    moe.batch_invariant = True
    return moe


def _assert_rows_alone_equal_rows_in_the_batch(moe: FusedMoE) -> None:
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        batch = moe(x)
        for t in range(x.shape[0]):
            assert torch.equal(moe(x[t:t + 1])[0], batch[t]), t


@needs_native
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_torch_definition_runs_row_by_row_and_a_row_is_the_same_alone(kind, monkeypatch):
    monkeypatch.setattr(moe_dispatch, "native_cpu_kernel", lambda: None)
    rows_per_call = []
    definition = torch_moe.fused_moe

    def counted(x, *args, **kwargs):
        rows_per_call.append(x.shape[0])
        return definition(x, *args, **kwargs)

    monkeypatch.setattr(torch_moe, "fused_moe", counted)
    _assert_rows_alone_equal_rows_in_the_batch(_invariant_block(kind))
    assert rows_per_call and set(rows_per_call) == {1}  # the batch of 37 went row by row


@needs_native
@pytest.mark.skipif(moe_dispatch.native_cpu_kernel() is None, reason="no native MoE kernel")
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_native_kernel_takes_the_whole_batch_and_a_row_is_the_same_alone(kind, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the native kernel should have taken the call")

    monkeypatch.setattr(torch_moe, "fused_moe", refuse)
    _assert_rows_alone_equal_rows_in_the_batch(_invariant_block(kind))


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("mixtral"), arch="mixtral", seed=3))


@needs_native
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-rows"])
def test_a_request_is_bit_identical_alone_crowded_chunked_and_cached(tiny_mixtral, native,
                                                                     monkeypatch):
    if not native:
        monkeypatch.setattr(moe_dispatch, "native_cpu_kernel", lambda: None)
    elif moe_dispatch.native_cpu_kernel() is None:
        pytest.skip("no native MoE kernel")
    llm = LLM(tiny_mixtral, dtype="bfloat16", max_num_batched_tokens=24,
              long_prefill_token_threshold=7, **COMMON)
    blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert blocks and all(b.batch_invariant for b in blocks)
    alone = _alone(llm)
    # Fillers first: the targets' shared prefix is cached by then, their prompts go in
    # chunks of 7 beside other prefills and decodes, and the batch shrinks as fillers end.
    filler_params = [TARGET_PARAMS[0]] * len(FILLERS)
    crowded = llm.generate(FILLERS + TARGETS, filler_params + TARGET_PARAMS, use_tqdm=False)
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert _results(crowded[len(FILLERS):]) == alone
