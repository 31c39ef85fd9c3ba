"""A `model` that is a Hugging Face id: resolved through the local HF cache by
huggingface_hub (HF_HUB_CACHE, HF_HUB_OFFLINE read by it at import, so each case runs in
a fresh interpreter with its environment)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testing.hf_cache import add_to_hf_cache

REPO = Path(__file__).resolve().parents[3]
REPO_ID = "acme/tiny-llama"
# Loads the config and tokenizer the engine would, from what resolve_model_dir returns.
PROBE = """
import json, sys
from engine.models import load_tokenizer, resolve_model_dir
try:
    folder = resolve_model_dir(sys.argv[1])
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    ids = load_tokenizer(sys.argv[1]).encode("Hello")
    print(json.dumps({"folder": str(folder), "ids": ids}))
"""


def resolve(model: str, cache: Path, offline: bool = True, cwd: Path = REPO) -> dict:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE, model], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from testing.tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_hf_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path, tiny_dir):
    snapshot = add_to_hf_cache(tmp_path / "hub", REPO_ID, tiny_dir)
    got = resolve(REPO_ID, tmp_path / "hub")
    assert Path(got["folder"]) == snapshot
    from transformers import AutoTokenizer
    assert got["ids"] == AutoTokenizer.from_pretrained(tiny_dir).encode("Hello")


def test_uncached_id_offline_names_the_id_and_the_cache(tmp_path, tiny_dir):
    add_to_hf_cache(tmp_path / "hub", REPO_ID, tiny_dir)
    got = resolve("acme/not-here", tmp_path / "hub")
    assert "'acme/not-here'" in got["error"] and str(tmp_path / "hub") in got["error"]
    assert "HF_HUB_OFFLINE" in got["error"]


def test_local_paths_win_over_ids(tmp_path, tiny_dir):
    # A folder that exists is a folder, however its name reads.
    got = resolve(tiny_dir.name, tmp_path / "empty-hub", cwd=tiny_dir.parent)
    assert Path(got["folder"]) == Path(tiny_dir.name)
