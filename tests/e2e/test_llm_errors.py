"""Bad requests, engine failures: one clear FINAL error each, nobody else affected."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import requests

from tests.e2e.shared import PROMPTS, greedy
from tests.e2e.triton_clients import OpenStream, infer_many, infer_one, llm_inputs

pytestmark = pytest.mark.slow

# (case, JSON body for HTTP generate, expected fragment of the error message)
BAD_HTTP = [
    ("bad JSON", {"text_input": "hi", "sampling_parameters": "{max_tokens: 3"}, "not valid JSON"),
    ("not an object", {"text_input": "hi", "sampling_parameters": "[1, 2]"}, "JSON object"),
    ("unknown key", {"text_input": "hi", "parameters": {"max_tokenz": 3}}, "max_tokenz"),
    ("negative temperature", {"text_input": "hi", "parameters": {"temperature": -1}}, "temperature"),
    ("top_p out of range", {"text_input": "hi", "sampling_parameters": '{"top_p": "1.5"}'}, "top_p"),
    ("non-numeric", {"text_input": "hi", "sampling_parameters": '{"max_tokens": "many"}'}, "max_tokens"),
    ("min above max", {"text_input": "hi", "parameters": {"max_tokens": 2, "min_tokens": 5}}, "min_tokens"),
    ("bad boolean", {"text_input": "hi", "parameters": {"ignore_eos": "maybe"}}, "ignore_eos"),
    ("stream without exclude", {"text_input": "hi", "stream": True, "exclude_input_in_output": False},
     "exclude_input_in_output"),
    ("prompt over max_model_len", {"text_input": "hello " * 600}, "max_model_len"),
    ("empty prompt", {"text_input": ""}, "empty"),
]


@pytest.mark.parametrize("case,body,fragment", BAD_HTTP, ids=[c[0] for c in BAD_HTTP])
def test_bad_request_gets_invalid_arg(server, case, body, fragment):
    r = requests.post(f"{server.http}/v2/models/llm/generate", json=body, timeout=60)
    assert r.status_code == 400, (case, r.status_code, r.text)  # INVALID_ARG
    assert fragment in r.json()["error"], r.text


def test_triton_rejects_missing_input_and_wrong_dtype(server):
    r = requests.post(f"{server.http}/v2/models/llm/generate", json={"parameters": {"max_tokens": 3}},
                      timeout=60)
    assert r.status_code == 400 and "text_input" in r.json()["error"]
    wrong = {"text_input": np.array([1], dtype=np.int32)}
    outcome = infer_one(server.grpc, "llm", wrong)
    assert outcome.error and "text_input" in outcome.error


# Pass parsing, then are refused by the engine's own checks (INVALID_ARG, field named).
ENGINE_REFUSED = [({"logprobs": 21}, "logprobs"), ({"stop_token_ids": [10**6]}, "stop_token_ids")]
# These used to pass validation and then fail the whole engine step ("engine step failed"
# for every request in it, prefix cache reset): now refused by name while parsing...
NON_FINITE = [({"seed": 2**64}, "seed"),
              ({"temperature": float("inf"), "min_tokens": 4, "top_p": 0.9}, "temperature"),
              ({"repetition_penalty": "nan"}, "repetition_penalty")]
# ... or served: values at float32's edges that the sampler handles.
FLOAT32_EDGES = [{"top_p": 1e-46}, {"temperature": 1e300, "min_tokens": 4, "top_p": 0.9},
                 {"repetition_penalty": 1e-300, "temperature": 0.5},
                 {"seed": 2**64 - 1, "temperature": 1}]


def test_bad_requests_do_not_disturb_good_ones(server, reference):
    expected = reference.generate(PROMPTS[:4], greedy(48))
    results = {}
    edges = [llm_inputs(PROMPTS[5], {**edge, "max_tokens": 24}, stream=True)
             for edge in FLOAT32_EDGES]

    def good():
        # The edge cases ride in the same stream, so they share engine steps with the
        # greedy requests; infer_many fails on any error.
        results["good"] = infer_many(server.grpc, "llm", [
            llm_inputs(p, {"temperature": 0, "max_tokens": 48}, stream=True) for p in PROMPTS[:4]
        ] + edges)

    thread = threading.Thread(target=good)
    thread.start()
    bad = [infer_one(server.grpc, "llm", llm_inputs("hi", sampling))
           for sampling in ({"temperature": "hot"}, {"top_k": -5}, {"stop": 7}, {"nope": 1})] * 2
    bad.append(infer_one(server.grpc, "llm", {
        "text_input": np.array([b"hi"], dtype=np.object_),
        "sampling_parameters": np.array([b"{oops"], dtype=np.object_)}))
    named = [(infer_one(server.grpc, "llm", llm_inputs(PROMPTS[4], sampling)), field)
             for sampling, field in ENGINE_REFUSED + NON_FINITE]
    thread.join(timeout=120)
    assert all(b.error and not b.responses for b in bad), [b.error for b in bad]
    for outcome, field in named:
        assert outcome.error and not outcome.responses and field in outcome.error, outcome.error
        assert "engine step failed" not in outcome.error
    outputs = results["good"]
    assert [o.text for o in outputs[:4]] == [e.outputs[0].text for e in expected]
    assert all(o.final for o in outputs[4:])
    # top_p below float32's resolution keeps the top token only: greedy.
    assert outputs[4].text == reference.generate([PROMPTS[5]], greedy(24))[0].outputs[0].text


def test_engine_failure_errors_running_requests_only_and_model_recovers(server, reference):
    from tests.e2e.shared import FAILURE_STEP, FAULTY_MAX_NUM_SEQS

    # The faulty copy raises inside its engine step FAILURE_STEP once, and runs at most
    # FAULTY_MAX_NUM_SEQS requests. Three requests sent within a millisecond: two are
    # RUNNING when the failure hits and must get its error; the third is WAITING and
    # must then be served in full. Any request that never ends fails the test.
    assert FAULTY_MAX_NUM_SEQS == 2 and FAILURE_STEP < 40
    sampling = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    expected = reference.generate(PROMPTS[:3], greedy(40, ignore_eos=True))
    streams = [OpenStream(server.grpc) for _ in range(3)]
    for stream, prompt in zip(streams, PROMPTS[:3]):
        stream.send("llm_faulty", llm_inputs(prompt, sampling, stream=True))
    hung = [i for i, stream in enumerate(streams) if not stream.wait(timeout=120)]
    assert not hung, f"requests {hung} never ended"
    failed = [s for s in streams if s.outcome.error]
    served = [(i, s) for i, s in enumerate(streams) if not s.outcome.error]
    assert len(failed) == 2 and len(served) == 1, [s.outcome.error for s in streams]
    for stream in failed:
        assert "engine step failed" in stream.outcome.error, stream.outcome.error
        assert len(stream.outcome.responses) < 40
    index, survivor = served[0]
    assert survivor.outcome.text == expected[index].outputs[0].text
    # It was queued until the failure: sent while the two ran (a late callback only makes
    # their last token later), and not running when the failure hit, or it would have got
    # the error too (checked above). Its first token is not compared with their last: each
    # stream has its own channel and callback thread, and on a busy host one stream's
    # callbacks ran 46 ms behind another's. Their first tokens are ~FAILURE_STEP steps
    # earlier, far outside that.
    last_token_of_failed = max(s.last_response_at for s in failed)
    assert survivor.sent_at < last_token_of_failed
    assert max(s.first_response_at for s in failed) < survivor.first_response_at
    expected = reference.generate(PROMPTS[:3], greedy(30))
    again = infer_many(server.grpc, "llm_faulty", [
        llm_inputs(p, {"temperature": 0, "max_tokens": 30}, stream=True) for p in PROMPTS[:3]])
    assert [o.text for o in again] == [e.outputs[0].text for e in expected]
    r = requests.post(f"{server.http}/v2/models/llm_faulty/generate",
                      json={"text_input": PROMPTS[0], "parameters": {"temperature": 0, "max_tokens": 30,
                                                                    "exclude_input_in_output": True}},
                      timeout=60)
    assert r.status_code == 200 and r.json()["text_output"] == expected[0].outputs[0].text
    assert requests.get(f"{server.http}/v2/models/llm_faulty/ready", timeout=10).status_code == 200
