"""A `model` (or `tokenizer`) that names a Hugging Face repository rather than a path, as
vLLM and vllm_backend's sample model.json take it: the snapshot folder in the local HF
cache, found by huggingface_hub itself (HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE).

The cache is asked first, so a cached model loads without the network. Otherwise it is
downloaded, as vLLM would, unless HF_HUB_OFFLINE forbids it; either failure names the id."""
from __future__ import annotations

from pathlib import Path

# What a model folder needs here: config, tokenizer, chat template, safetensors weights
# (the loader reads nothing else), so a repository's other formats are not fetched.
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def looks_like_repo_id(name: str) -> bool:
    """`name` is shaped like an HF repository id ("org/model" or "model")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_snapshot(repo_id: str, what: str = "model") -> Path:
    """The local folder of `repo_id`'s snapshot. Raises ValueError naming the id when it
    is neither cached nor downloadable."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"{what}: {repo_id!r} is not a local path and not in the Hugging Face "
                         f"cache ({cache}); HF_HUB_OFFLINE is set, so it is not downloaded") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_DOWNLOAD_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - network, auth and missing repos all end here
        raise ValueError(f"{what}: {repo_id!r} is not a local path, not in the Hugging Face "
                         f"cache ({cache}), and could not be downloaded: "
                         f"{type(exc).__name__}: {exc}") from None
