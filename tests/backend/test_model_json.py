"""backend.model_json: vllm_backend's model.json -> this engine's arguments, and how
config.pbtxt parameters combine with it (backend.config_params)."""
from __future__ import annotations

import json

import pytest

from backend import vllm_engine_args as vllm
from backend.config_params import split_parameters
from backend.model_json import parse_model_json, read_model_json
from engine.config import EngineConfig

# vllm_backend's sample model.json (samples/model_repository/vllm_model/1/model.json).
SAMPLE = {"model": "/models/opt-125m", "disable_log_requests": True, "gpu_memory_utilization": 0.5,
          "enforce_eager": True, "disable_log_stats": False}


def settings(model_json: dict, params: dict | None = None):
    lines: list[str] = []
    config, options = split_parameters(params or {}, parse_model_json(model_json), log=lines.append)
    return config, options, lines


def test_vllm_backend_sample_reads_as_engine_arguments():
    parsed = parse_model_json(SAMPLE)
    assert parsed.engine_args == {"model": "/models/opt-125m", "gpu_memory_utilization": 0.5,
                                  "enforce_eager": True}
    assert parsed.disable_log_stats is False
    assert parsed.ignored == ["disable_log_requests"]


def test_vllm_names_reach_the_engine_config():
    config, _, _ = settings({"tokenizer": "/tok", "dtype": "half", "seed": 7, "max_model_len": 512,
                             "max_num_seqs": 4, "max_num_batched_tokens": 256, "block_size": 32,
                             "enable_prefix_caching": False, "long_prefill_token_threshold": 64,
                             "scheduling_policy": "priority", "max_logprobs": 5,
                             "num_gpu_blocks_override": 77, "kv_cache_memory_bytes": 1 << 20,
                             "quantization": "gguf"})
    assert (config.tokenizer, config.dtype, config.seed, config.max_logprobs) == ("/tok", "float16", 7, 5)
    assert config.quantization == "gguf"
    s, c = config.scheduler, config.cache
    assert (s.max_model_len, s.max_num_seqs, s.max_num_batched_tokens) == (512, 4, 256)
    assert (s.long_prefill_token_threshold, s.policy) == (64, "priority")
    assert (c.block_size, c.enable_prefix_caching, c.num_kv_blocks) == (32, False, 77)
    assert c.kv_cache_memory_bytes == 1 << 20


def test_null_keeps_the_engine_default_and_own_names_are_accepted():
    config, _, _ = settings({"model": None, "seed": None, "num_threads": 1, "watermark": 0.1})
    assert config.model is None and config.seed == 0
    assert config.num_threads == 1 and config.cache.watermark == 0.1


def test_config_pbtxt_parameters_win_over_model_json():
    config, _, _ = settings({"max_num_seqs": 5, "max_model_len": 100, "model": "/from/json"},
                            {"max_num_seqs": "3", "model": ""})
    assert config.scheduler.max_num_seqs == 3  # config.pbtxt
    assert config.scheduler.max_model_len == 100  # model.json, not overridden
    assert config.model is None  # config.pbtxt's "" (the embedded default) wins too


def test_args_without_effect_are_logged_and_unsupported_ones_pass_at_their_off_value():
    _, _, lines = settings({"disable_log_requests": False, "swap_space": 4,
                            "pipeline_parallel_size": 1, "enable_prompt_adapter": False,
                            "hf_overrides": {}})
    assert len(lines) == 1
    for name in ("disable_log_requests", "swap_space", "pipeline_parallel_size",
                 "enable_prompt_adapter"):
        assert name in lines[0]


def test_lora_arguments_as_vllm_backend_writes_them():
    """The LoRA tutorial's model.json: enable_lora as a string, max_lora_rank a number."""
    config, _, lines = settings({"enable_lora": "true", "max_lora_rank": 16, "max_loras": 4,
                                 "max_cpu_loras": 8})
    assert (config.lora.enable_lora, config.lora.max_lora_rank, config.lora.max_loras,
            config.lora.max_cpu_loras) == (True, 16, 4, 8)
    assert not lines
    default, _, _ = settings({"enable_lora": True})
    assert (default.lora.max_loras, default.lora.max_lora_rank, default.lora.max_cpu_loras) \
        == (1, 16, 1)  # vLLM's defaults


