"""Model load failures through a real tritonserver: a bad config.pbtxt value, an engine
that cannot be built or a model no path runs fails that model's load with a message
naming the problem, and the server stays up and loads a good model afterwards."""
from __future__ import annotations

import pytest

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT
from tests.e2e.shared import TINY_ENGINE_ARGS, assert_loads_fail, running_server

pytestmark = pytest.mark.slow

# model name -> (parameter overrides, fragment the load error must contain)
BAD_MODELS = {
    "llm_bad_value": ({"max_num_seqs": "lots"}, "max_num_seqs"),
    # Parsed fine, refused by the engine while it is built on its own thread.
    "llm_kv_too_small": ({"num_kv_blocks": "2"}, "max_model_len"),
    # A folder whose architecture neither a native module nor the general path runs
    # ("model" set by the fixture).
    "llm_masked_lm": ({}, "unsupported architectures ['BertForMaskedLM']"),
}


def _masked_lm_dir(tiny_model_dir, work):
    """The tiny model's tokenizer with a BERT masked-LM config: loads as a config, runs on
    no path."""
    import shutil

    import transformers

    out = work / "bert-masked-lm"
    shutil.copytree(tiny_model_dir, out)
    config = transformers.BertConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128)
    config.architectures = ["BertForMaskedLM"]
    config.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("triton-startup")
    tiny = {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS}
    params = {"llm": tiny, **{name: {**tiny, **overrides}
                              for name, (overrides, _) in BAD_MODELS.items()}}
    params["llm_masked_lm"]["model"] = str(_masked_lm_dir(tiny_model_dir, work))
    repo = copy_repository(
        REPO_ROOT / "model_repository", work / "models", models=["llm"],
        renames={name: "llm" for name in BAD_MODELS},
        params=params)
    with running_server(repo, work, timeout=300) as handle:
        yield handle


def test_bad_models_fail_to_load_and_server_serves_a_good_one(explicit_server):
    import tritonclient.grpc as grpcclient

    from tests.e2e.triton_clients import infer_one, llm_inputs

    client = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    assert_loads_fail(client, {name: [fragment] for name, (_, fragment) in BAD_MODELS.items()})
    client.load_model("llm")
    assert client.is_model_ready("llm")
    outcome = infer_one(explicit_server.grpc_url, "llm",
                        llm_inputs("Hello, my name is", {"max_tokens": 4, "temperature": 0}))
    assert outcome.error is None and outcome.text
