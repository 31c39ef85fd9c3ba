"""vllm_backend model folders on a real tritonserver, with only the backend line changed
to `tle` (its own server, explicit model control, models loaded one test at a time).

- vllm_model: vllm_backend's current sample (config.pbtxt: backend + instance_group;
  model.json: model, disable_log_requests, gpu_memory_utilization, enforce_eager) loads
  with an auto-completed config and answers vllm_backend's client shapes;
  vllm_model_v1: its older sample, which declares some tensors itself (`stream` required);
  default_model: the same without `model`: the embedded SmolLM2.
- bad_*: model.json errors fail that model's load naming the key; others still load.
- pbtxt_wins: a config.pbtxt parameter beats model.json's value, seen in
  vllm:cache_config_info's labels.
- legacy_llm: a `backend: "python"` folder with 1/model.py, as this project shipped before.
- hub_id: model.json's `model` a Hugging Face id, found in a local HF cache (HF_HUB_CACHE,
  HF_HUB_OFFLINE) as vllm_backend's sample names one.
- bos_chat: a tokenizer that adds a BOS its chat template also writes (Llama-3's way)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from backend.triton_server import TritonServer
from tests.e2e.shared import TINY_ENGINE_ARGS, assert_loads_fail, loaded, running_server
from tests.e2e.triton_clients import infer_one, llm_inputs
from testing.bos_tokenizer import make_bos_tokenizer_dir
from testing.hf_cache import add_to_hf_cache

pytestmark = pytest.mark.slow

SAMPLE_CONFIG = """backend: "tle"

# The usage of device is deferred to the vLLM engine
instance_group [
  {
    count: 1
    kind: KIND_MODEL
  }
]
"""
OLDER_SAMPLE_CONFIG = """name: "vllm_model_v1"
backend: "tle"
max_batch_size: 0
model_transaction_policy {
  decoupled: True
}
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] },
  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_MODEL } ]
"""
LEGACY_CONFIG = """backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
LEGACY_MODEL_PY = "from backend.llm_model import LLMModel as TritonPythonModel  # noqa: F401\n"
SAMPLE_JSON = {"disable_log_requests": True, "gpu_memory_utilization": 0.5, "enforce_eager": True}
PBTXT_BLOCK_SIZE, PBTXT_BLOCKS = 32, 40
HUB_ID = "acme/tiny-llama"
# model name -> (model.json text, fragment the load error must contain)
BAD = {
    "bad_unknown": ({"max_num_seq": 4}, "'max_num_seq'"),
    "bad_unsupported": ({"pipeline_parallel_size": 2}, "'pipeline_parallel_size'"),
    "bad_value": ({"max_num_seqs": "lots"}, "'max_num_seqs'"),
    "bad_json": ('{"max_num_seqs": 4,', "model.json"),
}


def _parameters(params: dict[str, str]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                   for k, v in params.items())


def _model(repo: Path, name: str, config: str, model_json: dict | str | None = None,
           model_py: str | None = None) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    if model_json is not None:
        text = model_json if isinstance(model_json, str) else json.dumps(model_json, indent=2)
        (repo / name / "1" / "model.json").write_text(text)
    if model_py is not None:
        (repo / name / "1" / "model.py").write_text(model_py)


