"""The layers above the engine reach it through one door: `engine.api` (or `engine`, which
re-exports it whole). Every import in their sources is parsed, those inside functions
included, and each name engine.api lists must resolve."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engine
from engine import api

REPO = Path(__file__).resolve().parents[1]
# Everything above the engine: the Triton glue and its models, the OpenAI route, the
# tuning tools, the scripts, and the clients (which should not import the engine at all).
CALLERS = ("backend", "model_repository", "openai_frontend", "tuning", "scripts", "client_examples")
# DESIGN.md §2 pins these at the engine package's top level.
PINNED = {"LLM", "LLMEngine", "SamplingParams", "LoRARequest", "Request", "RequestStatus",
          "RequestOutput", "CompletionOutput", "Scheduler", "SchedulerOutput", "SchedulerConfig",
          "CacheConfig", "EngineConfig"}


def deep_imports(source: str, filename: str) -> list[str]:
    """'file:line: what' for each import that passes engine.api by: `import engine.x`,
    `from engine.x import y`, or `from engine import y` where y is not a public name
    (a submodule such as engine.models, or a name the surface lacks)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"{filename}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("engine.") and a.name != "engine.api"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("engine.") and node.module != "engine.api":
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            elif node.module in ("engine", "engine.api"):
                found += [f"{filename}:{node.lineno}: from {node.module} import {a.name}"
                          for a in node.names
                          if a.name not in api.__all__ and (node.module, a.name) != ("engine", "api")]
    return found


def caller_sources() -> list[Path]:
    return sorted(p for folder in CALLERS for p in (REPO / folder).rglob("*.py"))


def test_callers_import_the_engine_through_its_surface_only():
    sources = caller_sources()
    assert len(sources) > 50, "the callers' sources were not found"
    stray = [hit for p in sources for hit in deep_imports(p.read_text(), str(p.relative_to(REPO)))]
    assert stray == [], "import these from engine.api instead:\n" + "\n".join(stray)


@pytest.mark.parametrize("source", [
    "from engine.core.fair_share import check_tenant",
    "import engine.values",
    "def f():\n    from engine.models.model_files import tokenizer_dir",
    "from engine import models",
    "from engine.api import not_a_public_name",
])
def test_the_check_catches_a_deep_import(source):
    assert len(deep_imports(source, "x.py")) == 1


@pytest.mark.parametrize("source", [
    "from engine.api import SamplingParams, check_tenant",
    "from engine import LLM, SamplingParams",
    "import engine\nimport engine.api\nfrom engine import api",
    "from enginex.values import convert\nfrom .engine import y",
])
def test_the_check_lets_the_surface_through(source):
    assert deep_imports(source, "x.py") == []


def test_every_public_name_resolves_and_engine_is_the_same_surface():
    assert len(set(api.__all__)) == len(api.__all__)
    assert PINNED <= set(api.__all__), PINNED - set(api.__all__)
    assert engine.__all__ == api.__all__
    for name in api.__all__:
        assert getattr(engine, name) is getattr(api, name), name
    with pytest.raises(AttributeError):
        api.not_a_public_name
    with pytest.raises(AttributeError):
        engine.not_a_public_name
