"""Draft models for speculative decoding's tests and benches: a model folder cut to its
first layers, the layer-truncated draft the issue's figures use (same tokenizer and
embeddings as the target, so its guesses are the target's early-layer ones)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def truncated_copy(model_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """`model_dir` (an HF folder with safetensors) with its first `num_layers` decoder
    layers only, written to `out_dir`; the tokenizer and generation files are copied."""
    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            match = _LAYER.search(name)
            if match is None or int(match.group(1)) < num_layers:
                tensors[name] = tensor.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for path in src.iterdir():
        if path.suffix in (".json", ".jinja", ".txt", ".model") and path.name != "config.json" \
                and not path.name.endswith(".index.json"):
            shutil.copy(path, out / path.name)
    return out