@pytest.fixture(scope="module")
def dropin_server(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("triton-dropin")
    repo = work / "models"
    tiny = str(tiny_model_dir)
    _model(repo, "vllm_model", SAMPLE_CONFIG, {"model": tiny, **SAMPLE_JSON})
    _model(repo, "vllm_model_v1", OLDER_SAMPLE_CONFIG, {"model": tiny, **SAMPLE_JSON})
    _model(repo, "default_model", SAMPLE_CONFIG, SAMPLE_JSON)
    for name, (model_json, _) in BAD.items():
        _model(repo, name, SAMPLE_CONFIG, model_json if isinstance(model_json, str)
               else {"model": tiny, **model_json})
    _model(repo, "pbtxt_wins", SAMPLE_CONFIG + _parameters(
        {"block_size": PBTXT_BLOCK_SIZE, "num_kv_blocks": PBTXT_BLOCKS, "REPORT_CUSTOM_METRICS": "true"}),
        {"model": tiny, "block_size": 8, "num_gpu_blocks_override": 100, "max_model_len": 512,
         "enforce_eager": True, "disable_log_requests": True})
    _model(repo, "legacy_llm", LEGACY_CONFIG + _parameters({"model": tiny, **TINY_ENGINE_ARGS}),
           model_py=LEGACY_MODEL_PY)
    hub = work / "hf-hub"
    add_to_hf_cache(hub, HUB_ID, tiny_model_dir)
    _model(repo, "hub_id", SAMPLE_CONFIG, {"model": HUB_ID, **SAMPLE_JSON})
    _model(repo, "hub_id_missing", SAMPLE_CONFIG, {"model": "acme/not-cached", **SAMPLE_JSON})
    _model(repo, "bos_chat", SAMPLE_CONFIG, {"model": tiny, "tokenizer": str(make_bos_tokenizer_dir(
        work / "bos-tokenizer")), **SAMPLE_JSON})
    with pytest.MonkeyPatch.context() as env:
        # The server's environment: huggingface_hub in its model processes reads these.
        env.setenv("HF_HUB_CACHE", str(hub))
        env.setenv("HF_HUB_OFFLINE", "1")
        with running_server(repo, work, timeout=300) as handle:
            yield handle


def _client(server: TritonServer) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def test_sample_folder_loads_auto_completed_and_answers_vllm_backend_clients(dropin_server):
    client = _client(dropin_server)
    with loaded(client, "vllm_model"):
        config = client.get_model_config("vllm_model", as_json=True)["config"]
        assert config["backend"] == "tle" and config["model_transaction_policy"]["decoupled"]
        assert int(config.get("max_batch_size", 0)) == 0
        inputs = {i["name"]: i for i in config["input"]}
        # text_input is optional since prompt_token_ids may carry the prompt instead.
        assert inputs["text_input"]["optional"] and inputs["stream"]["optional"]
        assert inputs["prompt_token_ids"]["data_type"] == "TYPE_INT64"
        assert {"sampling_parameters", "exclude_input_in_output", "return_finish_reason",
                "return_logprobs", "priority"} <= set(inputs)
        assert {o["name"] for o in config["output"]} >= {"text_output", "finish_reason", "logprobs"}

        url, prompt, sampling = dropin_server.grpc_url, "The capital of France is", {"max_tokens": 8,
                                                                                     "temperature": 0}
        full = infer_one(url, "vllm_model", llm_inputs(prompt, sampling))
        alone = infer_one(url, "vllm_model", llm_inputs(prompt, sampling, exclude_input_in_output=True))
        streamed = infer_one(url, "vllm_model", llm_inputs(prompt, sampling, stream=True))
        assert full.error is None and alone.error is None and streamed.error is None
        assert full.text == prompt + alone.text and alone.text
        assert len(streamed.responses) > 1 and streamed.text == alone.text

        flags = {name: True for name in ("return_finish_reason", "return_num_input_tokens",
                                         "return_num_output_tokens", "return_cumulative_logprob",
                                         "return_logprobs")}
        # return_logprobs gives null without a "logprobs" sampling parameter (vllm_backend).
        bare = infer_one(url, "vllm_model", llm_inputs(prompt, sampling, **flags)).responses[-1]
        assert json.loads(bare["logprobs"].reshape(-1)[0]) is None
        out = infer_one(url, "vllm_model",
                        llm_inputs(prompt, {**sampling, "logprobs": 0}, **flags)).responses[-1]
        assert out["finish_reason"].reshape(-1)[0] == b"length"
        assert int(out["num_output_tokens"].reshape(-1)[0]) == 8
        assert int(out["num_input_tokens"].reshape(-1)[0]) > 0
        assert float(out["cumulative_logprob"].reshape(-1)[0]) <= 0
        logprobs = json.loads(out["logprobs"].reshape(-1)[0])
        assert len(logprobs) == 8
        # vllm_backend's items; greedy, so each sampled token ranks first.
        for position in logprobs:
            (entry,) = position.values()
            assert set(entry) == {"logprob", "rank", "decoded_token"} and entry["rank"] == 1

        # vllm_backend's optional `image` input: declared, and refused for that request only.
        assert inputs["image"] == {**inputs["image"], "data_type": "TYPE_STRING", "dims": ["-1"],
                                   "optional": True}
        with_image = {**llm_inputs(prompt, sampling),
                      "image": np.array([b"aGVsbG8="], dtype=np.object_)}
        refused = infer_one(url, "vllm_model", with_image)
        assert refused.error is not None and "text only" in refused.error
        # INVALID_ARG: 400 on HTTP generate, whose JSON keys are the inputs.
        http_image = requests.post(f"http://{dropin_server.http_url}/v2/models/vllm_model/generate",
                                   json={"text_input": prompt, "image": ["aGVsbG8="],
                                         "parameters": sampling}, timeout=60)
        assert http_image.status_code == 400 and "text only" in http_image.text
        after = infer_one(url, "vllm_model", llm_inputs(prompt, sampling))
        assert after.error is None and after.text == full.text

        http = requests.post(f"http://{dropin_server.http_url}/v2/models/vllm_model/generate",
                             json={"text_input": prompt, "parameters": sampling}, timeout=60)
        assert http.status_code == 200 and http.json()["text_output"] == full.text


def test_older_sample_keeps_its_declared_tensors(dropin_server):
    client = _client(dropin_server)
    with loaded(client, "vllm_model_v1"):
        inputs = {i["name"]: i for i in client.get_model_config("vllm_model_v1", as_json=True)
                  ["config"]["input"]}
        assert not inputs["stream"].get("optional")  # declared required: kept as declared
        assert "return_finish_reason" in inputs  # not declared: completed
        outcome = infer_one(dropin_server.grpc_url, "vllm_model_v1",
                            llm_inputs("Hello", {"max_tokens": 4, "temperature": 0}, stream=True))
        assert outcome.error is None and outcome.text


def test_model_json_without_model_serves_the_embedded_default(dropin_server):
    client = _client(dropin_server)
    with loaded(client, "default_model"):
        outcome = infer_one(dropin_server.grpc_url, "default_model",
                            llm_inputs("The capital of France is", {"max_tokens": 8, "temperature": 0},
                                       exclude_input_in_output=True))
        assert outcome.error is None and "Paris" in outcome.text


def test_model_json_errors_fail_that_load_naming_the_key(dropin_server):
    client = _client(dropin_server)
    assert_loads_fail(client, {name: [fragment] for name, (_, fragment) in BAD.items()})
    with loaded(client, "pbtxt_wins"):
        assert client.is_model_ready("pbtxt_wins")


def _metric_lines(server: TritonServer, family: str, model: str) -> list[str]:
    text = requests.get(server.metrics_url, timeout=10).text
    return [line for line in text.splitlines()
            if line.startswith(family + "{") and f'model="{model}"' in line]


def test_config_pbtxt_beats_model_json_and_cache_config_info_is_exported(dropin_server):
    client = _client(dropin_server)
    with loaded(client, "pbtxt_wins"):
        deadline = time.monotonic() + 10
        while not (info := _metric_lines(dropin_server, "vllm:cache_config_info", "pbtxt_wins")):
            assert time.monotonic() < deadline, "vllm:cache_config_info not exported"
            time.sleep(0.2)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', info[0]))
        assert labels["block_size"] == str(PBTXT_BLOCK_SIZE)  # model.json said 8
        assert labels["num_gpu_blocks"] == str(PBTXT_BLOCKS)  # model.json said 100
        assert info[0].endswith(" 1")
        outcome = infer_one(dropin_server.grpc_url, "pbtxt_wins",
                            llm_inputs("Hello", {"max_tokens": 4, "temperature": 0}))
        assert outcome.error is None and outcome.text
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                      "vllm:kv_cache_usage_perc"):
            assert _metric_lines(dropin_server, gauge, "pbtxt_wins"), gauge
        log = dropin_server.log_path.read_text(errors="replace")
        assert "pbtxt_wins: model.json: accepted and ignored" in log and "disable_log_requests" in log


