"""Runtime LoRA adapters on the backend side: requests carrying lora_path beside lora_name,
accepted only where the model's allow_runtime_lora_updating is on (config.pbtxt or
model.json), one lora_int_id per (name, folder), configured adapters unchanged. The route
that sends them is tests/openai_frontend/test_runtime_lora.py; the real server,
tests/e2e/test_lora_triton.py."""
import json

import numpy as np
import pytest

from backend.config_params import split_parameters
from backend.lora_catalog import LoRACatalog
from backend.model_json import parse_model_json
from backend.multi_lora import read_multi_lora
from backend.request_parsing import InvalidRequest, parse_llm_request
from engine.core.kv_cache.hashing import lora_extra_key
from engine.core.request import Request
from engine.lora.request import LoRARequest

CONFIGURED = {"sql": LoRARequest("sql", 1, "/loras/sql"),
              "chat": LoRARequest("chat", 2, "/loras/chat")}


def test_lora_path_is_refused_unless_the_model_allows_runtime_adapters():
    catalog = LoRACatalog(CONFIGURED)
    assert catalog.resolve("sql") is CONFIGURED["sql"]
    with pytest.raises(ValueError, match=r"lora_path is refused.*allow_runtime_lora_updating=true"):
        catalog.resolve("new", "/loras/new")
    with pytest.raises(ValueError, match="LoRA new is not supported, we currently support"):
        catalog.resolve("new")


def test_each_name_and_folder_keeps_one_id_after_the_configured_ones():
    catalog = LoRACatalog(CONFIGURED, allow_runtime=True)
    first = catalog.resolve("new", "/loras/new")
    assert (first.lora_name, first.lora_int_id, first.lora_path) == ("new", 3, "/loras/new")
    assert catalog.resolve("new", "/loras/./new/") is first  # the same folder, spelt otherwise
    # The name pointed at another folder is another adapter: new weights, new prefix key.
    moved = catalog.resolve("new", "/loras/new-v2")
    other = catalog.resolve("other", "/loras/new")
    assert (moved.lora_int_id, other.lora_int_id) == (4, 5)
    keys = {lora_extra_key(Request("r", [1], lora_request=a)) for a in (first, moved, other)}
    assert len(keys) == 3  # three adapters: three prefix-cache keys, no KV shared
    # A configured adapter by its own folder is that adapter; another folder is refused.
    assert catalog.resolve("chat", "/loras/chat") is CONFIGURED["chat"]
    with pytest.raises(ValueError, match="'chat' is a configured adapter.*cannot point it"):
        catalog.resolve("chat", "/loras/elsewhere")
    with pytest.raises(ValueError, match="lora_path must be an absolute folder path"):
        catalog.resolve("rel", "loras/rel")
    assert LoRACatalog({}, allow_runtime=True).resolve("a", "/a").lora_int_id == 1


def _tensors(sampling):
    return {"text_input": np.array([b"hi"], dtype=np.object_),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_)}


def test_lora_path_rides_in_sampling_parameters_beside_lora_name():
    parsed = parse_llm_request(_tensors({"lora_name": "new", "lora_path": "/loras/new",
                                         "max_tokens": 1}))
    assert (parsed.lora_name, parsed.lora_path) == ("new", "/loras/new")
    assert parsed.params.max_tokens == 1
    assert parse_llm_request(_tensors({"lora_name": "sql"})).lora_path is None
    with pytest.raises(InvalidRequest, match="lora_path needs lora_name"):
        parse_llm_request(_tensors({"lora_path": "/loras/new"}))
    with pytest.raises(InvalidRequest, match="lora_path must be a non-empty string, got 7"):
        parse_llm_request(_tensors({"lora_name": "new", "lora_path": 7}))


def test_the_switch_comes_from_config_pbtxt_or_model_json_and_needs_enable_lora(tmp_path):
    lora = {"enable_lora": "true"}
    assert not split_parameters(lora)[1].allow_runtime_lora_updating  # off by default
    assert split_parameters({**lora, "allow_runtime_lora_updating": "true"})[1] \
        .allow_runtime_lora_updating
    from_json = parse_model_json({"enable_lora": True, "allow_runtime_lora_updating": True})
    assert split_parameters({}, from_json)[1].allow_runtime_lora_updating
    # config.pbtxt wins over model.json, as for every other argument.
    assert not split_parameters({"allow_runtime_lora_updating": "false"}, from_json)[1] \
        .allow_runtime_lora_updating
    with pytest.raises(ValueError, match="allow_runtime_lora_updating needs enable_lora=true"):
        split_parameters({"allow_runtime_lora_updating": "true"})
    with pytest.raises(ValueError, match="'allow_runtime_lora_updating'"):
        parse_model_json({"allow_runtime_lora_updating": "sometimes"})
    # Runtime adapters may be the only ones: multi_lora.json is then optional.
    assert read_multi_lora(tmp_path, required=False) == {}
    with pytest.raises(ValueError, match="multi_lora.json does not exist"):
        read_multi_lora(tmp_path)
