"""A model folder placed in a Hugging Face hub cache as huggingface_hub lays one out
(models--<org>--<name>/{blobs, refs/main, snapshots/<commit>}), so tests resolve a
repository id offline; huggingface_hub's scan_cache_dir checks the result."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_hf_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """Copies `folder`'s files into `cache` as repository `repo_id` at one commit and
    returns that snapshot's folder."""
    from huggingface_hub import scan_cache_dir

    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # any 40-hex commit id will do
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for source in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / source.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        # Snapshot entries are relative links into blobs/, as the hub client makes them.
        link.symlink_to(os.path.relpath(blob, link.parent))
    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    assert any(r.repo_id == repo_id and r.repo_type == "model" for r in info.repos)
    return snapshot
