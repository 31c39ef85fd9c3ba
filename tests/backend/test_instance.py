"""Each Triton instance's engine: its rank from the instance name, its device from
KIND_GPU, and its KV-event ports offset by the rank (vLLM's data-parallel rule)."""
import pytest

from backend.instance import instance_rank, place_instance
from backend.repository_layout import set_instance_group
from engine.config import EngineConfig
from engine.config import KVEventsConfig


def test_rank_comes_from_the_instance_index():
    assert instance_rank("llm_0_0") == 0
    assert instance_rank("llm_0_3") == 3
    assert instance_rank("") == 0


def test_gpu_instances_take_their_device_and_cpu_ones_keep_auto():
    config = EngineConfig()
    gpu = place_instance(config, {"model_instance_name": "llm_0_1", "model_instance_kind": "GPU",
                                  "model_instance_device_id": "1"})
    assert gpu.device == "cuda:1" and gpu.data_parallel_rank == 1
    cpu = place_instance(config, {"model_instance_name": "llm_0_1", "model_instance_kind": "CPU"})
    assert cpu.device == "auto" and cpu.data_parallel_rank == 1
    pinned = place_instance(EngineConfig(device="cpu"), {"model_instance_name": "llm_0_0",
                                                        "model_instance_kind": "GPU"})
    assert pinned.device == "cpu"


def test_kv_event_endpoints_are_offset_by_rank():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                            replay_endpoint="tcp://*:5558")
    assert config.for_rank(0) is config
    second = config.for_rank(2)
    assert (second.endpoint, second.replay_endpoint) == ("tcp://*:5559", "tcp://*:5560")
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").for_rank(1).endpoint == "ipc:///tmp/kv_dp1"
    with pytest.raises(ValueError, match="own endpoint"):
        KVEventsConfig(endpoint="tcp://host").for_rank(1)


def test_instance_group_is_replaced_or_added():
    text = 'backend: "tle"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\nparameters {}\n'
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in set_instance_group(text, 2, "KIND_CPU")
    assert set_instance_group('backend: "tle"\n', 3, "KIND_GPU").endswith(
        "instance_group [ { count: 3 kind: KIND_GPU } ]\n")
    with pytest.raises(ValueError):
        set_instance_group(text, 0, "KIND_CPU")
