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
                            replay_endpoint="tcp://*:5657")
    assert config.for_rank(0) is config
    second = config.for_rank(2)
    assert (second.endpoint, second.replay_endpoint) == ("tcp://*:5559", "tcp://*:5659")
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").for_rank(1).endpoint == "ipc:///tmp/kv_dp1"
    assert KVEventsConfig(endpoint="inproc://kv").for_rank(2).endpoint == "inproc://kv_dp2"
    # vLLM leaves port 0 to the OS on every rank.
    assert KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0",
                          replay_endpoint="tcp://*:0").for_rank(3).endpoint == "tcp://*:0"
    with pytest.raises(ValueError, match="own endpoint"):
        KVEventsConfig(endpoint="tcp://host").for_rank(1)


def test_colliding_kv_event_ports_are_refused_naming_them():
    """vLLM's example pair 5557/5558: rank 1's PUB port is rank 0's replay port. Rank 1
    says so before it binds anything (and before the backend loads its weights)."""
    adjacent = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                              replay_endpoint="tcp://*:5558")
    assert adjacent.for_rank(0) is adjacent  # one instance is fine
    message = (r"rank 1 would bind endpoint tcp://\*:5558, the same port as rank 0's "
               r"replay_endpoint tcp://\*:5558.*at least N apart.*'tcp://\*:5657'")
    with pytest.raises(ValueError, match=message):
        adjacent.for_rank(1)
    with pytest.raises(ValueError, match=message):
        place_instance(EngineConfig(kv_events_config=adjacent),
                       {"model_instance_name": "llm_0_1", "model_instance_kind": "CPU"})
    # Replay below PUB collides the other way round; one pair on one port at rank 0.
    with pytest.raises(ValueError, match="rank 2 would bind replay_endpoint tcp://\\*:5557, "
                                         "the same port as rank 0's endpoint"):
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                       replay_endpoint="tcp://*:5555").for_rank(2)
    with pytest.raises(ValueError, match="its own replay_endpoint"):
        EngineConfig(kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, endpoint="tcp://*:6000", replay_endpoint="tcp://*:6000"))
    with pytest.raises(ValueError, match="same address as rank 0's replay_endpoint"):
        KVEventsConfig(enable_kv_cache_events=True, endpoint="ipc:///tmp/kv",
                       replay_endpoint="ipc:///tmp/kv_dp1").for_rank(1)
    # A host address is connected to, not bound: nothing of rank 0's is taken.
    connected = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://indexer:5557",
                               replay_endpoint="tcp://*:5558")
    assert connected.for_rank(1).endpoint == "tcp://indexer:5558"
    # Events off: nothing binds, nothing to check.
    assert EngineConfig(kv_events_config=KVEventsConfig(endpoint="tcp://*:1",
                                                        replay_endpoint="tcp://*:1"),
                        data_parallel_rank=1).data_parallel_rank == 1


def test_instance_group_is_replaced_or_added():
    text = 'backend: "tle"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\nparameters {}\n'
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in set_instance_group(text, 2, "KIND_CPU")
    assert set_instance_group('backend: "tle"\n', 3, "KIND_GPU").endswith(
        "instance_group [ { count: 3 kind: KIND_GPU } ]\n")
    with pytest.raises(ValueError):
        set_instance_group(text, 0, "KIND_CPU")
