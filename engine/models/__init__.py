"""Paged-attention Llama-family models and their weight loading."""
from engine.models.gguf_cache import default_model_dir

__all__ = ["AttentionMetadata", "LoadedModel", "default_model_dir", "load_model"]


def __getattr__(name: str):
    # Lazy so that tools needing only the model files (tiny.py, the GGUF cache) do not
    # import the kernels package.
    if name == "AttentionMetadata":
        from engine.models.attention import AttentionMetadata
        return AttentionMetadata
    if name in ("LoadedModel", "load_model"):
        from engine.models import loader
        return getattr(loader, name)
    raise AttributeError(name)
