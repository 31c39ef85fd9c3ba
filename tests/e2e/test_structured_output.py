"""Structured outputs through the real server: vllm_backend's and the older key, streaming
and not, every output valid; a bad schema is INVALID_ARG naming the field. On a server of
its own: a spec over a limit is refused naming it, a request runs while others' grammars
compile, and the stub stops cleanly after structured outputs."""
from __future__ import annotations

import json
import threading

import pytest
import requests
import tritonclient.grpc as grpcclient

from engine import SamplingParams
from tests.e2e.triton_clients import infer_many, infer_one, llm_inputs, tensors_to_inputs
from tests.engine.structured_output.test_structured_output import SCHEMAS

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Once upon a time"]


def spec(name, key):
    schema = SCHEMAS[name].json_schema()
    # vllm_backend's clients send structured_outputs as JSON text inside the JSON.
    return {key: json.dumps({"json": schema}) if key == "structured_outputs" else {"json": schema}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_outputs_parse_and_validate(server, reference, stream):
    cases = [(name, key, sampling)
             for name in ("nested_object", "enum", "integer_range", "array")
             for key in ("structured_outputs", "guided_decoding")
             for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3})]
    outcomes = infer_many(server.grpc, "llm", [
        llm_inputs(PROMPTS[i % len(PROMPTS)], {**spec(name, key), **sampling, "max_tokens": 300},
                   stream=stream, exclude_input_in_output=True, return_finish_reason=True)
        for i, (name, key, sampling) in enumerate(cases)])
    for (name, key, sampling), outcome in zip(cases, outcomes):
        assert outcome.final and outcome.responses[-1]["finish_reason"][0].decode() == "stop"
        SCHEMAS[name].validate_json(outcome.text, strict=True)
        if stream:
            assert len(outcome.responses) > 1
    # The server's greedy constrained text is the in-process engine's.
    expected = reference.generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=300, structured_outputs={"json": SCHEMAS["nested_object"].json_schema()}))
    # A stream is not cleaned up as a whole text is (vLLM never cleans a stream): cleaned
    # as the tokenizer cleans, it is the whole text.
    tokenizer = reference.llm_engine.tokenizer
    served = outcomes[0].text
    if stream and getattr(tokenizer, "clean_up_tokenization_spaces", False):
        served = tokenizer.clean_up_tokenization(served)
    assert served == expected[0].outputs[0].text


def test_choice_and_regex_over_http_generate(server):
    for sampling, check in (({"guided_decoding": {"choice": ["red", "green"]}},
                             lambda t: t in ("red", "green")),
                            ({"structured_outputs": json.dumps({"regex": "[a-c]{3}[0-9]"})},
                             lambda t: len(t) == 4 and t[:3].strip("abc") == "" and t[3].isdigit())):
        body = {"text_input": "Pick:", "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({**sampling, "temperature": 1.0, "max_tokens": 20})}
        r = requests.post(f"{server.http}/v2/models/llm/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert check(r.json()["text_output"]), r.text


@pytest.mark.parametrize("sampling,fragment", [
    ({"guided_decoding": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"structured_outputs": json.dumps({"regex": "[a-"})}, "structured_outputs.regex"),
    ({"guided_decoding": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
])
def test_invalid_spec_is_invalid_arg(server, sampling, fragment):
    body = {"text_input": "hi", "sampling_parameters": json.dumps(sampling)}
    r = requests.post(f"{server.http}/v2/models/llm/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text  # INVALID_ARG
    assert fragment in r.json()["error"], r.text
    outcome = infer_one(server.grpc, "llm", llm_inputs("hi", sampling))
    assert outcome.error and fragment in outcome.error


# ---- compiles never block admission (issue 43) ---------------------------------------
# A server of its own (`llm` alone): the last test stops it and reads its log.

@pytest.fixture(scope="module")
def lone_server(tmp_path_factory, tiny_model_dir):
    from backend.repository_layout import copy_repository
    from backend.triton_server import REPO_ROOT
    from tests.e2e.shared import TINY_ENGINE_ARGS, running_server

    work = tmp_path_factory.mktemp("lone-llm")
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=["llm"],
                           params={"llm": {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS}})
    with running_server(repo, work, load=["llm"], timeout=300) as handle:
        yield handle, work / "tritonserver.log"


def generate(handle, sampling: dict) -> requests.Response:
    body = {"text_input": "Pick:", "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(sampling)}
    # Connection: close, so the graceful stop below waits for no idle connection.
    return requests.post(f"http://{handle.http_url}/v2/models/llm/generate", json=body,
                         timeout=120, headers={"Connection": "close"})


def test_a_700_deep_schema_is_refused_naming_the_limit(lone_server):
    from tests.engine.structured_output.test_limits import nested_text

    handle, _ = lone_server
    schema = nested_text(700)  # the issue's: 43 KB, 65.7 s to compile on Triton's thread
    r = generate(handle, {"structured_outputs": json.dumps({"json": schema}), "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert "over the limit of 64 (max_json_schema_depth)" in r.json()["error"], r.text
    r = generate(handle, {"guided_decoding": {"choice": [str(i) for i in range(20_000)]}})
    assert r.status_code == 400 and "(max_choices)" in r.json()["error"], r.text


def test_a_bystander_finishes_while_grammars_compile(lone_server):
    """Three constrained requests whose schemas (56 KB, salted so none is cached) take
    about a second each to compile, then a plain one: the plain one is admitted and
    finishes before any constrained one has produced a token. Before, their compiles ran
    on Triton's execute thread and the plain request was not even read until they ended."""
    handle, _ = lone_server
    events: list[tuple[str, bool]] = []
    errors: list[str] = []
    done = threading.Semaphore(0)

    def callback(result, error):
        if error is not None:
            errors.append(str(error))
            done.release()
            return
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        events.append((response.id, final))
        if final:
            done.release()

    schemas = [json.dumps({"type": "object", "properties": {
        f"s{salt}_{i}": {"type": "string"} for i in range(2000)}}) for salt in range(3)]
    assert all(60_000 < len(schema) <= 65536 for schema in schemas)  # max_json_schema_bytes
    slow = [{"structured_outputs": json.dumps({"json": schema}), "max_tokens": 4}
            for schema in schemas]
    plain = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
    client = grpcclient.InferenceServerClient(handle.grpc_url)
    client.start_stream(callback=callback)
    try:
        for rid, sampling in [*((f"slow{i}", s) for i, s in enumerate(slow)), ("plain", plain)]:
            client.async_stream_infer("llm", tensors_to_inputs(llm_inputs(
                "Pick:", sampling, stream=True, exclude_input_in_output=True)),
                request_id=rid, enable_empty_final_response=True)
        for _ in range(4):
            assert done.acquire(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    assert not errors, errors
    first_slow = next(i for i, (rid, _) in enumerate(events) if rid.startswith("slow"))
    assert ("plain", True) in events[:first_slow], events
    assert {rid for rid, final in events if final} == {"slow0", "slow1", "slow2", "plain"}


def test_the_stub_exits_cleanly_after_structured_outputs(lone_server):
    """A graceful stop after a structured-output request: the `llm` stub used to segfault
    in Py_FinalizeEx (Metric::SaveToSharedMemory) while tritonserver exited 0."""
    handle, log = lone_server
    r = generate(handle, {"guided_decoding": {"choice": ["red", "green"]}, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["text_output"] in ("red", "green"), r.text
    handle.stop()
    assert handle.process.returncode == 0
    text = log.read_text(errors="replace")
    assert "successfully unloaded 'llm'" in text
    assert "Segfault encountered" not in text and "Signal (11)" not in text
