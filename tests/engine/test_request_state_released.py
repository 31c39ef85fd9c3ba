"""A served engine sees an endless stream of request ids: whatever it keeps per request
must be gone once each one finishes or is aborted, or memory creeps up over a soak
(issue 28). The timed soak's mix on the tiny model: n > 1, logprobs, stop strings,
seeded sampling, and a quarter aborted mid-stream."""
import random

import pytest

from engine import LLMEngine, SamplingParams
from engine.sampling_params import RequestOutputKind
from testing.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return LLMEngine(model=str(make_tiny_model_dir(tmp_path_factory.mktemp("llama"), seed=5)),
                     dtype="float32", num_kv_blocks=64, block_size=16, max_num_seqs=8,
                     max_model_len=256)


def per_request_state(engine: LLMEngine) -> dict[str, int]:
    processor, scheduler = engine.output_processor, engine.scheduler
    state = engine.runner.sampler.state
    return {"sequences": len(processor._sequences), "clients": len(processor._clients),
            "families": len(processor.parallel._families),
            "parents": len(processor.parallel._parent_of),
            "scheduler": len(scheduler.requests),
            "kv": len(scheduler.kv_cache_manager.req_to_blocks),
            "kv_ids": len(scheduler.kv_cache_manager.req_to_block_ids),
            "kv_cached": len(scheduler.kv_cache_manager.num_cached_blocks),
            "generators": len(state.generators), "prompt_ids": len(state.prompt_ids),
            "output_ids": len(state.output_ids)}


def params_for(rng: random.Random, i: int) -> SamplingParams:
    extra = [{"n": 2, "temperature": 1.0, "seed": i}, {"logprobs": 2},
             {"stop": ["a", "e"]}, {"temperature": 0.8, "seed": i, "repetition_penalty": 1.2},
             {}][i % 5]
    params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, **extra)
    params.output_kind = RequestOutputKind.DELTA
    return params


def test_nothing_per_request_outlives_finished_and_aborted_requests(engine):
    rng = random.Random(0)
    active: dict[str, int | None] = {}  # id -> abort after this many tokens
    seen: dict[str, int] = {}
    aborted = 0
    for i in range(60):
        rid = f"soak-{i}"
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(4, 40))]
        engine.add_request(rid, prompt, params_for(rng, i))
        active[rid] = rng.randint(1, 4) if i % 4 == 0 else None
        seen[rid] = 0
        while len(active) >= 6 or (i == 59 and active):
            for out in engine.step():
                seen[out.request_id] += len(out.outputs[0].delta_token_ids)
                if out.finished:
                    active.pop(out.request_id, None)
            due = [r for r, after in active.items() if after is not None and seen[r] >= after]
            if due:
                engine.abort_request(due)
                aborted += len(due)
                for r in due:
                    del active[r]
    assert not engine.has_unfinished_requests() and aborted >= 10
    engine.step()  # as the engine loop's next step: hands the runner the finished ids
    assert per_request_state(engine) == dict.fromkeys(per_request_state(engine), 0)
