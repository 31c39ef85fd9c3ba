"""preprocessing/postprocessing through a real tritonserver: they take the tokenizer of
the engine model named in their repository, and refuse to load when an explicit
tokenizer disagrees with it. Only the tokenizer models are loaded (fast)."""
from __future__ import annotations

import numpy as np
import pytest

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT
from tests.e2e.shared import assert_loads_fail, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer_server(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("triton-tokenizers")
    repo = copy_repository(
        REPO_ROOT / "model_repository", work / "models",
        models=["tensorrt_llm", "preprocessing", "postprocessing"],
        renames={"preprocessing_mismatch": "preprocessing", "preprocessing_orphan": "preprocessing"},
        params={"tensorrt_llm": {"model": str(tiny_model_dir)},
                "preprocessing_mismatch": {"tokenizer": str(work)},
                "preprocessing_orphan": {"engine_model": "no_such_model"}})
    with running_server(repo, work, timeout=300) as handle:
        yield handle


def test_tokenizer_models_follow_the_engine_model_or_fail_naming_both(tokenizer_server, tiny_model_dir):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(tokenizer_server.grpc_url)
    assert_loads_fail(client, {"preprocessing_mismatch": [str(tiny_model_dir), "tensorrt_llm"],
                               "preprocessing_orphan": ["no_such_model"]})
    client.load_model("preprocessing")
    client.load_model("postprocessing")
    # Only the sibling's config.pbtxt is read: the engine model itself need not be loaded.
    assert not client.is_model_ready("tensorrt_llm")

    from engine.models import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    query = grpcclient.InferInput("QUERY", [1, 1], "BYTES")
    query.set_data_from_numpy(np.array([[b"Hello there"]], dtype=np.object_))
    result = client.infer("preprocessing", [query], outputs=[grpcclient.InferRequestedOutput("INPUT_ID")])
    assert result.as_numpy("INPUT_ID")[0].tolist() == tokenizer.encode("Hello there")
