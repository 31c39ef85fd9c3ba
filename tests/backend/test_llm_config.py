"""backend/llm_config.py (the tle backend's auto-complete) against vllm_backend's
(triton-inference-server/vllm_backend at 8de0c14, src/model.py
_auto_complete_inputs_and_outputs)."""
from __future__ import annotations

from backend.llm_config import complete_llm_config

# vllm_backend's optional `image` input at 8de0c14, as it declares it.
VLLM_BACKEND_IMAGE = {"name": "image", "data_type": "TYPE_STRING", "dims": [-1], "optional": True}


class ModelConfig:
    """Just the calls the auto-complete makes on pb_utils.ModelConfig."""

    def __init__(self, declared: dict) -> None:
        self.config = declared

    def as_dict(self) -> dict:
        return self.config

    def add_input(self, spec: dict) -> None:
        self.config.setdefault("input", []).append(spec)

    def add_output(self, spec: dict) -> None:
        self.config.setdefault("output", []).append(spec)

    def set_model_transaction_policy(self, policy: dict) -> None:
        self.config["model_transaction_policy"] = policy

    def set_max_batch_size(self, size: int) -> None:
        self.config["max_batch_size"] = size


def test_image_input_is_declared_as_vllm_backend_declares_it():
    config = complete_llm_config(ModelConfig({})).as_dict()
    inputs = {spec["name"]: spec for spec in config["input"]}
    assert inputs["image"] == VLLM_BACKEND_IMAGE
    # vllm_backend's pooling input too (a runner="pooling" model serves it).
    assert inputs["embedding_request"] == {"name": "embedding_request", "data_type": "TYPE_STRING",
                                           "dims": [1], "optional": True}


def test_a_declared_image_input_is_kept():
    mine = {"name": "image", "data_type": "TYPE_STRING", "dims": [1], "optional": True}
    config = complete_llm_config(ModelConfig({"input": [mine]})).as_dict()
    assert [spec for spec in config["input"] if spec["name"] == "image"] == [mine]
