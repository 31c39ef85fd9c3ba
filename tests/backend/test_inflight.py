"""The per-request figures the engine loop records for vLLM's metrics, from a real
engine's outputs (tiny random model): token counts whatever the output kind, vLLM's
phase split of a request's time, and its iteration tokens."""
from __future__ import annotations

import time

import pytest

from backend.inflight import Inflight, record_timings
from backend.metrics import StepMetrics
from engine import LLMEngine, SamplingParams
from engine.sampling_params import RequestOutputKind
from testing.tiny_model import make_tiny_model_dir

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))
    return LLMEngine(model=str(tiny), dtype="float32", num_kv_blocks=64, block_size=16,
                     max_model_len=256)


def serve(engine, prompt: str, params: SamplingParams) -> tuple[StepMetrics, list[int]]:
    """Runs one request to the end as the engine loop does; all steps' figures in one."""
    arrival = time.monotonic()
    request = Inflight("r", prompt, params, sender=None, build=lambda out: None, arrival=arrival)
    engine.add_request("r", prompt, params, arrival_time=arrival)
    step, iteration_tokens = StepMetrics(), []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        iteration_tokens.append(engine.last_step_num_tokens)
        for out in outputs:
            record_timings(request, out, step, time.monotonic())
    return step, iteration_tokens


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_finished_figures_count_every_token_once_whatever_the_output_kind(engine, kind):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                            output_kind=kind)
    step, iteration_tokens = serve(engine, f"Counting tokens {kind.name}", params)
    (finished,) = step.finished
    assert finished.finish_reason == "length"
    assert finished.num_generation_tokens == MAX_TOKENS
    assert step.max_generation_tokens == [MAX_TOKENS] and step.n_params == [1]
    assert finished.max_tokens_param == MAX_TOKENS
    # vLLM's phases: queued, then prefill to the first token, decode to the last.
    assert finished.prefill > 0 and finished.decode > 0
    assert finished.inference == pytest.approx(finished.prefill + finished.decode)
    assert finished.queued + finished.inference <= finished.e2e
    assert finished.mean_time_per_output_token == pytest.approx(finished.decode / (MAX_TOKENS - 1))
    assert len(step.ttft) == 1 and len(step.itl) == MAX_TOKENS - 1
    # Prompt tokens computed plus tokens sampled, over the request's steps.
    computed = finished.num_prompt_tokens - finished.num_cached_tokens
    assert step.prompt_computed == computed and step.prompt_cached == finished.num_cached_tokens
    assert sum(iteration_tokens) == computed + MAX_TOKENS


def test_n_sequences_finish_one_by_one_and_the_request_once(engine):
    params = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=MAX_TOKENS,
                            min_tokens=MAX_TOKENS, output_kind=RequestOutputKind.DELTA)
    step, _ = serve(engine, "Two sequences of the same prompt", params)
    assert [f.num_generation_tokens for f in step.finished] == [MAX_TOKENS, MAX_TOKENS]
    assert step.n_params == [2] and step.max_generation_tokens == [MAX_TOKENS]
