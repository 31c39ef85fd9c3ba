"""TensorRT-LLM-style clients: `ensemble` (text) and `tensorrt_llm` (token ids)."""
from __future__ import annotations

import numpy as np
import pytest
import requests

from tests.e2e.shared import PROMPTS, greedy
from tests.e2e.triton_clients import ensemble_inputs, infer_many, infer_one

pytestmark = pytest.mark.slow


def test_ensemble_text_equals_engine(server, reference):
    expected = reference.generate(PROMPTS, greedy(24))
    outcomes = infer_many(server.grpc, "ensemble", [
        ensemble_inputs(p, 24, exclude_input_in_output=np.array([[True]])) for p in PROMPTS])
    assert [o.text for o in outcomes] == [e.outputs[0].text for e in expected]


def test_ensemble_stream_concatenates_to_engine_text(server, reference):
    # Random weights emit plenty of byte-fallback pieces of multi-byte characters:
    # the concatenated stream must still be exactly the engine's text.
    expected = reference.generate(PROMPTS, greedy(48))
    outcomes = infer_many(server.grpc, "ensemble", [ensemble_inputs(p, 48, stream=True) for p in PROMPTS])
    for outcome, exp in zip(outcomes, expected):
        assert "\ufffd" not in outcome.text or "\ufffd" in exp.outputs[0].text
        assert outcome.text == exp.outputs[0].text
        assert len(outcome.responses) > 1


def test_trtllm_format_min_length_is_exact(server, reference):
    expected = reference.generate(PROMPTS[:4], greedy(20, min_tokens=20))
    outcomes = infer_many(server.grpc, "ensemble", [
        ensemble_inputs(p, 20, stream=True, min_length=np.array([[20]], dtype=np.int32),
                        temperature=np.array([[0.0]], dtype=np.float32),
                        beam_width=np.array([[1]], dtype=np.int32)) for p in PROMPTS[:4]])
    assert [o.text for o in outcomes] == [e.outputs[0].text for e in expected]
    tokenizer = reference.get_tokenizer()
    ids = infer_many(server.grpc, "tensorrt_llm", [{
        "input_ids": np.array([tokenizer.encode(p)], dtype=np.int32),
        "request_output_len": np.array([[20]], dtype=np.int32),
        "min_length": np.array([[20]], dtype=np.int32),
        "streaming": np.array([[True]])} for p in PROMPTS[:4]])
    for outcome, exp in zip(ids, expected):
        streamed = [int(t) for r in outcome.responses for t in r["output_ids"].reshape(-1)]
        assert streamed == exp.outputs[0].token_ids and len(streamed) == 20


def test_ensemble_http_generate(server, reference):
    expected = reference.generate([PROMPTS[3]], greedy(16))[0].outputs[0].text
    r = requests.post(f"{server.http}/v2/models/ensemble/generate",
                      json={"text_input": PROMPTS[3], "max_tokens": 16}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == PROMPTS[3] + expected  # TensorRT-LLM default: input included


@pytest.mark.parametrize("extra,fragment", [
    ({"beam_width": np.array([[2]], dtype=np.int32)}, "beam_width"),
    ({"bad_words": np.array([[b"the"]], dtype=np.object_)}, "bad_words"),
])
def test_ensemble_rejects_unsupported(server, extra, fragment):
    outcome = infer_one(server.grpc, "ensemble", ensemble_inputs(PROMPTS[0], 8, **extra))
    assert outcome.error and fragment in outcome.error


def test_ensemble_stop_words(server, reference):
    # As in TensorRT-LLM, preprocessing turns each stop word into ids and the engine stops
    # when the output ends with those ids. Pick two output tokens whose text tokenizes
    # back to the same ids, first seen there.
    tok = reference.get_tokenizer()
    ids = reference.generate([PROMPTS[2]], greedy(30))[0].outputs[0].token_ids
    k = next(k for k in range(2, len(ids) - 2)
             if tok.encode(tok.decode(ids[k:k + 2]), add_special_tokens=False) == ids[k:k + 2]
             and all(ids[j:j + 2] != ids[k:k + 2] for j in range(k)))
    stop = tok.decode(ids[k:k + 2])
    outcome = infer_one(server.grpc, "ensemble", ensemble_inputs(
        PROMPTS[2], 30, exclude_input_in_output=np.array([[True]]),
        stop_words=np.array([[stop.encode()]], dtype=np.object_)))
    assert outcome.error is None
    # The stop word stays in the output (TensorRT-LLM's convention); nothing after it.
    expected = reference.generate([PROMPTS[2]], greedy(30, stop_token_sequences=[ids[k:k + 2]]))
    assert expected[0].outputs[0].token_ids == ids[:k + 2]
    assert outcome.text == expected[0].outputs[0].text and stop in outcome.text
