"""What a model folder says about pooling, read as vLLM 0.32 reads it: the pooling mode
and normalisation from sentence-transformers' files (modules.json -> the Pooling
module's config.json, a Normalize module), the classifier's activation from config.json,
Matryoshka dimensions from config.json. Torch-free; anything whose output this engine
would get wrong (a Dense projection, max or weighted pooling, concatenated modes) is
refused by name instead of silently giving another vector."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("CLS", "LAST", "MEAN")
# sentence-transformers' pooling_mode_* keys (and its pooling_mode strings) -> ours.
_ST_MODES = {"cls_token": "CLS", "cls": "CLS", "mean_tokens": "MEAN", "mean": "MEAN",
             "lasttoken": "LAST"}
# Modules whose work is ours: the transformer itself, the pooling, the normalisation.
_ST_KNOWN = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True, slots=True)
class PoolerSettings:
    task: str                      # "embed" | "classify"
    pooling_type: str              # CLS | LAST | MEAN (a classifier reads CLS)
    # Whether the activation applies by default: an embedder's L2 normalisation (off only
    # when a sentence-transformers folder has no Normalize module), a classifier's
    # activation (its config may make it the identity).
    use_activation: bool
    # A classifier's activation: "sigmoid", "softmax" or "identity".
    classifier_activation: str = "identity"
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "model default"


def read_settings(model_dir: Path, hf_config: Any, task: str, default_pooling: str
                  ) -> PoolerSettings:
    """`default_pooling`: the architecture's (vLLM's: CLS for BERT-family encoders, LAST
    for causal LMs), used when no sentence-transformers file names one."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = dict(is_matryoshka=bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)),
                      matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)
    if task == "classify":
        # The classification head reads the first token ([CLS] / <s>) itself.
        return PoolerSettings("classify", "CLS", True, classifier_activation(hf_config),
                              **matryoshka)
    st = _sentence_transformers(Path(model_dir))
    if st is None:
        # vLLM: no file says otherwise, so embeddings come normalised.
        return PoolerSettings("embed", default_pooling, True, **matryoshka)
    pooling, normalize = st
    return PoolerSettings("embed", pooling or default_pooling, normalize,
                          source="sentence-transformers", **matryoshka)


def _sentence_transformers(model_dir: Path) -> tuple[str | None, bool] | None:
    """(pooling type or None, Normalize present) from modules.json; None without one."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text(encoding="utf-8"))
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = [kind for kind in kinds if kind not in _ST_KNOWN]
    if unknown:
        raise ValueError(f"model: {path} lists sentence-transformers modules {unknown}, "
                         f"which this engine does not run (it runs {list(_ST_KNOWN)})")
    normalize = "Normalize" in kinds
    pooling = next((m for m, kind in zip(modules, kinds) if kind == "Pooling"), None)
    if pooling is None:
        return None, normalize
    config_path = model_dir / pooling.get("path", "") / "config.json"
    if not config_path.is_file():
        return None, normalize
    return _pooling_mode(json.loads(config_path.read_text(encoding="utf-8")), config_path), \
        normalize


def _pooling_mode(config: dict, where: Path) -> str | None:
    named = config.get("pooling_mode")
    modes = [named] if isinstance(named, str) else []
    modes += [key.removeprefix("pooling_mode_") for key, value in config.items()
              if key.startswith("pooling_mode_") and value is True]
    modes = list(dict.fromkeys(modes))
    if not modes:
        return None
    if len(modes) > 1:
        # sentence-transformers concatenates the modes' vectors.
        raise ValueError(f"model: {where} turns on several pooling modes {modes}; "
                         "one of cls_token, mean_tokens, lasttoken is supported")
    if modes[0] not in _ST_MODES:
        raise ValueError(f"model: {where}: pooling mode {modes[0]!r} is not supported "
                         "(cls_token, mean_tokens, lasttoken are)")
    return _ST_MODES[modes[0]]


def classifier_activation(hf_config: Any) -> str:
    """vLLM 0.32's rule (model_executor/layers/pooler/activations.py get_act_fn): the
    config's problem_type first, then sentence-transformers' CrossEncoder activation,
    else sigmoid for one label and softmax for several. So a one-label cross-encoder's
    score is sigmoid(logit) unless its config names Identity; PoolingParams
    use_activation=False gives the raw logit."""
    num_labels = int(getattr(hf_config, "num_labels", 0) or 0)
    problem = getattr(hf_config, "problem_type", None) or ""
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    name = None
    st = getattr(hf_config, "sentence_transformers", None)
    if isinstance(st, dict) and "activation_fn" in st:
        name = st["activation_fn"]
    elif getattr(hf_config, "sbert_ce_default_activation_function", None) is not None:
        name = hf_config.sbert_ce_default_activation_function
    if name is not None and problem != "single_label_classification":
        kind = str(name).rsplit(".", 1)[-1]
        if kind == "Identity":
            return "identity"
        if kind not in ("Sigmoid", "Softmax"):
            raise ValueError(f"model: classifier activation {name!r} is not supported "
                             "(Identity, Sigmoid, Softmax are)")
    return "sigmoid" if num_labels < 2 else "softmax"
