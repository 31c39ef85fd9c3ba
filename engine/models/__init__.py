"""Paged-attention Llama-family models and their weight loading."""
from engine.models.gguf_cache import default_model_dir
from engine.models.model_files import load_tokenizer, resolve_model_dir, tokenizer_dir

__all__ = ["AttentionMetadata", "LoadedModel", "default_model_dir", "load_model", "load_tokenizer",
           "resolve_model_dir", "tokenizer_dir"]


def __getattr__(name: str):
    # Lazy so that users of the model files alone (the tokenizer-only Triton models,
    # test fixtures, the GGUF cache) do not import torch and the kernels package.
    if name == "AttentionMetadata":
        from engine.models.attention import AttentionMetadata
        return AttentionMetadata
    if name in ("LoadedModel", "load_model"):
        from engine.models import loader
        return getattr(loader, name)
    raise AttributeError(name)
