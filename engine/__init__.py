"""A vLLM-style LLM engine: continuous batching scheduler, paged KV cache, torch model.

The package's top level is engine.api, re-exported whole: one list of public names, so
`from engine import LLM, SamplingParams` and `from engine.api import ...` name the same
objects and cannot drift apart."""
from engine import api

__all__ = api.__all__

# Not `from engine.api import *`: a star import fetches every name in __all__, which would
# resolve the lazy ones (torch) the moment anything under engine/ is imported.
globals().update({name: getattr(api, name) for name in __all__ if name not in api._LAZY})


def __getattr__(name: str):
    # LLMEngine, LLM and the model-file helpers: engine.api resolves them on first use,
    # so the scheduler stays importable (and fast to import) without torch.
    if name in api._LAZY:
        return api.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
