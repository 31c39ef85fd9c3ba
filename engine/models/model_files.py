"""Where a model's files are, and its tokenizer: the same answer for the engine and for
the tokenizer-only Triton models, without torch or the kernels."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.models.gguf_cache import converted_dir_for, default_model_dir
from engine.models.hub import hub_snapshot, looks_like_repo_id


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """None or '' -> the embedded default; a .gguf -> its converted (cached) folder; a
    Hugging Face id that is no local path -> its snapshot in the HF cache (engine/models/hub.py)."""
    if model is None or not os.fspath(model):
        return default_model_dir()
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir_for(path)
    if not path.exists() and looks_like_repo_id(os.fspath(model)):
        path = hub_snapshot(os.fspath(model))
    if not path.is_dir():
        raise ValueError(f"model: {str(model)!r} is neither an HF model folder, a .gguf file "
                         "nor a Hugging Face id")
    if not (path / "config.json").is_file():
        raise ValueError(f"model: folder {str(path)!r} has no config.json")
    return path


def tokenizer_dir(model: str | os.PathLike | None,
                  tokenizer: str | os.PathLike | None = None) -> Path:
    """Where an engine for `model` takes its tokenizer: the model's own folder, or
    `tokenizer` (EngineConfig.tokenizer: a folder that may hold only the tokenizer, or
    a .gguf) when one is given."""
    if tokenizer is None or not os.fspath(tokenizer):
        return resolve_model_dir(model)
    path = Path(tokenizer)
    if path.suffix == ".gguf":
        return converted_dir_for(path)
    if not path.exists() and looks_like_repo_id(os.fspath(tokenizer)):
        return hub_snapshot(os.fspath(tokenizer), "tokenizer")
    return path


def load_tokenizer(model: str | os.PathLike | None,
                   tokenizer: str | os.PathLike | None = None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(model, tokenizer))
