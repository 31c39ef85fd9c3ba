"""multi_lora.json as vllm_backend reads it, and lora_name in a request: found in
sampling_parameters or HTTP generate's parameters, resolved against the file's names."""
import json

import numpy as np
import pytest

from backend.multi_lora import read_multi_lora, resolve_lora_name
from backend.request_parsing import InvalidRequest, parse_llm_request


def write(folder, data):
    (folder / "multi_lora.json").write_text(data if isinstance(data, str) else json.dumps(data))


def test_names_map_to_folders_numbered_in_file_order(tmp_path):
    write(tmp_path, {"alpaca": "/weights/loras/alpaca-lora-7b", "bactrian": "loras/bactrian"})
    adapters = read_multi_lora(tmp_path)
    assert list(adapters) == ["alpaca", "bactrian"]
    assert adapters["alpaca"].lora_int_id == 1 and adapters["bactrian"].lora_int_id == 2
    assert adapters["alpaca"].lora_path == "/weights/loras/alpaca-lora-7b"
    # Relative to the version folder, wherever the server was started.
    assert adapters["bactrian"].lora_path == str(tmp_path / "loras/bactrian")


@pytest.mark.parametrize("data,fragment", [
    (None, "enable_lora is true but .*multi_lora.json does not exist"),
    ('{"a": ', "not readable as JSON"),
    ([], "non-empty JSON object"),
    ({}, "non-empty JSON object"),
    ({"a": 3}, "adapter 'a' must map to a folder path"),
])
def test_bad_files_are_refused_naming_the_problem(tmp_path, data, fragment):
    if data is not None:
        write(tmp_path, data)
    with pytest.raises(ValueError, match=fragment):
        read_multi_lora(tmp_path)


def test_an_unknown_name_is_refused_naming_it(tmp_path):
    """Mirrors vllm_backend's L0_multi_gpu_vllm/multi_lora test_vllm_not_supported_lora and
    its not-enabled case, which compare the error message whole: vllm_backend's texts, the
    adapters in multi_lora.json's order."""
    write(tmp_path, {"sheep": "/s", "doll": "/d"})
    adapters = read_multi_lora(tmp_path)
    assert resolve_lora_name(adapters, "doll").lora_name == "doll"
    with pytest.raises(ValueError) as unknown:
        resolve_lora_name(adapters, "llama")
    assert str(unknown.value) == "LoRA llama is not supported, we currently support ['sheep', 'doll']"
    with pytest.raises(ValueError) as off:
        resolve_lora_name(None, "sheep")
    assert str(off.value) == "LoRA feature is not enabled."


def prompt_tensors(sampling=None):
    out = {"text_input": np.array([b"hi"], dtype=np.object_)}
    if sampling is not None:
        out["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    return out


def test_lora_name_rides_in_sampling_parameters_or_request_parameters():
    parsed = parse_llm_request(prompt_tensors({"max_tokens": "4", "lora_name": "alpaca"}))
    assert parsed.lora_name == "alpaca" and parsed.params.max_tokens == 4
    http = parse_llm_request(prompt_tensors(), json.dumps({"lora_name": "bactrian"}))
    assert http.lora_name == "bactrian"
    assert parse_llm_request(prompt_tensors({"lora_name": None})).lora_name is None
    assert parse_llm_request(prompt_tensors({})).lora_name is None
    with pytest.raises(InvalidRequest, match="lora_name must be a non-empty string"):
        parse_llm_request(prompt_tensors({"lora_name": 3}))


def test_token_model_takes_lora_name_as_an_input():
    from backend.token_request_parsing import parse_token_request

    inputs = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32),
              "request_output_len": np.array([[8]], dtype=np.int32)}
    assert parse_token_request(inputs).lora_name is None
    named = {**inputs, "lora_name": np.array([[b"alpaca"]], dtype=np.object_)}
    assert parse_token_request(named).lora_name == "alpaca"
    # An ensemble client that fills every input sends "" for the base model.
    empty = {**inputs, "lora_name": np.array([[b""]], dtype=np.object_)}
    assert parse_token_request(empty).lora_name is None


def test_config_pbtxt_parameter_lora_modules(tmp_path):
    from backend.config_params import split_parameters

    config, options = split_parameters({"enable_lora": "true",
                                        "lora_modules": "sql=/loras/sql chat=rel/chat"})
    assert config.lora.enable_lora and options.lora_modules
    adapters = read_multi_lora(tmp_path, options.lora_modules)
    assert [(a.lora_name, a.lora_int_id, a.lora_path) for a in adapters.values()] == [
        ("sql", 1, "/loras/sql"), ("chat", 2, str(tmp_path / "rel/chat"))]
    with pytest.raises(ValueError, match="expected name=path entries, got 'oops'"):
        read_multi_lora(tmp_path, "sql=/a oops")
    with pytest.raises(ValueError, match="'sql' is listed twice"):
        read_multi_lora(tmp_path, "sql=/a sql=/b")
    write(tmp_path, {"x": "/x"})
    with pytest.raises(ValueError, match="adapters are given twice"):
        read_multi_lora(tmp_path, "sql=/a")