def test_model_py_folders_keep_working(dropin_server):
    client = _client(dropin_server)
    with loaded(client, "legacy_llm"):
        outcome = infer_one(dropin_server.grpc_url, "legacy_llm",
                            llm_inputs("Hello", {"max_tokens": 4, "temperature": 0}, stream=True))
        assert outcome.error is None and outcome.text


def test_model_json_naming_a_hugging_face_id_loads_from_the_local_cache(dropin_server):
    client = _client(dropin_server)
    with loaded(client, "hub_id"), loaded(client, "vllm_model"):
        prompt, sampling = "The capital of France is", {"max_tokens": 6, "temperature": 0}
        via_id = infer_one(dropin_server.grpc_url, "hub_id", llm_inputs(prompt, sampling))
        via_path = infer_one(dropin_server.grpc_url, "vllm_model", llm_inputs(prompt, sampling))
        assert via_id.error is None and via_id.text == via_path.text  # the same tiny model
    # Not cached, and HF_HUB_OFFLINE: the load fails naming the id.
    assert_loads_fail(client, {"hub_id_missing": ["'acme/not-cached'", "HF_HUB_OFFLINE"]})


def test_chat_prompts_get_one_bos(dropin_server):
    """The OpenAI route's chat rendering and request, sent to the `llm` model as its
    client sends them: the BOS the template wrote is the only one."""
    from transformers import AutoTokenizer

    from openai_frontend.chat import render_chat
    from openai_frontend.mapping import chat_request
    from openai_frontend.protocol import ChatCompletionRequest

    tokenizer = AutoTokenizer.from_pretrained(dropin_server.model_repository.parent / "bos-tokenizer")
    messages = [{"role": "user", "content": "hello there"}]
    prompt = render_chat(tokenizer, messages)
    triton = chat_request(ChatCompletionRequest(model="bos_chat", messages=messages), prompt)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert expected.count(tokenizer.bos_token_id) == 1
    with loaded(_client(dropin_server), "bos_chat"):
        def prompt_tokens(sampling: dict) -> int:
            out = infer_one(dropin_server.grpc_url, "bos_chat",
                            llm_inputs(prompt, {**sampling, "max_tokens": 1},
                                       return_num_input_tokens=True))
            assert out.error is None, out.error
            return int(out.responses[-1]["num_input_tokens"].reshape(-1)[0])

        assert prompt_tokens(triton.sampling) == len(expected)
        # A text prompt still gets the tokenizer's BOS, here a second one.
        assert prompt_tokens({}) == len(expected) + 1