@pytest.mark.parametrize("data,fragment", [
    ({"pipeline_parallel_size": 2}, "'pipeline_parallel_size' = 2 is not supported"),
    ({"quantization": "awq"}, "model.json key 'quantization'"),
    ({"enable_lora": "sometimes"}, "model.json key 'enable_lora'"),
    ({"max_lora_rank": 12}, "model.json key 'max_lora_rank'.*must be one of"),
    ({"kv_cache_dtype": "fp8"}, "'kv_cache_dtype'"),
    ({"pipeline_parallel_size": True}, "'pipeline_parallel_size'"),  # true is not 1 here
    ({"tensor_parallel_size": 0}, "model.json key 'tensor_parallel_size'"),
    ({"max_num_seq": 4}, "unknown engine argument 'max_num_seq'.*did you mean 'max_num_seqs'"),
    ({"no_such_thing": 1}, "unknown engine argument 'no_such_thing'"),
    ({"max_num_seqs": "lots"}, "model.json key 'max_num_seqs'"),
    ({"max_num_seqs": 0}, "model.json key 'max_num_seqs'"),
    ({"block_size": 7}, "model.json key 'block_size'"),
    ({"scheduling_policy": "random"}, "model.json key 'scheduling_policy' \\(policy here\\)"),
    ({"dtype": "int8"}, "model.json key 'dtype'"),
    ({"gpu_memory_utilization": 1.5}, "key 'gpu_memory_utilization'.* must be in"),
    ({"gpu_memory_utilization": 0}, "key 'gpu_memory_utilization'.* must be in"),
    ({"gpu_memory_utilization": "half"}, "key 'gpu_memory_utilization'"),
    ({"disable_log_stats": "sometimes"}, "'disable_log_stats'"),
])
def test_bad_model_json_names_the_key(data, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_model_json(data)


def test_not_an_object_is_refused():
    with pytest.raises(ValueError, match="JSON object"):
        parse_model_json(["model", "x"])


def test_file_reading(tmp_path):
    assert read_model_json(tmp_path) is None  # config.pbtxt alone, as before model.json
    (tmp_path / "model.json").write_text(json.dumps(SAMPLE))
    assert read_model_json(tmp_path).engine_args == parse_model_json(SAMPLE).engine_args
    (tmp_path / "model.json").write_text('{"model": "x",}')
    with pytest.raises(ValueError, match="model.json: not readable as JSON"):
        read_model_json(tmp_path)
    (tmp_path / "model.json").write_text('{"max_num_seq": 1}')
    with pytest.raises(ValueError, match=f"{tmp_path}/model.json: unknown engine argument 'max_num_seq'"):
        read_model_json(tmp_path)


def test_disable_log_stats_turns_custom_metrics_off_as_in_vllm_backend():
    _, on, _ = settings({"disable_log_stats": False}, {"REPORT_CUSTOM_METRICS": "true"})
    _, off, _ = settings({"disable_log_stats": True}, {"REPORT_CUSTOM_METRICS": "true"})
    assert on.report_custom_metrics and not off.report_custom_metrics


def test_gpu_memory_utilization_and_enforce_eager_reach_the_engine():
    config, _, lines = settings({"gpu_memory_utilization": 0.5, "enforce_eager": True})
    assert config.cache.gpu_memory_utilization == 0.5 and config.enforce_eager
    assert not config.cache.explicit_pool and not lines
    config, _, _ = settings({"gpu_memory_utilization": 0.5, "num_gpu_blocks_override": 64})
    assert config.cache.explicit_pool


def test_name_tables_do_not_overlap():
    groups = [set(vllm.RENAMED), set(vllm.NO_EFFECT), set(vllm.UNSUPPORTED),
              {vllm.DISABLE_LOG_STATS}]
    for i, a in enumerate(groups):
        for b in groups[i + 1:]:
            assert not a & b, a & b
