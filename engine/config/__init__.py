"""Engine configuration: one object, validated once, handed down to every layer (as
vLLM's vllm/config/ package: a section per file). Torch-free."""
from engine.config.cache import HASH_ALGOS, CacheConfig
from engine.config.engine import DTYPES, QUANTIZATIONS, EngineConfig
from engine.config.kv_events import KVEventsConfig
from engine.config.lora import LORA_RANKS, LoRAConfig
from engine.config.scheduler import POLICIES, SchedulerConfig

__all__ = ["CacheConfig", "DTYPES", "EngineConfig", "HASH_ALGOS", "KVEventsConfig", "LORA_RANKS", "LoRAConfig", "POLICIES",
           "QUANTIZATIONS", "SchedulerConfig"]
