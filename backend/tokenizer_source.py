"""Which tokenizer `preprocessing` and `postprocessing` load: their engine model's.

Triton hands each model only its own config.pbtxt, yet the ensemble is only right when
its tokenizer is the one the engine serves with. So a tokenizer model reads the
config.pbtxt of its engine model (a sibling folder of the same repository, named by
its `engine_model` parameter): the model path is written once, in the engine model
(scripts/serve.py --model writes it there), and a `tokenizer` parameter that names
something else fails the load with both paths in the message. Pure Python."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from engine.api import convert

DEFAULT_ENGINE_MODEL = "tensorrt_llm"
_KEYS = ("engine_model", "tokenizer")


@dataclass(frozen=True, slots=True)
class TokenizerSource:
    """Arguments for engine.models.load_tokenizer, as the engine model's config gives them."""
    model: str | None
    tokenizer: str | None

    @property
    def shown(self) -> str:
        return self.tokenizer or self.model or "the embedded default model"


def read_config_parameters(config_path: Path) -> dict[str, str]:
    """A config.pbtxt's `parameters` as {key: string_value}, read with protobuf's text
    parser and Triton's ModelConfig message (from tritonclient), as Triton reads it."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        config = text_format.Parse(config_path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"{config_path}: {exc}") from None
    return {key: value.string_value for key, value in config.parameters.items()}


def tokenizer_source(model_name: str, params: Mapping[str, str], model_dir: Path) -> TokenizerSource:
    """params: this tokenizer model's own parameters; model_dir: its folder in the
    repository (Triton's args["model_repository"]). Raises ValueError naming the problem."""
    unknown = sorted(set(params) - set(_KEYS))
    if unknown:
        raise ValueError(f"{model_name}: unknown parameter(s) {unknown}; known: {list(_KEYS)}")
    engine_model = convert("engine_model", params.get("engine_model", DEFAULT_ENGINE_MODEL), "str")
    explicit = convert("tokenizer", params.get("tokenizer", ""), "str | None")
    engine_config = Path(model_dir).parent / (engine_model or DEFAULT_ENGINE_MODEL) / "config.pbtxt"
    if not engine_config.is_file():
        if explicit is None:
            raise ValueError(f"{model_name}: no engine model config at {engine_config} to take the "
                             "tokenizer from; set `engine_model` to the engine model's name in "
                             "this repository, or `tokenizer` to a tokenizer folder")
        return TokenizerSource(model=None, tokenizer=explicit)
    engine_params = read_config_parameters(engine_config)
    source = TokenizerSource(
        model=convert("model", engine_params.get("model", ""), "str | None"),
        tokenizer=convert("tokenizer", engine_params.get("tokenizer", ""), "str | None"))
    if explicit is not None and not _same_path(explicit, source.tokenizer or source.model):
        raise ValueError(
            f"{model_name}: tokenizer {explicit!r} is not the tokenizer of engine model "
            f"{engine_model!r} ({source.shown!r}, from {engine_config}); leave `tokenizer` "
            "empty to follow the engine model (scripts/serve.py --model sets only that)")
    return source


def _same_path(a: str, b: str | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)
