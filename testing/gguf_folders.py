"""Tiny HF folders with GGUF files of the same weights beside them, and a private GGUF
cache, for the tests that hold our GGUF reading against the folder it came from."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from bench.gguf_from_hf import write_gguf
from testing.tiny_model import make_tiny_model_dir


def tiny_gguf_folders(tmp_path_factory, families: dict[str, tuple[str, dict]],
                      kinds: tuple[str, ...]) -> dict[str, Path]:
    """family -> (arch, overrides) in, family -> its tiny HF folder out, each with
    OUT/gguf/<kind>.gguf written from it."""
    made = {}
    for family, (arch, overrides) in families.items():
        folder = make_tiny_model_dir(tmp_path_factory.mktemp(family), arch=arch, seed=3,
                                     **overrides)
        (folder / "gguf").mkdir()
        for kind in kinds:
            # A neutral general.name: llama.cpp applies Phi-3's own tokenizer quirks to a
            # model whose name says phi3, and they need Phi-3's vocabulary (its </s>).
            write_gguf(folder, folder / "gguf" / f"{kind}.gguf", kind, name="tiny random model")
        made[family] = folder
    return made


@contextmanager
def private_gguf_cache(tmp_path_factory) -> Iterator[Path]:
    """The engine's GGUF conversions go to a fresh cache folder while this is open."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("gguf-cache")
        patch.setenv("TLE_CACHE_DIR", str(path))
        yield path
