"""Copy a model repository and override config.pbtxt parameters in the copy.

Used by the e2e tests (tiny model, small KV pool) and by serve's --param flag."""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Mapping

_PARAM = 'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'


def set_parameters(config_text: str, params: Mapping[str, str]) -> str:
    """Replace each parameter's one-line definition, or append it."""
    for key, value in params.items():
        escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
        line = _PARAM.format(key=key, value=escaped)
        pattern = re.compile(r'^parameters\s*\{\s*key:\s*"' + re.escape(key) + r'".*$', re.MULTILINE)
        if pattern.search(config_text):
            config_text = pattern.sub(lambda _: line, config_text)
        else:
            config_text = config_text.rstrip("\n") + "\n" + line + "\n"
    return config_text


_INSTANCE_GROUP = re.compile(r"^instance_group\s*\[.*\]\s*$", re.MULTILINE)
INSTANCE_KINDS = ("KIND_MODEL", "KIND_CPU", "KIND_GPU")


def set_instance_group(config_text: str, count: int, kind: str) -> str:
    """One instance group of `count` instances: each its own engine (backend/instance.py)."""
    if count < 1 or kind not in INSTANCE_KINDS:
        raise ValueError(f"instance group needs count >= 1 and a kind in {INSTANCE_KINDS}, "
                         f"got {count} {kind}")
    line = f"instance_group [ {{ count: {count} kind: {kind} }} ]"
    if _INSTANCE_GROUP.search(config_text):
        return _INSTANCE_GROUP.sub(lambda _: line, config_text)
    return config_text.rstrip("\n") + "\n" + line + "\n"


def copy_repository(source: Path, target: Path, models: list[str] | None = None,
                    params: Mapping[str, Mapping[str, str]] | None = None,
                    renames: Mapping[str, str] | None = None,
                    instances: Mapping[str, tuple[int, str]] | None = None) -> Path:
    """Copies `models` (default: all) from source to target. params: {model: {key: value}}
    applied to the copy named model; renames: {new_name: source_model} adds copies
    under another name (e.g. a second `llm` with different engine arguments); instances:
    {model: (count, kind)} replaces the copy's instance_group."""
    target.mkdir(parents=True, exist_ok=True)
    names = models if models is not None else sorted(p.name for p in source.iterdir()
                                                    if (p / "config.pbtxt").is_file())
    plan = {name: name for name in names}
    plan.update(renames or {})
    for new_name, src_name in plan.items():
        dest = target / new_name
        shutil.copytree(source / src_name, dest, ignore=shutil.ignore_patterns("__pycache__"))
        overrides = (params or {}).get(new_name)
        group = (instances or {}).get(new_name)
        if overrides or group:
            cfg = dest / "config.pbtxt"
            text = cfg.read_text(encoding="utf-8")
            if overrides:
                text = set_parameters(text, overrides)
            if group:
                text = set_instance_group(text, *group)
            cfg.write_text(text, encoding="utf-8")
    return target
