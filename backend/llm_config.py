"""The `llm` model's tensors as the `tle` backend's auto_complete_config fills them in
(backend/tle_model.py): vllm_backend's interface, so that a config.pbtxt as short as
vllm_backend's sample (the backend line and an instance_group) loads as it is. Pure
Python: it only calls pb_utils.ModelConfig's methods on what it is handed.

Tensors the config.pbtxt already declares are kept, as vllm_backend keeps them; Triton's
auto-complete refuses one whose type or dims differ from these."""
from __future__ import annotations

from typing import Any


# vllm_backend's tensors (`embedding_request`: a pooling model's request,
# backend/pooling_request.py), plus `priority`, which vllm_backend takes in its JSON only,
# and ours: the prompt as token ids, the cached-token count, max_model_len and
# prompt_logprobs outputs with their switches. A request carries `text_input`,
# `prompt_token_ids` (backend/prompt_input.py) or `embedding_request`, so all three are
# optional to Triton. `image` is declared as vllm_backend declares it so that a client
# sending one hears "text only" for that request (request_parsing) rather than Triton
# refusing an unexpected input.
LLM_INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "prompt_token_ids", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
    {"name": "image", "data_type": "TYPE_STRING", "dims": [-1], "optional": True},
    *({"name": name, "data_type": "TYPE_BOOL", "dims": [1], "optional": True}
      for name in ("stream", "exclude_input_in_output", "return_finish_reason",
                   "return_num_input_tokens", "return_num_output_tokens",
                   "return_cumulative_logprob", "return_logprobs",
                   "return_num_cached_tokens", "return_max_model_len")),
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "priority", "data_type": "TYPE_INT32", "dims": [1], "optional": True},
    {"name": "embedding_request", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
]
LLM_OUTPUTS = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_cached_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "max_model_len", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
]


def complete_llm_config(config: Any) -> Any:
    """`config` is the python backend's pb_utils.ModelConfig for this model."""
    declared = config.as_dict()
    inputs = {entry["name"] for entry in declared.get("input", [])}
    outputs = {entry["name"] for entry in declared.get("output", [])}
    for spec in LLM_INPUTS:
        if spec["name"] not in inputs:
            config.add_input(spec)
    for spec in LLM_OUTPUTS:
        if spec["name"] not in outputs:
            config.add_output(spec)
    # Responses stream out as the engine produces them, and the engine batches itself.
    config.set_model_transaction_policy({"decoupled": True})
    config.set_max_batch_size(0)
    return config
