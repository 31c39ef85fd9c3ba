"""Which runner serves the model (vLLM's `runner` / `convert`, and the `task` alias they
replaced): "generate" samples tokens, "pooling" returns one vector per prompt (an
embedding, or a classifier's scores). One runner per engine, as in vLLM: a generation
engine refuses pooling requests and the other way round. Torch-free: the choice is made
from the model folder's config.json (and sentence-transformers' modules.json) before any
weight loads."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RUNNERS = ("auto", "generate", "pooling")
# vLLM 0.32's ConvertOption: "embed" turns a causal LM into an embedder (its final
# hidden states pooled); "classify" would add a score head (not offered here yet).
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM <= 0.12's `task`, removed by 0.32 in favour of runner/convert; taken here as the
# alias it was: score means "pool with the model as it is" (a cross-encoder scores
# pairs, an embedder scores by cosine), as vLLM 0.10 mapped it to convert "none".
TASKS = {"auto": ("auto", "auto"), "generate": ("generate", "auto"),
         "embed": ("pooling", "embed"), "classify": ("pooling", "classify"),
         "score": ("pooling", "none")}

# Encoder architectures the pooling runner runs (engine/models/bert.py), and the task
# each serves: its own hidden states pooled, or its classification head's scores.
ENCODER_TASKS = {
    "BertModel": "embed", "RobertaModel": "embed", "XLMRobertaModel": "embed",
    "BertForSequenceClassification": "classify",
    "RobertaForSequenceClassification": "classify",
    "XLMRobertaForSequenceClassification": "classify",
}


@dataclass(frozen=True, slots=True)
class RunnerChoice:
    runner: str            # "generate" | "pooling"
    task: str | None       # pooling only: "embed" | "classify"
    encoder: bool = False  # a bidirectional encoder (BERT family), no KV cache


def check_runner_args(runner: str, convert: str, task: str | None) -> tuple[str, str]:
    """The engine arguments' (runner, convert) once `task` is folded in; ValueError
    naming the argument that is bad or that contradicts another."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    if task is None:
        return runner, convert
    if task not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {task!r}")
    task_runner, task_convert = TASKS[task]
    if runner != "auto" and task_runner not in ("auto", runner):
        raise ValueError(f"task={task!r} means runner={task_runner!r}, but runner={runner!r}")
    if convert != "auto" and task_convert not in ("auto", convert):
        raise ValueError(f"task={task!r} means convert={task_convert!r}, but "
                         f"convert={convert!r}")
    return (runner if runner != "auto" else task_runner,
            convert if convert != "auto" else task_convert)


def has_sentence_transformers_pooling(model_dir: Path) -> bool:
    """A sentence-transformers folder (modules.json listing a Pooling module): vLLM's
    sign that a *ForCausalLM checkpoint is an embedder (Qwen3-Embedding ships so)."""
    path = Path(model_dir) / "modules.json"
    if not path.is_file():
        return False
    modules = json.loads(path.read_text(encoding="utf-8"))
    return any(str(m.get("type", "")).endswith("Pooling") for m in modules)


def resolve_runner(runner: str, convert: str, model_dir: Path) -> RunnerChoice:
    """vLLM's resolution for the architectures this engine runs. runner "auto": pooling
    for the encoders and for a folder with a sentence-transformers pooling config, else
    generate. Under pooling, convert "auto" keeps an encoder's own task and makes a
    causal LM an embedder ("embed"); a conversion the model cannot take is refused."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    archs = list(config.get("architectures") or [])
    arch = next((a for a in archs if a in ENCODER_TASKS), None)
    if runner == "auto":
        pooled = arch is not None or has_sentence_transformers_pooling(model_dir)
        runner = "pooling" if pooled or convert in ("embed", "classify") else "generate"
    if runner == "generate":
        if arch is not None:
            raise ValueError(f"runner='generate': {arch} is an encoder that generates no "
                             "tokens; serve it with runner='pooling'")
        if convert not in ("auto", "none"):
            raise ValueError(f"convert={convert!r} adapts a model for runner='pooling', "
                             "not runner='generate'")
        return RunnerChoice("generate", None)
    if arch is not None:
        own = ENCODER_TASKS[arch]
        if convert not in ("auto", "none", own):
            raise ValueError(f"convert={convert!r}: {arch} serves the {own!r} task as it "
                             f"is (convert 'auto' or 'none')")
        return RunnerChoice("pooling", own, encoder=True)
    if convert == "none":
        raise ValueError(f"runner='pooling' with convert='none': {archs} is not a pooling "
                         "model as it is; convert='embed' pools its final hidden states")
    if convert == "classify":
        raise ValueError(f"convert='classify' for {archs}: a causal LM with a score head "
                         "is not supported yet; convert='embed' makes it an embedder")
    return RunnerChoice("pooling", "embed")
