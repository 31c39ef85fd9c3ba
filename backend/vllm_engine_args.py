"""vLLM's engine-argument names (what vllm_backend's model.json holds), sorted by what
they become here. Data only; backend/model_json.py applies it.

Names come from vLLM's EngineArgs / AsyncEngineArgs, current and recent releases: a
model.json outlives the vLLM version it was written for, so names vLLM has since dropped
(`swap_space`, `use_v2_block_manager`, `device`, ...) are still recognised."""
from __future__ import annotations

# vLLM name -> this engine's name (EngineConfig.from_dict); the meaning is the same.
RENAMED = {
    "model": "model",
    "tokenizer": "tokenizer",
    "dtype": "dtype",
    "seed": "seed",
    "device": "device",  # vLLM < 0.10
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "long_prefill_token_threshold": "long_prefill_token_threshold",
    "max_num_partial_prefills": "max_num_partial_prefills",  # enforced here (V0's meaning)
    "max_long_partial_prefills": "max_long_partial_prefills",
    "scheduling_policy": "policy",
    "block_size": "block_size",
    "num_gpu_blocks_override": "num_kv_blocks",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "enable_prefix_caching": "enable_prefix_caching",
    "max_logprobs": "max_logprobs",
    "quantization": "quantization",  # None or "gguf" (EngineConfig checks)
    "gpu_memory_utilization": "gpu_memory_utilization",  # the engine sizes the pool from it
    "enforce_eager": "enforce_eager",  # no CUDA graphs on a GPU
    "prefix_caching_hash_algo": "prefix_caching_hash_algo",  # vLLM's four, and builtin
    "kv_events_config": "kv_events_config",  # vLLM's KVEventsConfig fields
    # ngram, suffix and draft_model, with vLLM's keys (engine/config/speculative.py)
    "speculative_config": "speculative_config",
    "stream_interval": "stream_interval",  # vLLM >= 0.11; every engine model here
    # The adapters themselves: multi_lora.json beside model.json (backend/multi_lora.py).
    "enable_lora": "enable_lora",
    "max_loras": "max_loras",
    "max_lora_rank": "max_lora_rank",
    "max_cpu_loras": "max_cpu_loras",
    "model_impl": "model_impl",  # auto / native / transformers (engine/models/registry.py)
    "disable_sliding_window": "disable_sliding_window",
    # The sampling values a request's absent keys take (engine/config/generation.py).
    "generation_config": "generation_config",
    "override_generation_config": "override_generation_config",
    # Which runner serves the model (engine/config/runner.py): "pooling" makes `llm` serve
    # embedding_request (backend/pooling_request.py) instead of text generation.
    "runner": "runner",
    "convert": "convert",
    "task": "task",  # vLLM <= 0.12's, folded into runner/convert
}

# vLLM's spellings of dtypes that this engine spells otherwise.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# As in vllm_backend: true turns REPORT_CUSTOM_METRICS off.
DISABLE_LOG_STATS = "disable_log_stats"

# Accepted with any value and logged as ignored: they tune how vLLM runs (CUDA graphs,
# Ray, logging, loading, tracing), not what it computes, or name something this engine
# always does (chunked prefill) or that only matters with a feature that is off here.
NO_EFFECT = frozenset({
    "disable_log_requests", "enable_log_requests", "max_log_len",
    "disable_custom_all_reduce", "distributed_executor_backend", "worker_use_ray",
    "engine_use_ray", "ray_workers_use_nsight", "worker_cls", "worker_extension_cls",
    "max_seq_len_to_capture", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
    "compilation_config", "optimization_level", "performance_mode", "attention_backend",
    "enable_flashinfer_autotune", "async_scheduling", "use_v2_block_manager", "swap_space",
    "preemption_mode", "num_scheduler_steps", "multi_step_stream_outputs",
    "scheduler_delay_factor", "enable_chunked_prefill", "disable_chunked_mm_input", "kv_sharing_fast_prefill",
    "disable_cascade_attn",
    "max_parallel_loading_workers", "download_dir", "hf_token", "trust_remote_code",
    "use_tqdm_on_load", "safetensors_load_strategy", "pt_load_map_location",
    "model_loader_extra_config", "ignore_patterns", "served_model_name",
    "tokenizer_pool_size", "tokenizer_pool_type", "tokenizer_pool_extra_config",
    "guided_decoding_backend", "structured_outputs_config", "limit_mm_per_prompt",
    "allowed_local_media_path", "mm_processor_cache_gb", "otlp_traces_endpoint",
    "collect_detailed_traces", "aggregate_engine_logging", "show_hidden_metrics_for_version",
    "kv_cache_metrics", "kv_cache_metrics_sample", "cudagraph_metrics", "enable_mfu_metrics",
    "enable_sleep_mode", "numa_bind", "shutdown_timeout", "lora_dtype", "fully_sharded_loras",
    "long_lora_scaling_factors",
    "max_prompt_adapters", "max_prompt_adapter_token", "enable_eplb",
    "data_parallel_backend", "data_parallel_address", "data_parallel_rpc_port",
})

# Features this engine does not have: accepted only at these values (vLLM's defaults,
# which leave the feature off); anything else fails the load naming the argument.
UNSUPPORTED = {
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "prefill_context_parallel_size": (1,),
    "decode_context_parallel_size": (1,),
    "kv_cache_dtype": ("auto",),
    "cpu_offload_gb": (0,),
    "kv_offloading_size": (None,),
    "enable_prompt_adapter": (False,),
    "enable_prompt_embeds": (False,),
    "kv_transfer_config": (None,),
    "revision": (None,),
    "code_revision": (None,),
    "tokenizer_revision": (None,),
    "tokenizer_mode": ("auto",),
    "load_format": ("auto",),
    "config_format": ("auto", "hf"),
    "hf_overrides": (None, {}),
    "rope_scaling": (None, {}),
    "rope_theta": (None,),
    "skip_tokenizer_init": (False,),
    "pooler_config": (None,),
    "override_pooler_config": (None,),
    "mm_processor_kwargs": (None, {}),
    "logits_processors": (None, []),
    "reasoning_parser": (None, ""),
    "scheduler_cls": (None,),
    "additional_config": (None, {}),
}
