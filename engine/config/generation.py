"""vLLM's `generation_config` and `override_generation_config` engine arguments: the
sampling values a model's creator recommends (its generation_config.json), read once when
the engine starts, which a request's sampling keys take when the request leaves them out.

The engine owns them (LLMEngine.sampling_defaults); the places that build a request's
SamplingParams from the keys a client gave apply them there (backend/request_parsing.py,
backend/token_request_parsing.py), and LLM.generate uses them when it is given no
SamplingParams, as vLLM's LLM.get_default_sampling_params. Torch-free.

The rules are vLLM 0.32's (ModelConfig.get_diff_sampling_param and the OpenAI serving
layer's get_max_tokens):
- "auto" (the default): the model folder's generation_config.json; "vllm": none of it,
  SamplingParams' own defaults; any other value: a folder holding a generation_config.json.
  Without a generation_config.json, config.json stands in (transformers' from_model_config,
  which vLLM falls back to; old checkpoints kept temperature there).
- override_generation_config is merged over what was read (with "vllm": it alone counts).
- Only HF_SAMPLING_KEYS are taken; HF's max_new_tokens is SamplingParams.max_tokens.
- max_new_tokens is also a ceiling on every request's max_tokens when it comes from a
  folder named by generation_config, or from override_generation_config; under "auto" the
  model's own max_new_tokens is only a default.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engine.sampling_params import SamplingParams
from engine.values import convert

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
AUTO = "auto"
VLLM = "vllm"
# What vLLM 0.32 takes from a generation config, in its order (HF names).
HF_SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty",
                    "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
# HF name -> SamplingParams field, where they differ.
_FIELD = {"max_new_tokens": "max_tokens"}
_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_KINDS = {name: str(f.type) for name, f in _FIELDS.items()}
# A request that names no max_tokens gets SamplingParams' own (16) before the ceiling.
_SAMPLING_DEFAULT_MAX_TOKENS = _FIELDS["max_tokens"].default


def check_generation_config(value: Any) -> str:
    """Raises ValueError unless `value` is "auto", "vllm" or an existing folder: a mistyped
    path fails the load here, before any weights are read, not silently later."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                         f"{FILE_NAME}, got {value!r}")
    if value not in (AUTO, VLLM) and not Path(value).is_dir():
        raise ValueError(f"generation_config: {value!r} is neither 'auto', 'vllm' nor a folder")
    return value


def parse_override(name: str, value: Any) -> dict[str, Any] | None:
    """override_generation_config as given: an object, or its JSON text (config.pbtxt
    parameters are strings); null or "" means none. The values themselves are checked when
    the engine starts, with the rest of the sampling defaults."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip() or value.strip().lower() in ("none", "null"):
            return None
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{name} is not a valid JSON object: {value[:80]!r}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name} must be an object of generation_config.json keys to values, "
                         f"got {type(value).__name__}")
    return dict(value)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """The sampling values a request's absent keys take; empty under "vllm" (no override)."""
    # SamplingParams field -> value (max_new_tokens already renamed max_tokens).
    values: Mapping[str, Any] = field(default_factory=dict)
    # vLLM's override_max_tokens: no request gets more new tokens than this. None: no ceiling.
    max_tokens_cap: int | None = None
    # Where the values came from, for messages.
    source: str = VLLM

    def apply(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """SamplingParams keyword arguments from the keys a request gave: those win, a key
        it left out takes the default. max_tokens given as None (the OpenAI route's chat
        request without a limit: vLLM's "unset") takes the default too, and stays None
        ("until the context is full") without one."""
        kwargs = dict(given)
        for name, value in self.values.items():
            if name not in kwargs or (name == "max_tokens" and kwargs[name] is None):
                kwargs[name] = value
        cap = self.max_tokens_cap
        if cap is not None:
            limit = kwargs.get("max_tokens", _SAMPLING_DEFAULT_MAX_TOKENS)
            kwargs["max_tokens"] = cap if limit is None else min(limit, cap)
        return kwargs

    def sampling_params(self, **given: Any) -> SamplingParams:
        """SamplingParams from these defaults under `given` (LLM.get_default_sampling_params)."""
        return SamplingParams(**self.apply(given))


def read_generation_config(folder: str | os.PathLike,
                           required: bool = False) -> tuple[dict[str, Any], Path]:
    """(contents, path) of the folder's generation_config.json, else of its config.json;
    ({}, the generation_config.json path) when it has neither, or ValueError naming the
    folder when `required`. A file that is not a JSON object raises ValueError naming it."""
    folder = Path(folder)
    for name in (FILE_NAME, "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: not readable as JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
        return data, path
    if required:
        raise ValueError(f"generation_config: folder {str(folder)!r} holds no {FILE_NAME}")
    return {}, folder / FILE_NAME


def load_sampling_defaults(generation_config: str, override: Mapping[str, Any] | None,
                           model_dir: str | os.PathLike) -> SamplingDefaults:
    """Reads and checks the defaults once, at engine start. A value SamplingParams refuses
    raises ValueError naming where it came from, so a bad file fails the load instead of
    every request."""
    override = dict(override or {})
    if generation_config == VLLM:
        config, source = {}, "override_generation_config" if override else VLLM
    else:
        folder = model_dir if generation_config == AUTO else generation_config
        config, path = read_generation_config(folder, required=generation_config != AUTO)
        source = str(path)
    if override:
        source += " with override_generation_config" if generation_config != VLLM else ""
        ignored = sorted(set(override) - set(HF_SAMPLING_KEYS))
        if ignored:
            # vLLM merges the whole dict but samples with these keys only.
            logger.warning("override_generation_config: %s change nothing here (only %s are "
                           "sampling defaults)", ignored, ", ".join(HF_SAMPLING_KEYS))
    config.update(override)
    values: dict[str, Any] = {}
    for key in HF_SAMPLING_KEYS:
        value = config.get(key)
        if value is None:
            continue
        name = _FIELD.get(key, key)
        values[name] = convert(f"{source}: {key}", value, _KINDS[name])
    cap = None
    if generation_config not in (AUTO, VLLM):
        cap = values.get("max_tokens")
    elif override.get("max_new_tokens") is not None:
        cap = values["max_tokens"]
    defaults = SamplingDefaults(values, cap, source)
    try:
        defaults.sampling_params()
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if values and generation_config != VLLM:
        logger.warning("Default sampling parameters are overridden by %s: %s (a request's own "
                       "values win). Engine argument generation_config='vllm' turns this off.",
                       source, values)
    return defaults
