"""What a pooling engine is made of, built in order (engine/startup.py's counterpart for
runner="pooling"): CPU threads, the model, its pooling settings, the KV pool (a
decoder's; an encoder's is a ledger with no tensors), the scheduler and the runner."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.config.runner import RunnerChoice
from engine.core.kv_cache.groups import KVCacheLayout, full_attention_layout
from engine.faults import FaultPlan
from engine.pooling.loader import load_pooling_model
from engine.pooling.scheduler import PoolingScheduler
from engine.pooling.settings import PoolerSettings, read_settings
from engine.worker.cpu_threads import ThreadGovernor, configure_threads
from engine.worker.kv_pool import kv_layout, resolve_kv_pool
from engine.worker.pooling_runner import PoolingRunner
from kernels.dispatch import detect_cpu

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolingParts:
    config: EngineConfig  # resolved: max_model_len, num_kv_blocks, prefix caching
    loaded: Any           # engine.models.loader.LoadedModel
    settings: PoolerSettings
    scheduler: PoolingScheduler
    runner: PoolingRunner
    threads: ThreadGovernor | None


def refuse_generation_only(config: EngineConfig) -> None:
    """Engine arguments whose machinery the pooling runner does not have, by name."""
    refused = {
        "tensor_parallel_size": config.tensor_parallel_size > 1,
        "enable_lora": config.lora.enable_lora,
        "quantization": config.quantization is not None,
        "batch_invariant": config.batch_invariant,
        "trace_path": config.trace_path is not None,
        "kv_events_config": config.kv_events_config is not None
        and config.kv_events_config.active,
    }
    named = [name for name, on in refused.items() if on]
    if named:
        raise ValueError(f"{', '.join(named)}: not supported with runner='pooling'")


def start_pooling_engine(config: EngineConfig, choice: RunnerChoice,
                         faults: FaultPlan) -> PoolingParts:
    refuse_generation_only(config)
    threads = configure_threads(config.num_threads, detect_cpu().num_cpus, config.torch_device)
    loaded = load_pooling_model(config, choice)
    # vLLM's defaults: CLS for the BERT family, the last token for a causal LM.
    settings = read_settings(loaded.model_dir, loaded.hf_config, choice.task,
                             "CLS" if choice.encoder else "LAST")
    if choice.encoder:
        layout: KVCacheLayout = full_attention_layout(1)
        config = _encoder_pool(config, loaded)
    else:
        layout = kv_layout(loaded)
        if settings.pooling_type != "LAST" and config.cache.enable_prefix_caching:
            # A cached prefix has K/V but no hidden states to pool (vLLM turns prefix
            # caching off for CLS / MEAN pooling too).
            logger.info("prefix caching off: %s pooling reads every prompt position",
                        settings.pooling_type)
            config = dataclasses.replace(config, cache=dataclasses.replace(
                config.cache, enable_prefix_caching=False))
        config = resolve_kv_pool(config, loaded, layout)
    sched_cfg, cache_cfg = config.scheduler, config.cache
    scheduler = PoolingScheduler(sched_cfg, cache_cfg, kv_layout=layout,
                                 whole_prompts=choice.encoder)
    runner = PoolingRunner(loaded, settings, cache_cfg.num_kv_blocks, cache_cfg.block_size,
                           layout, faults)
    logger.info("pooling engine ready: model %s (%s, task %s, %s pooling, activation %s "
                "by default, from %s), max_model_len %d; load %.1f s", loaded.model_dir,
                type(loaded.model).__name__, settings.task, settings.pooling_type,
                "on" if settings.use_activation else "off", settings.source,
                sched_cfg.max_model_len, loaded.load_seconds)
    return PoolingParts(config, loaded, settings, scheduler, runner, threads)


def _encoder_pool(config: EngineConfig, loaded) -> EngineConfig:
    """An encoder keeps no KV, but the scheduler still counts blocks: give it a ledger
    that holds every seat's longest prompt, so counting never refuses anyone."""
    context = loaded.max_position_embeddings
    max_model_len = config.scheduler.max_model_len or context
    if max_model_len > context:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context "
                         f"({context} positions)")
    cache, sched = config.cache, config.scheduler
    blocks = sched.max_num_seqs * -(-max_model_len // cache.block_size)
    return dataclasses.replace(
        config, scheduler=dataclasses.replace(sched, max_model_len=max_model_len),
        cache=dataclasses.replace(cache, num_kv_blocks=blocks, enable_prefix_caching=False,
                                  watermark=0.0))
