"""A vLLM-style LLM engine: continuous batching scheduler, paged KV cache, torch model."""
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.lora.request import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.core.sched_output import SchedulerOutput, SchedulerStats
from engine.core.scheduler import Scheduler

__all__ = ["CacheConfig", "CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "LoRARequest",
           "Request", "RequestOutput", "RequestStatus", "SamplingParams", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SchedulerStats"]


def __getattr__(name: str):
    # The model-backed classes pull in torch and transformers; the scheduler alone
    # must stay importable (and fast to import) without them.
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    raise AttributeError(name)
